"""Writing one artifact: its files go into a fresh attempt folder `STAGE/DIGEST/<attempt>/`, hashed as they
stream, beside the writer's owner record (its lease, refreshed while it writes); `commit` publishes the manifest
that names them, last. A writer that dies before its manifest leaves nothing visible (`gc` removes the attempt).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import io
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, Iterator

from tasks.core import owners
from tasks.core.errors import full_disk_as
from tasks.core.faults import kill_point
from tasks.store.model import COMMITTED_HERE, FileEntry, Manifest, StoreError
from tasks.store.reader import HASH_CHUNK, Artifact
from tasks.store.trust import check_name, check_relpath
from tasks.store.uploads import open_for_write

_OWNER_BEAT_S = 60  # a writer refreshes its attempt's owner record (its lease) at most this often
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


def space_errors(store_uri: str, key: str) -> contextlib.AbstractContextManager[None]:
    """A full disk (or a file-size limit) while writing to the store becomes a StoreError that says so."""
    return full_disk_as(lambda exc: StoreError(
        f"writing {key} failed: {exc.strerror} (the store's disk is full or over a size limit); nothing was "
        f"committed: free space on {store_uri} or point store.uri at a bigger store, then retry the run "
        "(finished work is reused)"))


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class ArtifactWriter:
    """Collects the files of one attempt, then publishes them with the manifest."""

    def __init__(self, store: Any, stage: str, digest: str, version: str, inputs: dict[str, str],
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
        with space_errors(self.store.uri, key):
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
        with space_errors(self.store.uri, key), open_for_write(self.store.fs, key) as raw:

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
            while chunk := src.read(HASH_CHUNK):
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
            created=now(), inputs=self.inputs, files=self.files, stats=self.stats,
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
