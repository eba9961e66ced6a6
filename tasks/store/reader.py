"""A committed artifact opened for reading: its files by name, each checked against the manifest's size and
sha256 as it is read (a mismatch un-commits the artifact, so the stage that made it runs again), as bytes, as a
local copy or streamed into a file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, Iterator

from tasks.core import owners
from tasks.store.model import ArtifactCorrupt, ArtifactRef, Manifest
from tasks.store.manifests import read_options
from tasks.store.trust import safe_join

HASH_CHUNK = 8 << 20  # a file is hashed (and copied from a local path) this many bytes at a time
_COPY_CHUNK = 16 << 20  # ranged GETs of a streamed copy (Artifact.copy_to)
_COPY_INFLIGHT = 4  # ... in flight at once


@dataclass
class Artifact:
    """A committed artifact opened for reading."""

    store: Any  # the Store it was read from (tasks/store/artifacts.py)
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
                while chunk := fh.read(HASH_CHUNK):
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
