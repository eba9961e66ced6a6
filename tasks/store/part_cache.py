"""The node-local part cache: each byte of an S3 store crosses the network once per node.

Training reads the same extraction parts every epoch. Without a cache every epoch downloads every part
again; with it, the first rank of a node that needs a part streams it from the store into a file named
by the part's sha256 (from the artifact's manifest), and every later read on that node, by any rank, in
any epoch, is a local read. The parts are dealt to ranks with an affinity that holds across epochs
(tasks/train/stream.py), so a node only ever fills its own share.

Layout under the root (`DRAFTLINE_CACHE_DIR`, default `parts` under DRAFTLINE_HOME or ~/.cache/draftline):

    data/<sha[:2]>/<sha256>    a verified part; published by rename, so never half-written
    locks/<sha256>.lease       flock: shared while a process uses the entry, exclusive to evict it
    locks/<sha256>.fill        flock: exclusive while one process fills the entry
    tmp/<sha256>.<pid>-<start>.tmp   a fill in progress (its owner's pid and start time)

- One filler per part: the others block on its fill lock, then find the entry and reuse it. A lock is
  an flock, so the kernel releases it when its holder dies, SIGKILL included.
- A filler streams the part (ranged reads, `Artifact.copy_to`), hashing on the fly; only a part whose
  size and sha256 match is fsynced and renamed into `data/`. A killed filler leaves its temp file,
  which is never read as data and is removed by the next filler of that part (it holds the fill lock,
  so no other fill of that part runs) or listed by `draftline gc` (`leftovers`).
- Every process hashes an entry once before its first use (the filler already did while streaming):
  a corrupt or truncated file is removed and fetched again.
- The size cap (`train.cache_gib`, else `DRAFTLINE_CACHE_GIB`, else 90% of the cache disk's free space
  plus what the cache already holds) is kept by evicting the least recently used entries before a fill;
  an entry a live process holds (its lease) is never evicted. If only leased entries are left, the fill
  goes over the cap and says so.

The cap and the folder are scheduling: they never enter an artifact's address.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from tasks.core.errors import DraftlineError, full_disk_as
from tasks.core import owners
from tasks.core.home import cache_home, lock_fd, unlock_fd
from tasks.core.faults import kill_point

log = logging.getLogger("draftline.part_cache")

CACHE_DIR_ENV = "DRAFTLINE_CACHE_DIR"
CACHE_GIB_ENV = "DRAFTLINE_CACHE_GIB"
DEFAULT_DISK_FRACTION = 0.9
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_TMP_RE = re.compile(r"^([0-9a-f]{64})\.(\d+)-(\d+)\.tmp$")
_HASH_CHUNK = 8 << 20


class PartCacheError(DraftlineError, RuntimeError):
    """The cache cannot hold a part (the message says what to change)."""


def default_root() -> Path:
    """`DRAFTLINE_CACHE_DIR`, else `parts` in draftline's cache folder (DRAFTLINE_HOME: on a node set up by
    infra/node-bootstrap.sh, its NVMe; else ~/.cache/draftline)."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return cache_home() / "parts"


def cap_from(cache_gib: float | None) -> float | None:
    """The cap in GiB: the config's, else the environment's; None = the default (from free space);
    0 = no cache."""
    if cache_gib is not None:
        return float(cache_gib)
    raw = os.environ.get(CACHE_GIB_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise PartCacheError(f"{CACHE_GIB_ENV}={raw!r} is not a number of GiB; set e.g. {CACHE_GIB_ENV}=500 "
                             "(0 turns the part cache off)") from None
    if value < 0:
        raise PartCacheError(f"{CACHE_GIB_ENV}={raw!r} is negative; give the cap in GiB (0 turns the cache off)")
    return value


@dataclass
class Lease:
    """A cached part held for use: `path` stays valid (not evicted) until `release()`."""

    path: str
    sha256: str
    fetched: int  # bytes this lease fetched from the store (0: a hit)
    _fd: int | None = field(default=None, repr=False)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        unlock_fd(fd)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


@dataclass
class CacheStats:
    hits: int = 0
    fills: int = 0
    waits: int = 0  # another process filled the part while this one waited for it
    fetched_bytes: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    refetched_corrupt: int = 0


class PartCache:
    """A node-local cache of files keyed by sha256. Thread- and process-safe (flock per entry)."""

    def __init__(self, root: str | os.PathLike | None = None, cap_gib: float | None = None):
        self.root = Path(root) if root is not None else default_root()
        self.data, self.locks, self.tmp = self.root / "data", self.root / "locks", self.root / "tmp"
        for d in (self.data, self.locks, self.tmp):
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise PartCacheError(f"part cache folder {d} cannot be made ({exc.strerror}); point "
                                     f"{CACHE_DIR_ENV} at a writable local disk, or set train.cache_gib: 0 to "
                                     "read parts from the store every time") from None
        if cap_gib is None:
            free = shutil.disk_usage(self.root).free
            self.cap = int(DEFAULT_DISK_FRACTION * (free + self.used_bytes()))
            self.cap_source = f"{DEFAULT_DISK_FRACTION:.0%} of the free disk plus the cache's own bytes"
        else:
            self.cap = int(cap_gib * (1 << 30))
            self.cap_source = "train.cache_gib / " + CACHE_GIB_ENV
        self.stats = CacheStats()
        self._verified: set[tuple[str, int, int]] = set()  # (sha, inode, size) hashed by this process
        self._lock = threading.Lock()

    @classmethod
    def for_store(cls, store: Any, cache_gib: float | None) -> "PartCache | None":
        """The cache a run over `store` uses: None for a file:// store (its files are already local)
        or a cap of 0."""
        if store.is_local:
            return None
        cap = cap_from(cache_gib)
        if cap == 0:
            return None
        cache = cls(cap_gib=cap)
        log.info("part cache %s, cap %.1f GiB (%s)", cache.root, cache.cap / (1 << 30), cache.cap_source)
        return cache

    # ---------------------------------------------------------------- paths
    def path(self, sha256: str) -> Path:
        if not _SHA_RE.match(sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256!r}")
        return self.data / sha256[:2] / sha256

    def _lease_lock(self, sha256: str) -> Path:
        return self.locks / f"{sha256}.lease"

    def _fill_lock(self, sha256: str) -> Path:
        return self.locks / f"{sha256}.fill"

    def entries(self) -> list[tuple[str, int, float]]:
        """(sha256, bytes, last use) of every published entry."""
        out = []
        for sub in self.data.iterdir() if self.data.is_dir() else []:
            for f in sub.iterdir() if sub.is_dir() else []:
                if _SHA_RE.match(f.name):
                    with contextlib.suppress(FileNotFoundError):
                        st = f.stat()
                        out.append((f.name, st.st_size, st.st_mtime))
        return out

    def used_bytes(self) -> int:
        return sum(b for _, b, _ in self.entries())

    # ---------------------------------------------------------------- use
    def lease(self, sha256: str, size: int, fill: Callable[[IO[bytes]], Any]) -> Lease:
        """The entry for `sha256` (`size` bytes), filled by `fill(fh)` if this node has none yet (or a
        corrupt one); held until the lease is released. `fill` writes the part into `fh` and raises if
        what it wrote is not the part (Artifact.copy_to does both)."""
        path = self.path(sha256)
        fd = lock_fd(self._lease_lock(sha256), fcntl.LOCK_SH)
        try:
            fetched = 0
            if not self._usable(sha256, size, path):
                fetched = self._fill(sha256, size, fill, path)
            else:
                with self._lock:
                    self.stats.hits += 1
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)  # the LRU clock
            return Lease(str(path), sha256, fetched, fd)
        except BaseException:
            unlock_fd(fd)
            raise

    def _usable(self, sha256: str, size: int, path: Path, fill_locked: bool = False) -> bool:
        """True if `path` holds the part: the size always, the sha256 once per process and file. A file
        that fails is removed (under the fill lock, so never while another process fills it; `fill_locked`:
        this thread holds it already)."""
        try:
            st = path.stat()
        except FileNotFoundError:
            return False
        key = (sha256, st.st_ino, st.st_size)
        if st.st_size == size and key in self._verified:
            return True
        ok = st.st_size == size and _sha256_file(path) == sha256
        if ok:
            with self._lock:
                self._verified.add(key)
            return True
        fd = None if fill_locked else lock_fd(self._fill_lock(sha256), fcntl.LOCK_EX)
        try:
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == st.st_ino:  # not already replaced by a fresh fill
                    os.unlink(path)
                    log.warning("part cache: %s failed its %s check; removed, fetching it again", path,
                                "size" if st.st_size != size else "sha256")
                    with self._lock:
                        self.stats.refetched_corrupt += 1
        finally:
            unlock_fd(fd)
        return False

    def _fill(self, sha256: str, size: int, fill: Callable[[IO[bytes]], Any], path: Path) -> int:
        t0 = time.perf_counter()
        fd = lock_fd(self._fill_lock(sha256), fcntl.LOCK_EX)  # one filler per part; a dead one's lock is freed
        try:
            waited = time.perf_counter() - t0
            if path.exists() and self._usable(sha256, size, path, fill_locked=True):
                with self._lock:
                    self.stats.waits += 1
                log.debug("part cache: %s filled by another process while this one waited %.1f s", sha256, waited)
                return 0
            self._remove_dead_temps(sha256)
            self._make_room(size, keep=sha256)
            st = owners._stat(os.getpid())
            tmp = self.tmp / f"{sha256}.{os.getpid()}-{st[1] if st else 0}.tmp"
            full = full_disk_as(lambda exc: PartCacheError(
                f"the part cache's disk ({self.root}) is full while caching a {size / 1e9:.2f} GB part: lower "
                f"train.cache_gib (now {self.cap / (1 << 30):.1f} GiB), free space there, or point {CACHE_DIR_ENV} "
                "at a bigger disk"))
            try:
                with full:
                    with open(tmp, "wb") as fh:
                        fill(_KillPointWriter(fh))
                        fh.flush()
                        os.fsync(fh.fileno())
                    if os.path.getsize(tmp) != size:
                        raise PartCacheError(f"filling {sha256} wrote {os.path.getsize(tmp)} bytes, expected {size}")
                    path.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(tmp, path)  # atomic publish: the entry is whole or absent
                    _fsync_dir(path.parent)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            st2 = path.stat()
            with self._lock:
                self._verified.add((sha256, st2.st_ino, st2.st_size))  # hashed while streaming (by `fill`)
                self.stats.fills += 1
                self.stats.fetched_bytes += size
            return size
        finally:
            unlock_fd(fd)

    # ---------------------------------------------------------------- room
    def _make_room(self, size: int, keep: str) -> None:
        if size > self.cap:
            raise PartCacheError(f"a part of {size / (1 << 30):.2f} GiB is larger than the part cache's cap of "
                                 f"{self.cap / (1 << 30):.2f} GiB ({self.cap_source}): raise train.cache_gib (or "
                                 f"{CACHE_GIB_ENV}), or set it to 0 to read parts from the store every time")
        entries = sorted(self.entries(), key=lambda e: e[2])  # least recently used first
        used = sum(b for _, b, _ in entries)
        for sha, nbytes, _ in entries:
            if used + size <= self.cap:
                return
            if sha == keep:
                continue
            if self._evict(sha):
                used -= nbytes
                with self._lock:
                    self.stats.evicted += 1
                    self.stats.evicted_bytes += nbytes
        if used + size > self.cap:
            log.warning("part cache over its cap: %.2f GiB held by live readers + %.2f GiB to fill > %.2f GiB; "
                        "the next fill evicts them once released", used / (1 << 30), size / (1 << 30),
                        self.cap / (1 << 30))

    def _evict(self, sha256: str) -> bool:
        """Remove an entry nobody holds; False if a live process leases it."""
        lock = self._lease_lock(sha256)
        fd = lock_fd(lock, fcntl.LOCK_EX, block=False)
        if fd is None:
            return False
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(sha256))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)  # while held: a waiter re-opens (see lock_fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._fill_lock(sha256))  # harmless: flocks are re-checked by inode
            return True
        finally:
            unlock_fd(fd)

    # ---------------------------------------------------------------- leftovers
    def _remove_dead_temps(self, sha256: str) -> None:
        """Temp files of `sha256`: their fillers are dead, since this process holds the part's fill lock."""
        for f in self.tmp.glob(f"{sha256}.*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                log.info("part cache: removing %s, left by a filler that died", f)
                f.unlink()

    def dead_temps(self) -> list[tuple[Path, float, str]]:
        """(path, age in seconds, owner) of temp files whose filler is no longer running."""
        out = []
        now = time.time()
        for f in self.tmp.glob("*.tmp") if self.tmp.is_dir() else []:
            m = _TMP_RE.match(f.name)
            if not m:
                continue
            pid, start = int(m.group(2)), int(m.group(3))
            st = owners._stat(pid)
            if st is not None and st[0] not in ("Z", "X") and st[1] == start:
                continue  # its filler still runs
            with contextlib.suppress(FileNotFoundError):
                out.append((f, now - f.stat().st_mtime, f"pid {pid} (dead)"))
        return out


class _KillPointWriter:
    """The fill's file, with the `cache.mid-fill` drill point once the first chunk is written."""

    def __init__(self, fh: IO[bytes]):
        self.fh, self.n = fh, 0

    def write(self, b: Any) -> int:
        n = self.fh.write(b)
        first = self.n == 0
        self.n += len(b)
        if first:
            self.fh.flush()  # the drill's temp file holds what was written before the kill
            kill_point("cache.mid-fill")
        return n


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def cached_copy(cache: PartCache | None, art: Any, name: str, verify: bool = True) -> Iterator[str]:
    """A local path holding `art`'s file `name`: through the node cache when there is one, else
    `Artifact.local_copy`."""
    if cache is None or art.store.is_local:
        with art.local_copy(name, verify=verify) as path:
            yield path
        return
    entry = art.manifest.file(name)
    with cache.lease(entry.sha256, entry.bytes, lambda fh: art.copy_to(name, fh)) as lease:
        yield lease.path
