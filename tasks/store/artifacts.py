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

This module is the `Store` (keys, the root's marker, health checks, finding, listing, publishing); beside it:
reading one artifact (reader.py, `Artifact`), writing one (writer.py, `ArtifactWriter`), what gc may delete
(gc.py), where a store is and its S3 options (location.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import fsspec

from tasks.core.config import StoreConfig, canonical_uri
from tasks.store import gc as _gc
from tasks.store.location import resolve_credentials
from tasks.store import manifest_index
from tasks.store.manifests import file_sizes, read_manifests
from tasks.store.opened import opened
from tasks.store.model import (MANIFEST, ArtifactCorrupt, ArtifactMissing, ArtifactRef,
                               BucketMissing, Manifest, NotAStore, StoreError)
from tasks.store.reader import Artifact
from tasks.store.trust import MANIFEST_CAP, NAME_RE as _NAME_RE, RefusedStoreFile, check_name, read_capped
from tasks.store.writer import ArtifactWriter, now as _now, space_errors as _space_errors

STORE_MARKER = "draftline-store.json"  # at the store's root: what says "draftline wrote here"


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
        """The process's one Store for this store and these credentials (tasks/store/opened.py)."""
        opts = resolve_credentials(cfg) if cfg.uri.startswith("s3://") else {}
        return opened(canonical_uri(cfg.uri), opts, lambda: cls(cfg.uri, opts))

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

    def write_index(self, stage: str, digests: list[str]) -> str | None:
        """Index the committed manifests of DIGESTS in STAGE's folder, so that a listing of that folder reads
        them in one GET (tasks/store/manifest_index.py); its key, or None where none is written (a file://
        store, or the same index already there)."""
        if not manifest_index.listable(self) or not digests:
            return None
        folder, found = manifest_index.list_folder(self, stage), {}
        read_manifests(self, stage, digests, True, folder, as_read=found)
        return manifest_index.write_index(self, stage, found, folder)

    def described(self, stage: str, digests: list[str]) -> dict[str, Artifact | None]:
        """The artifacts whose manifests are committed, as their manifests describe them, their files not
        checked (what `plan --from-store` reads: the manifests' stats)."""
        return {d: Artifact(self, m) if m else None for d, m in self.manifests(stage, digests, skip_unsafe=True).items()}

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
            folder = manifest_index.list_folder(self, s) if manifest_index.usable(self) else None
            digests = self._dirs(self.key(s))  # the plain LIST too: the rolled-up one may miss a folder
            digests = sorted(set(digests) | folder.digests()) if folder is not None else digests
            out += [m for m in read_manifests(self, s, digests, True, folder).values() if m]
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

    # ---------------------------------------------------------------- gc (tasks/store/gc.py)
    def garbage(self, min_age_s: float = 3600) -> list[str]:
        """Keys of uncommitted attempt folders and temp files: a dead writer's at once, others once
        older than min_age_s (a writer that may still be running is protected by the age)."""
        return [g["key"] for g in self.garbage_detail(min_age_s)]

    def garbage_detail(self, min_age_s: float = 3600) -> list[dict[str, Any]]:
        """`garbage` with each leftover's age and its writer: tasks/store/gc.py says what counts."""
        return _gc.garbage_detail(self, min_age_s)

    def gc(self, min_age_s: float = 3600) -> list[str]:
        """Delete the garbage; the keys deleted."""
        return _gc.collect(self, min_age_s)
