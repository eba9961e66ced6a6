"""The artifact store: one fsspec filesystem, `file://` or `s3://`.

An artifact is the prefix `STAGE/DIGEST/`. Its data files live under an
attempt folder `STAGE/DIGEST/<attempt>/...` and are published by
`STAGE/DIGEST/manifest.json`, written LAST and atomically (S3 PUT; rename on a
local disk). The manifest lists every file with its size and sha256, so:

- a writer that dies before its manifest leaves nothing visible (`gc` removes
  the attempt folder later: its name is `owners.owned_name("attempt")` and it holds its writer's
  owner record, `.draftline-owner.json`, so gc knows it is draftline's and whether its writer runs);
- the store's root holds `draftline-store.json` (STORE_MARKER), written by `draftline store init` and
  by the first write of any run: `gc` deletes nothing under a root without it;
- two writers of one digest each write their own attempt; whichever manifest
  lands names a complete set of files, so readers always see one valid artifact;
- readers check sizes on open and sha256 when they read a file, and treat a
  mismatch as "not there" (`ArtifactCorrupt`), which makes the stage run again.

Credentials never pass through here as arguments: s3fs/botocore read
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN / AWS_PROFILE from
the environment (or a prefect-aws block fills them in, see `resolve_credentials`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import hashlib
import io
import json
import os
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterator

import fsspec
from pydantic import BaseModel, Field

from tasks.core import owners
from tasks.core.errors import DraftlineError
from tasks.core.config import StoreConfig, with_scheme
from tasks.core.faults import kill_point
from tasks.store.model import (COMMITTED_HERE, MANIFEST, ArtifactCorrupt, ArtifactMissing, ArtifactRef,  # noqa: F401
                               BucketMissing, FileEntry, Manifest, NotAStore, StoreError)
from tasks.store.manifests import file_sizes, read_manifests, read_options
from tasks.store.uploads import open_for_write, upload_options
from tasks.store.trust import (MANIFEST_CAP, NAME_RE as _NAME_RE, RECORD_CAP, RefusedStoreFile, UnsafePath,  # noqa: F401
                               check_manifest_address, check_name, check_relpath, read_capped, safe_join)

STORE_MARKER = "draftline-store.json"  # at the store's root: what says "draftline wrote here"
_OWNER_BEAT_S = 60  # a writer refreshes its attempt's owner record (its lease) at most this often
_HASH_CHUNK = 8 << 20
_COPY_CHUNK = 16 << 20  # ranged GETs of a streamed copy (Artifact.copy_to)
_COPY_INFLIGHT = 4  # ... in flight at once
# botocore "standard" retries per S3 request (backoff: random up to 1, 2, 4, ... 20 s between attempts).
S3_MAX_ATTEMPTS = 8
_KILL_MID_FILE_BYTES = 4096  # tasks/core/faults.py: `store.STAGE.mid-file` fires once a file holds this much
_PARALLEL_HASH_MIN = 1 << 20  # writes this big are hashed on a helper thread while they are written
_HASHER: ThreadPoolExecutor | None = None
_HASHER_LOCK = threading.Lock()


def _hasher() -> ThreadPoolExecutor:
    """Threads that hash large writes while the writing thread writes them (shared by all writers;
    each write waits for its own hash, so a file's hash is updated in order)."""
    global _HASHER
    with _HASHER_LOCK:
        if _HASHER is None:
            _HASHER = ThreadPoolExecutor(4, thread_name_prefix="draftline-sha256")
        return _HASHER


def _forget_hasher() -> None:
    global _HASHER, _HASHER_LOCK
    _HASHER, _HASHER_LOCK = None, threading.Lock()  # a forked child has none of the parent's threads


os.register_at_fork(after_in_child=_forget_hasher)


def canonical_uri(uri: str) -> str:
    """One store, one URI, however it is written: a bare folder gets `file://`; a file:// folder is made absolute
    (relative to the current folder, `~` expanded, symlinks resolved); no trailing slash. `file://.draftline/store`,
    `file:///CHECKOUT/.draftline/store/` and `.draftline/store` run from the checkout are one store. Every comparison
    of store URIs compares these (the Store's own `uri` is one)."""
    scheme, rest = with_scheme(uri).split("://", 1)
    if scheme == "file":
        return f"file://{Path(rest).expanduser().resolve()}"
    return f"{scheme}://{rest.rstrip('/')}"


@contextlib.contextmanager
def _space_errors(store_uri: str, key: str) -> Iterator[None]:
    """A full disk (or a file-size limit) while writing to the store becomes a StoreError that says so."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise
        raise StoreError(
            f"writing {key} failed: {exc.strerror} (the store's disk is full or over a size limit); nothing was "
            f"committed: free space on {store_uri} or point store.uri at a bigger store, then retry the run "
            "(finished work is reused)"
        ) from None


def s3_endpoint(cfg: StoreConfig | None = None) -> str | None:
    """The S3 endpoint: `store.endpoint_url`, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL; None means AWS."""
    return ((cfg.endpoint_url if cfg is not None else None) or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL"))


def resolve_credentials(cfg: StoreConfig) -> dict[str, Any]:
    """storage_options for s3fs. Keys only from the environment or a Prefect block."""
    opts: dict[str, Any] = upload_options(cfg.upload_part_mb, cfg.upload_concurrency)
    endpoint = s3_endpoint(cfg)
    client_kwargs: dict[str, Any] = {}
    if endpoint:
        client_kwargs["endpoint_url"] = endpoint
    region = cfg.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        client_kwargs["region_name"] = region
    if client_kwargs:
        opts["client_kwargs"] = client_kwargs
    if cfg.credentials_block:
        try:
            from prefect_aws import AwsCredentials
        except ImportError as exc:  # pragma: no cover - prefect-aws is a dependency
            raise StoreError("store.credentials_block needs prefect-aws: pip install prefect-aws") from exc
        try:
            block = AwsCredentials.load(cfg.credentials_block)
        except Exception as exc:
            raise StoreError(
                f"cannot load AwsCredentials block {cfg.credentials_block!r}: {exc}; "
                "create it in the Prefect UI or unset store.credentials_block and use AWS_* variables"
            ) from None
        opts["key"] = block.aws_access_key_id
        if block.aws_secret_access_key is not None:
            opts["secret"] = block.aws_secret_access_key.get_secret_value()
        if block.aws_session_token is not None:
            opts["token"] = block.aws_session_token
    if endpoint and "amazonaws.com" not in endpoint:
        # Non-AWS servers (SeaweedFS, MinIO, Ceph) reject the newer default checksums.
        os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
        os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
    if not (os.environ.get("AWS_MAX_ATTEMPTS") or os.environ.get("AWS_RETRY_MODE")):
        # Ride out a store that is briefly gone or busy (restart, failover, 503 SlowDown): every request
        # (each multipart part, the manifest PUT) is retried with exponential backoff, ~30 s in all,
        # before the stage fails. AWS_MAX_ATTEMPTS / AWS_RETRY_MODE in the environment override this.
        opts["config_kwargs"] = {"retries": {"max_attempts": S3_MAX_ATTEMPTS, "mode": "standard"}}
    return opts


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class Artifact:
    """A committed artifact opened for reading."""

    store: "Store"
    manifest: Manifest

    @property
    def stage(self) -> str:
        return self.manifest.stage

    @property
    def digest(self) -> str:
        return self.manifest.digest

    @property
    def stats(self) -> dict[str, Any]:
        return self.manifest.stats

    @property
    def uri(self) -> str:
        return self.store.uri_of(self.stage, self.digest)

    def ref(self) -> ArtifactRef:
        return ArtifactRef(stage=self.stage, digest=self.digest, uri=self.uri, attempt=self.manifest.attempt,
                           created=self.manifest.created, stats=self.stats)

    def files(self, prefix: str = "") -> list[str]:
        return [f.path for f in self.manifest.files if f.path.startswith(prefix)]

    def key(self, name: str) -> str:
        """Where file `name` of this artifact lives on the store (a local path on a file:// store)."""
        self.manifest.file(name)
        return self.store.key(self.stage, self.digest, self.manifest.attempt, name)

    def read_bytes(self, name: str, verify: bool = True) -> bytes:
        entry = self.manifest.file(name)
        try:
            data = self.store.fs.cat_file(self.key(name), **read_options(self.store.fs, entry.bytes))
        except FileNotFoundError:
            raise ArtifactCorrupt(f"{self.uri}: file {name} listed in the manifest is missing") from None
        if len(data) != entry.bytes:
            self._corrupt(f"{name} has {len(data)} bytes, manifest says {entry.bytes}")
        if verify and hashlib.sha256(data).hexdigest() != entry.sha256:
            self._corrupt(f"{name} fails its sha256 check (corrupted on the store)")
        return data

    def _corrupt(self, why: str) -> None:
        """Un-commit the artifact so the stage that made it runs again, then raise. A stale reader (its
        manifest was replaced by a newer commit while it read) leaves the newer manifest alone."""
        if self.store.quarantine(self.stage, self.digest, why, seen=self.manifest):
            raise ArtifactCorrupt(f"{self.uri}: {why}; the artifact was un-committed and will be recomputed on retry")
        raise ArtifactCorrupt(f"{self.uri}: {why}, in attempt {self.manifest.attempt}, which a newer commit has "
                              "replaced since this reader opened it; the newer one was left as it is: read the "
                              "artifact again")

    def read_json(self, name: str) -> Any:
        return json.loads(self.read_bytes(name))

    @contextlib.contextmanager
    def local_copy(self, name: str, verify: bool = True) -> Iterator[str]:
        """A local path holding the verified file (the file itself when the store is local; else a
        temporary copy streamed from the store, never the whole file in memory)."""
        if self.store.is_local:
            path = self.key(name)
            if verify:
                self.verify_file(name)
            yield path
            return
        with owners.owned_temporary_directory("copy") as tmp:  # gc keeps it while this process lives
            local = os.path.join(tmp, os.path.basename(name))
            with open(local, "wb") as fh:
                self.copy_to(name, fh, verify=verify)
            yield local

    @contextlib.contextmanager
    def local_folder(self, prefix: str, verify: bool = True, names: list[str] | None = None) -> Iterator[str]:
        """A fresh local folder holding the listed files under `prefix` (e.g. "draft/"; `names`: only those),
        verified as they are copied: never the artifact's own folder, whose unlisted files (anything a store
        writer put beside the listed ones) must not reach whoever reads the folder."""
        names = self.files(prefix) if names is None else [n for n in names if n.startswith(prefix)]
        with owners.owned_temporary_directory("copy") as tmp:  # gc keeps it while this process lives
            for n in names:
                local = safe_join(tmp, n)
                os.makedirs(os.path.dirname(local), exist_ok=True)
                with open(local, "wb") as fh:
                    self.copy_to(n, fh, verify=verify)
            yield os.path.join(tmp, prefix).rstrip("/")

    def copy_to(self, name: str, fh: IO[bytes], verify: bool = True, chunk: int = _COPY_CHUNK,
                inflight: int = _COPY_INFLIGHT) -> int:
        """Stream file `name` into `fh` (written in order): ranged reads of `chunk` bytes, up to `inflight`
        of them in flight on helper threads (memory: inflight x chunk), sha256 computed on the fly. A size
        or sha256 mismatch un-commits the artifact (ArtifactCorrupt) after what was written; the caller
        owns `fh` and discards it then. Returns the bytes written."""
        entry = self.manifest.file(name)
        key = self.key(name)
        fs = self.store.fs
        h = hashlib.sha256() if verify else None
        done = 0

        def get(start: int) -> bytes:
            return fs.cat_file(key, start=start, end=min(start + chunk, entry.bytes))

        try:
            with ThreadPoolExecutor(max(1, inflight), thread_name_prefix="draftline-get") as pool:
                pending: list[Any] = []
                for start in range(0, entry.bytes, chunk):
                    pending.append(pool.submit(get, start))
                    if len(pending) >= inflight:
                        done += self._take(pending.pop(0), fh, h)
                while pending:
                    done += self._take(pending.pop(0), fh, h)
        except FileNotFoundError:
            self._corrupt(f"file {name} listed in the manifest is missing")
        if done != entry.bytes or (h is not None and h.hexdigest() != entry.sha256):
            self._corrupt(f"{name} fails its size/sha256 check (corrupted on the store)")
        return done

    @staticmethod
    def _take(fut: Any, fh: IO[bytes], h: Any) -> int:
        data = fut.result()
        if h is not None:
            h.update(data)
        fh.write(data)
        return len(data)

    def verify_file(self, name: str) -> None:
        entry = self.manifest.file(name)
        h = hashlib.sha256()
        n = 0
        try:
            with self.store.fs.open(self.key(name), "rb") as fh:
                while chunk := fh.read(_HASH_CHUNK):
                    h.update(chunk)
                    n += len(chunk)
        except FileNotFoundError:
            self._corrupt(f"file {name} listed in the manifest is missing")
        if n != entry.bytes or h.hexdigest() != entry.sha256:
            self._corrupt(f"{name} fails its size/sha256 check (corrupted on the store)")

    def verify(self, checksums: bool = True, only: str | None = None) -> None:
        for f in self.manifest.files:
            if only is not None and f.path != only:
                continue
            if checksums:
                self.verify_file(f.path)
            else:
                key = self.key(f.path)
                try:
                    size = self.store.fs.size(key)
                except FileNotFoundError:
                    raise ArtifactCorrupt(f"{self.uri}: file {f.path} is missing") from None
                if size != f.bytes:
                    raise ArtifactCorrupt(f"{self.uri}: {f.path} has {size} bytes, manifest says {f.bytes}")


# Attempt folders of draftline before owner records (`a<time>-<host tag>-<pid>-<8 hex>`): still draftline's
# leftovers, but the tag cannot tell hosts apart, so they go by age only.
_LEGACY_ATTEMPT_RE = re.compile(r"^a\d{8}T\d{6}-[A-Za-z0-9]{1,16}-\d+-[0-9a-f]{8}$")
_TEMP_FILE_RE = re.compile(r"^manifest\.json\.tmp-[0-9a-f]{32}$")


def is_attempt_name(name: str) -> bool:
    """Whether a folder under STAGE/DIGEST is an attempt draftline made (the one check gc applies)."""
    parsed = owners.parse_owned_name(name)
    return (parsed is not None and parsed["kind"] == "attempt") or bool(_LEGACY_ATTEMPT_RE.match(name))


class ArtifactWriter:
    """Collects the files of one attempt, then publishes them with the manifest."""

    def __init__(self, store: "Store", stage: str, digest: str, version: str, inputs: dict[str, str],
                 config: dict[str, Any] | None = None):
        self.store = store
        self.stage = check_name("stage", stage)
        self.digest = check_name("digest", digest)
        self.version = version
        self.inputs = dict(inputs)
        self.config = config or {}
        # Its writer (host, boot, machine, pid) in an owner record inside: `draftline gc` removes a dead
        # writer's attempt at once and keeps a live or recently beating one.
        self.attempt = owners.owned_name("attempt")
        self._beat = 0.0
        self.files: list[FileEntry] = []
        self.stats: dict[str, Any] = {}
        self.committed: Artifact | None = None

    def key(self, name: str) -> str:
        """Where file `name` of this attempt is written on the store."""
        return self.store.key(self.stage, self.digest, self.attempt, check_relpath(name))

    def beat(self) -> None:
        """Write (or refresh) the attempt's owner record: who writes it, and that it still works. Before the
        first file; then at most every _OWNER_BEAT_S, so another host's gc sees a fresh lease."""
        if time.time() - self._beat < _OWNER_BEAT_S:
            return
        if not self._beat:
            self.store.ensure_marker()
        record = owners.me()
        key = self.store.key(self.stage, self.digest, self.attempt, owners.OWNER_FILE)
        with _space_errors(self.store.uri, key):
            self.store.fs.pipe_file(key, json.dumps(record).encode())
        self._beat = record["beat"]

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        """Stream a file into the attempt, hashing as it goes."""
        key = self.key(name)
        self.beat()
        def beat() -> None:  # refreshed while a long file streams, too (at most every _OWNER_BEAT_S)
            with contextlib.suppress(Exception):  # a missed beat only shortens the lease; never fail the write
                self.beat()

        h = hashlib.sha256()
        count = 0
        mid_file = f"store.{self.stage}.mid-file"
        with _space_errors(self.store.uri, key), open_for_write(self.store.fs, key) as raw:

            class _Hashing(io.RawIOBase):
                def writable(self) -> bool:
                    return True

                def write(self, b) -> int:  # type: ignore[override]
                    nonlocal count
                    mv = memoryview(b).cast("B")
                    if mv.nbytes >= _PARALLEL_HASH_MIN:
                        # Hash on a helper thread while this one writes the same bytes (both
                        # release the GIL): a part costs max(hash, write), not their sum.
                        hashed = _hasher().submit(h.update, mv)
                        try:
                            raw.write(mv)
                        finally:
                            hashed.result()
                    else:
                        h.update(mv)
                        raw.write(mv)
                    count += mv.nbytes
                    if count >= _KILL_MID_FILE_BYTES > count - mv.nbytes:  # once per file, bytes still to come
                        kill_point(mid_file)
                    beat()
                    return mv.nbytes

            yield _Hashing()  # type: ignore[misc]
        self.files.append(FileEntry(path=name, bytes=count, sha256=h.hexdigest()))

    def write_bytes(self, name: str, data: bytes) -> None:
        with self.open(name) as fh:
            fh.write(data)

    def write_json(self, name: str, obj: Any) -> None:
        self.write_bytes(name, json.dumps(obj, indent=2, sort_keys=True).encode())

    def put_file(self, name: str, local_path: str | os.PathLike) -> None:
        with open(local_path, "rb") as src, self.open(name) as dst:
            while chunk := src.read(_HASH_CHUNK):
                dst.write(chunk)

    def commit(self, stats: dict[str, Any] | None = None, run: dict[str, Any] | None = None) -> Artifact:
        if stats:
            self.stats.update(stats)
        run = dict(run or {})
        target = os.environ.get("DRAFTLINE_TARGET_PROVENANCE")  # set at the run's start (tasks/engine/weights.py pin_run)
        if target and "target" not in run:
            run["target"] = json.loads(target)
        manifest = Manifest(
            stage=self.stage, digest=self.digest, version=self.version, attempt=self.attempt,
            created=_now(), inputs=self.inputs, files=self.files, stats=self.stats,
            config=self.config, run=run,
        )
        kill_point(f"commit.{self.stage}.before-manifest")
        self.store.ensure_marker()
        self.store._publish(manifest)
        COMMITTED_HERE.add(self.attempt)
        self.committed = Artifact(self.store, manifest)
        return self.committed

    def abort(self) -> None:
        # Best effort and quick (a store that is down must not hold the failure up): `gc` removes leftovers.
        with contextlib.suppress(Exception):
            self.store.quick_fs().rm(self.store.key(self.stage, self.digest, self.attempt), recursive=True)


class Store:
    """All artifact I/O. `Store.from_config(cfg.store)`; the same code for file:// and s3://."""

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None):
        self.uri = canonical_uri(uri)
        self.scheme, root = self.uri.split("://", 1)
        self.storage_options = storage_options or {}
        if self.scheme == "file":
            self.fs = fsspec.filesystem("file", auto_mkdir=True)
        else:
            try:
                # No instance cache: credentials in the environment may change between stores.
                self.fs = fsspec.filesystem(self.scheme, skip_instance_cache=True, **self.storage_options)
            except ImportError as exc:
                raise StoreError(f"{self.scheme}:// needs {exc.name}: pip install s3fs") from None
        self.root = root
        self._marked = False

    @classmethod
    def from_config(cls, cfg: StoreConfig) -> "Store":
        opts = resolve_credentials(cfg) if cfg.uri.startswith("s3://") else {}
        return cls(cfg.uri, opts)

    @property
    def is_local(self) -> bool:
        return self.scheme == "file"

    def quick_fs(self) -> Any:
        """The filesystem with few retries, for calls that should answer in seconds (health checks,
        best-effort cleanup) rather than wait out an outage like data transfers do."""
        if "config_kwargs" not in self.storage_options:
            return self.fs
        opts = {**self.storage_options, "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}}}
        self.fs.connect()  # one botocore session for both: S3's service model loaded once, not twice (~0.3 s)
        return fsspec.filesystem(self.scheme, skip_instance_cache=True, session=self.fs.session, **opts)

    # ---------------------------------------------------------------- keys
    def key(self, *parts: str) -> str:
        """The store's key (a path on a file:// store) of STAGE/DIGEST/... ."""
        return "/".join([self.root, *parts])

    def uri_of(self, stage: str, digest: str) -> str:
        return f"{self.uri}/{stage}/{digest}"

    # ---------------------------------------------------------------- the store's marker
    def has_marker(self) -> bool:
        if not self.is_local:
            self.fs.invalidate_cache(self.root)
        return self.fs.exists(self.key(STORE_MARKER))

    def ensure_marker(self) -> None:
        """Write STORE_MARKER at the root unless it is there (once per Store object: one check)."""
        if self._marked:
            return
        if not self.has_marker():
            key = self.key(STORE_MARKER)
            with _space_errors(self.uri, key):
                self.fs.pipe_file(key, json.dumps({
                    "draftline_store": 1, "created": _now(),
                    "about": "a draftline artifact store: STAGE/DIGEST/manifest.json artifacts and their attempt "
                             "folders; `draftline gc` deletes only under a root holding this file"}, indent=2).encode())
        self._marked = True

    def _is_empty(self) -> bool:
        """No file under the root (a probe of `check`, or an empty "folder" some S3 servers keep, aside)."""
        def ours(name: str) -> bool:
            return name.rstrip("/").rsplit("/", 1)[-1].startswith(".probe-") or name.endswith("/")

        if self.is_local:
            try:
                with os.scandir(self.root) as it:
                    return all(ours(e.name) for e in it)
            except (FileNotFoundError, NotADirectoryError):
                return True
        bucket, _, prefix = self.root.partition("/")
        try:
            listed = self.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=f"{prefix}/" if prefix else "",
                                     MaxKeys=20)
        except FileNotFoundError:
            return True
        return all(ours(o["Key"]) for o in listed.get("Contents", []))

    def _not_a_store(self, doing: str) -> NotAStore:
        return NotAStore(
            f"{self.uri} is not a draftline store, so {doing}: a store is the folder or s3:// prefix whose root "
            f"holds {STORE_MARKER} (written by `draftline store init` and by a run's first write) beside its "
            "STAGE/DIGEST/manifest.json artifacts. Point --store (or store.uri) at a store; for a store an older "
            f"draftline made, run `draftline store init --store {self.uri}` once")

    def collectable(self) -> bool:
        """Whether gc may look for leftovers here: True for a marked store, False for a root that does not
        exist or is empty (nothing to collect); anything else raises NotAStore, naming the fix."""
        if self.has_marker():
            return True
        if self._is_empty():
            return False
        raise self._not_a_store("gc deletes nothing there")

    def init_marker(self) -> None:
        """`draftline store init`: mark the root as a store, if it is empty or already holds draftline's layout
        (a store an older draftline made); a folder of other files is refused."""
        if self.has_marker():
            self._marked = True
            return
        if not self._is_empty() and not self.list():
            raise NotAStore(
                f"{self.uri} holds files but no draftline artifact (STAGE/DIGEST/manifest.json): not marking it "
                f"as a store ({STORE_MARKER}), since `draftline gc` cleans inside a store; pick an empty folder "
                "or a new s3:// prefix for store.uri")
        self.ensure_marker()

    # ---------------------------------------------------------------- health
    def check(self, write: bool = True) -> None:
        """Fail early with a message that says what to fix (bucket, credentials, endpoint). Only the store's
        own prefix is touched: keys scoped to s3://BUCKET/PREFIX pass. `write=False` (ls, report, export)
        lists and writes nothing, so read-only keys pass; `write=True` also writes and deletes a probe."""
        if self.is_local:
            root = Path(self.root)
            if not write:
                if root.exists() and not os.access(root, os.R_OK | os.X_OK):
                    raise StoreError(f"store folder {self.root} is not readable; fix store.uri or the folder's "
                                     "permissions")
                return  # a folder not made yet is an empty store
            probe = root / f".probe-{uuid.uuid4().hex}"
            try:
                root.mkdir(parents=True, exist_ok=True)
                probe.write_bytes(b"ok")
                probe.unlink()
            except OSError as exc:
                raise StoreError(f"store folder {self.root} is not writable ({exc.strerror}); fix store.uri or "
                                 "the folder's permissions") from None
            return
        bucket, _, prefix = self.root.partition("/")
        fs = self.quick_fs()
        doing = f"listing {self.uri}"
        try:
            fs.invalidate_cache()
            fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=f"{prefix}/" if prefix else "", MaxKeys=1)
            if write:
                doing = f"writing a probe object under {self.uri}"
                key = self.key(f".probe-{uuid.uuid4().hex}")
                fs.pipe_file(key, b"ok")
                doing = f"deleting the probe object {key}"
                fs.rm_file(key)
        except FileNotFoundError:
            raise BucketMissing(
                f"bucket {bucket!r} does not exist at {self._endpoint()}; create it with "
                f"`draftline store init --store s3://{self.root}` (or your provider's console) or fix store.uri"
            ) from None
        except PermissionError as exc:
            if re.search(r"signature|InvalidAccessKeyId|does not exist in our records", str(exc), re.I):
                raise StoreError(
                    f"S3 credentials rejected {doing} ({exc}); check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                    "(or store.credentials_block)") from None
            need = ("read and list (s3:ListBucket on the prefix, s3:GetObject)" if doing.startswith("listing") else
                    "write and delete objects (s3:PutObject, s3:DeleteObject) there; commands that only read "
                    "(ls, report) need no more than read and list")
            raise StoreError(
                f"access denied {doing} ({exc}): the keys (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or "
                f"store.credentials_block) must be allowed to {need}"
                + (f"; or bucket {bucket!r} does not exist (many servers deny rather than say so: "
                   f"`draftline store init` with keys that may create it)" if doing.startswith("listing") else "")
            ) from None
        except Exception as exc:  # botocore raises many types; name the common causes
            text = str(exc)
            if "credentials" in text.lower() or "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text:
                raise StoreError(
                    f"S3 credentials rejected or missing for {self._endpoint()}: set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY in the environment (never in the config)"
                ) from None
            raise StoreError(
                f"store {self.uri} unreachable at {self._endpoint()}: {type(exc).__name__}: {text[:200]}; "
                "check store.endpoint_url / AWS_ENDPOINT_URL and that the server is up"
            ) from None

    def create(self) -> bool:
        """Make the store usable: its S3 bucket (or local folder) if missing. True when one was created."""
        if self.is_local:
            existed = Path(self.root).is_dir()
            Path(self.root).mkdir(parents=True, exist_ok=True)
            return not existed
        bucket = self.root.partition("/")[0]
        try:
            self.check(write=False)
            return False
        except BucketMissing:
            pass
        try:
            self.quick_fs().mkdir(bucket, create_parents=True)
        except Exception as exc:  # noqa: BLE001 - the provider's reason, with the fix
            raise StoreError(f"cannot create bucket {bucket!r} at {self._endpoint()} ({type(exc).__name__}: "
                             f"{str(exc)[:200]}): these keys may not create buckets; ask for one, or create it "
                             "in your provider's console") from None
        return True

    def _endpoint(self) -> str:
        return self.storage_options.get("client_kwargs", {}).get("endpoint_url", "AWS S3")

    # ---------------------------------------------------------------- read
    def manifest(self, stage: str, digest: str) -> Manifest | None:
        return self.manifests(stage, [digest])[digest]

    def manifests(self, stage: str, digests: list[str], skip_unsafe: bool = False) -> dict[str, Manifest | None]:
        """Many manifests of STAGE at once (concurrent reads on S3): tasks/store/manifests.py."""
        return read_manifests(self, stage, digests, skip_unsafe)

    def open(self, stage: str, digest: str, checksums: bool = False, only: str | None = None) -> Artifact:
        """The committed artifact, with sizes (and optionally checksums) verified: of every file, or of ONLY the
        one the caller reads (a stage's N shards each checking its input's N files would be N² requests)."""
        m = self.manifest(stage, digest)
        if m is None:
            raise ArtifactMissing(f"no committed artifact {self.uri_of(stage, digest)}")
        art = Artifact(self, m)
        art.verify(checksums=checksums, only=only)
        return art

    def found_or_compute(self, stage: str, digest: str, compute: Callable[[], ArtifactRef]) -> ArtifactRef:
        """The one found-or-compute rule every stage follows: the committed artifact at this address when
        there is one (finished work is never paid for twice), else what `compute()` commits there. The flow's
        tasks apply the same rule first, under the address's lock, and show a found artifact as Cached
        (flows/caching.py)."""
        hit = self.find(stage, digest)
        if hit is not None:
            return hit.ref()
        return compute()

    def find_many(self, stage: str, digests: list[str]) -> dict[str, Artifact | None]:
        """`find` for many digests, their manifests read at once (a stage's 512 shards; tasks/store/manifests.py),
        then each found artifact's files checked by size, also at once: missing, unreadable, unsafe or corrupt
        reads as None."""
        arts = {d: Artifact(self, m) for d, m in self.manifests(stage, digests, skip_unsafe=True).items() if m}
        sizes = file_sizes(self, [a.key(f.path) for a in arts.values() for f in a.manifest.files])  # at once
        return {d: a if (a := arts.get(d)) and all(sizes[a.key(f.path)] == f.bytes for f in a.manifest.files)
                else None for d in digests}

    def find(self, stage: str, digest: str, checksums: bool = False) -> Artifact | None:
        """The committed, verified artifact or None (corrupt counts as missing)."""
        try:
            return self.open(stage, digest, checksums=checksums)
        except (ArtifactMissing, ArtifactCorrupt):
            return None

    def list(self, stage: str | None = None) -> list[Manifest]:
        out: list[Manifest] = []
        stages = [stage] if stage else self._dirs(self.root)
        for s in stages:  # an unsafe manifest is listed as nothing
            out += [m for m in self.manifests(s, self._dirs(self.key(s)), skip_unsafe=True).values() if m]
        return sorted(out, key=lambda m: (m.stage, m.created))

    def _dirs(self, key: str) -> list[str]:
        try:
            entries = self.fs.ls(key, detail=True, refresh=True) if not self.is_local else self.fs.ls(key, detail=True)
        except FileNotFoundError:
            return []
        names = []
        for e in entries:
            if e.get("type") == "directory":
                name = e["name"].rstrip("/").rsplit("/", 1)[-1]
                if _NAME_RE.match(name):
                    names.append(name)
        return sorted(names)

    # ---------------------------------------------------------------- write
    def writer(self, stage: str, digest: str, version: str, inputs: dict[str, str] | None = None,
               config: dict[str, Any] | None = None) -> ArtifactWriter:
        return ArtifactWriter(self, stage, digest, version, inputs or {}, config)

    @contextlib.contextmanager
    def write(self, stage: str, digest: str, version: str, inputs: dict[str, str] | None = None,
              config: dict[str, Any] | None = None) -> Iterator[ArtifactWriter]:
        """`with store.write(...) as w: ...; w.commit(stats)`; an exception removes the attempt."""
        w = self.writer(stage, digest, version, inputs, config)
        try:
            yield w
        except BaseException:
            w.abort()
            raise
        if w.committed is None:
            w.abort()
            raise RuntimeError(f"{stage}/{digest}: writer closed without commit()")

    def _publish(self, manifest: Manifest) -> None:
        key = self.key(manifest.stage, manifest.digest, MANIFEST)
        payload = manifest.model_dump_json(indent=2).encode()
        if self.is_local:
            os.makedirs(os.path.dirname(key), exist_ok=True)  # an artifact of no file (the extract stage's)
            tmp = f"{key}.tmp-{uuid.uuid4().hex}"
            try:
                with _space_errors(self.uri, key), open(tmp, "wb") as fh:
                    fh.write(payload)
                    fh.flush()
                    os.fsync(fh.fileno())
            except BaseException:
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                raise
            os.replace(tmp, key)  # atomic on POSIX
        else:
            self.fs.pipe_file(key, payload)  # one PUT: atomic on S3
            self.fs.invalidate_cache(self.key(manifest.stage, manifest.digest))

    def quarantine(self, stage: str, digest: str, why: str, seen: Manifest | None = None) -> bool:
        """Move a bad manifest aside (kept for inspection as manifest.corrupt-*.json). With `seen` (the
        manifest the reader found bad), only when the manifest on the store is still that one: re-read and
        compared first, so a stale reader never un-commits a newer, good artifact. True when moved."""
        key = self.key(stage, digest, MANIFEST)
        if not self.is_local:
            self.fs.invalidate_cache(self.key(stage, digest))
        try:
            raw = read_capped(self.fs, key, MANIFEST_CAP, self.is_local)
        except (FileNotFoundError, RefusedStoreFile):
            return False
        if seen is not None:
            try:
                now = Manifest.model_validate_json(raw)
            except Exception:
                now = None
            if now is not None and now != seen:
                return False
        with contextlib.suppress(ValueError):
            raw = json.loads(raw)
        with contextlib.suppress(FileNotFoundError):
            self.fs.pipe_file(self.key(stage, digest, f"manifest.corrupt-{uuid.uuid4().hex[:8]}.json"),
                              json.dumps({"reason": why, "manifest": raw}).encode())
            self.fs.rm_file(key)
        return True

    def delete(self, stage: str, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.key(check_name("stage", stage), check_name("digest", digest)), recursive=True)

    # ---------------------------------------------------------------- gc
    def garbage(self, min_age_s: float = 3600) -> list[str]:
        """Keys of uncommitted attempt folders and temp files: a dead writer's at once, others once
        older than min_age_s (a writer that may still be running is protected by the age)."""
        return [g["key"] for g in self.garbage_detail(min_age_s)]

    def garbage_detail(self, min_age_s: float = 3600) -> list[dict[str, Any]]:
        """`garbage` with each leftover's age in seconds and its writer (its owner record, alive?).

        Only under a marked store (`collectable`; NotAStore otherwise), and only what draftline names:
        STAGE/DIGEST/<attempt> folders whose name `is_attempt_name` accepts and that no manifest names,
        and STAGE/DIGEST/manifest.json.tmp-<32 hex> files. An attempt whose writer runs on this machine is
        kept; one whose writer is gone goes at once; one of another host (or boot) is kept while any of its
        files or its owner record (the writer's lease, refreshed while it writes) is younger than min_age_s."""
        out: list[dict[str, Any]] = []
        now = time.time()
        if not self.is_local:
            self.fs.invalidate_cache()
        if not self.collectable():
            return out
        for s in self._dirs(self.root):
            if s.startswith("_"):
                continue
            for d in self._dirs(self.key(s)):
                try:
                    m = self.manifest(s, d)
                except ArtifactCorrupt:
                    continue  # a manifest naming unsafe paths: leave the whole artifact for a person to see
                live = m.attempt if m else None
                for a in self._dirs(self.key(s, d)):
                    if a == live or not is_attempt_name(a):
                        continue
                    key = self.key(s, d, a)
                    found = self.fs.find(key, detail=True)
                    if not any(i.get("type") == "file" and k.rstrip("/") != key for k, i in found.items()):
                        continue  # an empty prefix some S3 servers keep after deletion: nothing to free
                    age, writer = self._age(key, now), self._attempt_owner(key)
                    if writer.get("alive") is True:
                        continue
                    if age >= min_age_s or writer.get("alive") is False:
                        out.append({"kind": "attempt", "key": key, "age_s": age, "owner": writer})
                try:
                    files = self.fs.ls(self.key(s, d), detail=False)
                except FileNotFoundError:
                    files = []
                for f in files:
                    if _TEMP_FILE_RE.match(f.rsplit("/", 1)[-1]) and (age := self._age(f, now)) >= min_age_s:
                        out.append({"kind": "temp-file", "key": f, "age_s": age, "owner": {}})
        return out

    def _attempt_owner(self, key: str) -> dict[str, Any]:
        """The attempt's owner record ({} for none) with `alive`: True/False on this machine, None elsewhere."""
        try:
            record = json.loads(read_capped(self.fs, f"{key}/{owners.OWNER_FILE}", RECORD_CAP, self.is_local))
        except (FileNotFoundError, ValueError):
            return {}
        if not isinstance(record, dict):
            return {}
        return {**record, "alive": owners.alive(record)}

    def _age(self, key: str, now: float) -> float:
        try:
            newest = 0.0
            for _path, info in self.fs.find(key, detail=True, withdirs=False).items() if self.fs.isdir(key) else [(key, self.fs.info(key))]:
                t = info.get("mtime") or info.get("LastModified") or info.get("created") or 0
                if hasattr(t, "timestamp"):
                    t = t.timestamp()
                newest = max(newest, float(t))
            return now - newest if newest else float("inf")
        except FileNotFoundError:
            return float("inf")

    def gc(self, min_age_s: float = 3600) -> list[str]:
        removed = self.garbage(min_age_s)
        for key in removed:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(key, recursive=True)
        return removed
