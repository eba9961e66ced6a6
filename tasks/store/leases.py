"""One lock per store address, that dies with its holder: two runs of one config on one machine compute
an artifact once.

Two runs of one config on one machine must not compute the same shard at once (on a GPU node they would
fight for the same devices' memory): the flow's task takes the lock of the artifact's address
(`address_lock`) before it computes, so the second run waits, finds the first one's artifact committed
and reuses it (flows/caching.py). The lock only saves duplicated work: what is finished is decided by the
store's manifest alone, and two writers of one address are kept apart by their attempt folders
(tasks/store/writer.py), so taking over a lock that was not really dead costs work, never data.

A lock is a file `STORE/_locks/STAGE-DIGEST.lock` recording its owner (host, boot, pid, process start time:
tasks/core/owners.py) and a lease that a thread of the holding process renews. A waiter takes a lock over
at once when its owner is a dead process on this machine, and after the lease ran out (no renewal for
`lease_s`) when the owner is elsewhere (a store folder shared between machines) or cannot be checked.
Locks of older versions (Prefect's file lock: no owner recorded, never renewed, in `STORE/_prefect/locks`)
are cleared on sight; `draftline gc` lists stale locks of both folders (`lock_files`).

A waiter logs what it waits for, held by whom and since when, every `log_every_s`; gives up after `wait_s`
(DRAFTLINE_LOCK_WAIT_S, default 1 h) with an error that says what to do; and stops within a poll interval
when the run is asked to stop (tasks/core/stopping.py). On an s3:// store there is no lock (no atomic
create-if-absent that every S3 server has): concurrent runs there compute twice, but correctly.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

from tasks.core import owners, stopping
from tasks.core.errors import DraftlineError
from tasks.store.artifacts import Store
from tasks.core.capped import RECORD_CAP
from tasks.store.trust import RefusedStoreFile, read_capped

FORMAT = "draftline-lease-1"
DEFAULT_WAIT_S = 3600.0
DEFAULT_LEASE_S = 60.0
LOCKS = "_locks"  # STORE/_locks/: the store's address locks (the `_` keeps it out of listings and gc's walk)
OLD_LOCKS = ("_prefect", "locks")  # where versions that locked through Prefect left theirs

log = logging.getLogger("draftline.locks")


class LockWaitTimeout(DraftlineError, RuntimeError):
    """A live holder kept the lock longer than the waiter's bound."""


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="seconds")


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def read_lock(path: Path) -> dict[str, Any] | None:
    """The lock file's record; {} for one that is unreadable (being written, damaged, or not a small regular file:
    a FIFO or a huge file planted as a lock is never waited on or read whole); None if absent."""
    try:
        raw = read_capped(None, str(path), RECORD_CAP, local=True)
    except FileNotFoundError:
        return None
    except (OSError, RefusedStoreFile):
        return {}
    try:
        info = json.loads(raw)
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def why_stale(info: dict[str, Any], mtime: float, now: float | None = None) -> str | None:
    """Why a lock record no longer protects anything, or None while its holder may still be working."""
    now = time.time() if now is None else now
    if not info:
        return "unreadable lock file" if now - mtime > 10 else None  # a writer may be mid-write
    owner = info.get("owner")
    if info.get("format") != FORMAT or not isinstance(owner, dict):
        return ("left by an older draftline (Prefect's file lock: no owner recorded, never released when "
                "its run was killed)")
    live = owners.alive(owner)
    if live is False:
        return f"its holder, {owners.describe(owner)}, is gone"
    expires = float(info.get("expires") or 0)
    if live is None and expires < now:
        return (f"its lease ran out at {_iso(expires)} (holder {owners.describe(owner)} stopped renewing it "
                f"{now - float(info.get('renewed') or 0):.0f} s ago)")
    return None


class LeaseLocks:
    """The locks of one folder (see the module docstring). One instance per folder is shared by a process's
    threads (`address_lock` keeps them); `hold(key)` is the lock as a context manager."""

    def __init__(self, directory: Path, lease_s: float = DEFAULT_LEASE_S, wait_s: float | None = None,
                 poll_s: float = 0.25, log_every_s: float = 30.0):
        self.directory = Path(directory).expanduser().resolve()
        self.lease_s = lease_s
        env_wait = os.environ.get("DRAFTLINE_LOCK_WAIT_S")
        self.wait_s = float(env_wait) if wait_s is None and env_wait else (wait_s or DEFAULT_WAIT_S)
        self.poll_s = poll_s
        self.log_every_s = log_every_s
        self._held: dict[str, dict[str, Any]] = {}  # key -> the record we wrote
        self._mutex = threading.Lock()
        self._renewer: threading.Thread | None = None

    # ------------------------------------------------------------------ files
    def path(self, key: str) -> Path:
        return self.directory / f"{key}.lock"

    def _record(self, key: str, holder: str, note: dict[str, Any]) -> dict[str, Any]:
        now = time.time()
        return {"format": FORMAT, "key": key, "holder": holder, "owner": owners.me(), **note,
                "since": now, "renewed": now, "expires": now + self.lease_s}

    def _create(self, key: str, record: dict[str, Any]) -> bool:
        """Publish `record` as the lock file only if none exists (link: atomic, content complete)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".{key}.{uuid.uuid4().hex}.tmp"
        tmp.write_text(json.dumps(record))
        try:
            os.link(tmp, self.path(key))
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def _break(self, key: str, seen: dict[str, Any], why: str) -> None:
        """Remove a stale lock, unless it changed since it was judged (its holder renewed it)."""
        path = self.path(key)
        grave = self.directory / f".{key}.{uuid.uuid4().hex}.stale"
        try:
            os.rename(path, grave)  # one waiter wins; the others find no file
        except FileNotFoundError:
            return
        now_seen = read_lock(grave)
        if seen and now_seen and now_seen != seen:
            with contextlib.suppress(FileExistsError, FileNotFoundError):
                os.link(grave, path)  # renewed in between: put it back
            grave.unlink(missing_ok=True)
            return
        grave.unlink(missing_ok=True)
        log.warning(f"cleared a stale lock on {key}: {why}")

    # ------------------------------------------------------------------ renewal
    def _renew_loop(self) -> None:
        while True:
            time.sleep(max(0.05, self.lease_s / 4))
            with self._mutex:
                held = dict(self._held)
                if not held:
                    self._renewer = None
                    return
            for key, rec in held.items():
                cur = read_lock(self.path(key))
                if not cur or cur.get("holder") != rec["holder"]:
                    continue  # released, or taken over after our lease ran out
                now = time.time()
                new = {**rec, "renewed": now, "expires": now + self.lease_s}
                tmp = self.directory / f".{key}.{uuid.uuid4().hex}.tmp"
                with contextlib.suppress(OSError):
                    tmp.write_text(json.dumps(new))
                    os.replace(tmp, self.path(key))
                    with self._mutex:
                        if key in self._held:
                            self._held[key] = new

    def _keep(self, key: str, record: dict[str, Any]) -> None:
        with self._mutex:
            self._held[key] = record
            if self._renewer is None:
                self._renewer = threading.Thread(target=self._renew_loop, name="draftline-lock-lease", daemon=True)
                self._renewer.start()

    # ------------------------------------------------------------------ waiting
    def _wait_free(self, key: str) -> None:
        """Wait until `key` is unlocked: clears stale locks, logs while it waits, raises LockWaitTimeout after
        `wait_s` and stopping.Stopped when the run is asked to stop."""
        t0 = time.time()
        next_log = t0
        path = self.path(key)
        while True:
            info = read_lock(path)
            if info is None:
                return
            try:
                mtime = path.stat().st_mtime
            except FileNotFoundError:
                continue
            why = why_stale(info, mtime)
            if why:
                self._break(key, info, why)
                continue
            now = time.time()
            owner = info.get("owner") or {}
            who = (f"{owners.describe(owner)}" + (f", flow run {info['flow_run']}" if info.get("flow_run") else "")
                   + f", holding it since {_clock(float(info.get('since') or mtime))}")
            if now - t0 >= self.wait_s:
                raise LockWaitTimeout(
                    f"waited {now - t0:.0f} s for the lock on {key} ({who}); gave up after "
                    f"DRAFTLINE_LOCK_WAIT_S={self.wait_s:.0f} s. Another run is computing this artifact: let it "
                    f"finish and run again (its result is reused), stop it, or raise DRAFTLINE_LOCK_WAIT_S. "
                    f"`draftline gc` lists locks and their owners.")
            if now >= next_log:
                log.info(f"waiting for the lock on {key}: {who}; waited {now - t0:.0f} s, giving up at "
                         f"{_clock(t0 + self.wait_s)} (DRAFTLINE_LOCK_WAIT_S={self.wait_s:.0f})")
                next_log = now + self.log_every_s
            stopping.wait(self.poll_s, f"waiting for the lock on {key}")

    # ------------------------------------------------------------------ taking and giving back
    def acquire(self, key: str, note: dict[str, Any] | None = None) -> str:
        """Take the lock on `key`, waiting for a live holder; returns this holding's token for `release`.
        NOTE (e.g. the flow run) is recorded in the lock file for the waiters' log lines."""
        holder = uuid.uuid4().hex
        while True:
            stopping.check(f"taking the lock on {key}")
            record = self._record(key, holder, note or {})
            if self._create(key, record):
                self._keep(key, record)
                return holder
            self._wait_free(key)

    def release(self, key: str, holder: str) -> None:
        with self._mutex:
            self._held.pop(key, None)
        info = read_lock(self.path(key))
        if info and info.get("holder") == holder:
            self.path(key).unlink(missing_ok=True)
        # else: already gone, or taken over after our lease ran out: nothing of ours to remove

    @contextlib.contextmanager
    def hold(self, key: str, note: dict[str, Any] | None = None) -> Iterator[None]:
        holder = self.acquire(key, note)
        try:
            yield
        finally:
            self.release(key, holder)


_FOLDERS: dict[Path, LeaseLocks] = {}
_FOLDERS_MUTEX = threading.Lock()


def lock_folder(store: Store, old: bool = False) -> Path:
    """STORE/_locks of a file:// store (OLD: the folder versions that locked through Prefect used)."""
    return Path(store.root).joinpath(*(OLD_LOCKS if old else (LOCKS,)))


def address_lock(store: Store, stage: str, digest: str, note: dict[str, Any] | None = None):
    """The lock of STAGE/DIGEST as a context manager: a lease lock on a file:// store, nothing on s3://."""
    if not store.is_local:
        return contextlib.nullcontext()
    store.ensure_marker()  # the lock is the run's first write here: gc and `store init` know the root as a store
    folder = lock_folder(store).resolve()
    with _FOLDERS_MUTEX:
        locks = _FOLDERS.setdefault(folder, LeaseLocks(folder))
    return locks.hold(f"{stage}-{digest}", note)


def lock_files(directory: Path) -> list[tuple[Path, dict[str, Any], str | None]]:
    """(path, record, why it is stale or None) for every lock file under `directory` (for `draftline gc`)."""
    out = []
    if not directory.is_dir():
        return out
    for p in sorted(directory.glob("*.lock")):
        info = read_lock(p)
        if info is None:
            continue
        with contextlib.suppress(FileNotFoundError):
            out.append((p, info, why_stale(info, p.stat().st_mtime)))
    return out
