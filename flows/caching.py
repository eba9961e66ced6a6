"""Prefect caching keyed by artifact digests, with keys and results on the store.

The cache key of a stage task is `STAGE-DIGEST`, where DIGEST is the artifact
address from tasks/address/digests.py. The policy only hands Prefect a key when the
store holds a committed artifact at that address that still verifies: a cache
record whose artifact vanished or was corrupted is ignored, and the task runs.
Cache records and results live under `STORE/_prefect/`, so a machine with an
empty Prefect database, pointed at the same store, gets the same hits.

Anyone who can write to the store can rewrite those records, and Prefect decodes a record with
the serializer the record itself names (pickle by default) and its JSON decoder imports and builds
any class a record names. So every read of a record goes through `check_record` first (the
storage blocks below): a record must name exactly the JSON serializer draftline writes, point at
its own result, and its result may build no class but `ArtifactRef`. A record that fails is
refused (`UnsafeCacheRecord`, logged): the cache lookup misses and the stage runs again, finding
its artifact on the store when it is committed; nothing in the record is decoded.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect._internal.compatibility.async_dispatch import async_dispatch
from prefect.cache_policies import CachePolicy
from prefect.filesystems import LocalFileSystem, RemoteFileSystem
from prefect.serializers import JSONSerializer

from flows.locks import LeaseLockManager
from tasks.core.errors import DraftlineError
from tasks.store.artifacts import ArtifactRef, Store

log = logging.getLogger("draftline.caching")

# The one serializer a record may name: Prefect's JSON serializer with its own encoder and decoder.
SAFE_SERIALIZER = JSONSerializer().model_dump(mode="json")
# The one class a result may build (the decoder imports and builds any `__class__` a record names).
SAFE_CLASSES = {f"{ArtifactRef.__module__}.{ArtifactRef.__qualname__}"}


class UnsafeCacheRecord(DraftlineError, ValueError):
    """A Prefect record on the store that draftline did not write: refused, never decoded."""


def _refuse(where: str, why: str) -> UnsafeCacheRecord:
    err = UnsafeCacheRecord(
        f"refused Prefect cache record {where}: {why}. draftline writes only JSON records that build "
        "ArtifactRef; this one was written by someone else (anyone with write access to the store can). "
        "Nothing in it was decoded; the stage runs again and reuses its committed artifact. Remove the "
        "record (or the store's _prefect/ folder) and check who can write to the store.")
    log.warning(str(err))
    return err


def _classes(value: Any, where: str) -> None:
    if isinstance(value, dict):
        if "__exc_type__" in value:
            raise _refuse(where, f"it names exception class {str(value['__exc_type__'])[:80]!r}")
        if "__class__" in value and value["__class__"] not in SAFE_CLASSES:
            raise _refuse(where, f"it names class {str(value['__class__'])[:80]!r}")
        for v in value.values():
            _classes(v, where)
    elif isinstance(value, list):
        for v in value:
            _classes(v, where)


def check_record(role: str, key: str, content: bytes) -> bytes:
    """Return `content` if it is a record draftline would write at `key`, else raise UnsafeCacheRecord.

    role "cache-keys": the metadata record (JSON: the serializer, the key of its result);
    role "results": the result, JSON from the serializer above, building no class but ArtifactRef.
    """
    where = f"{role}/{key}"
    try:
        doc = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        raise _refuse(where, "it is not JSON (a pickle, or damaged)") from None
    if role == "cache-keys":
        if not isinstance(doc, dict):
            raise _refuse(where, "it is not a JSON object")
        if doc.get("serializer") != SAFE_SERIALIZER:
            ser = doc.get("serializer")
            name = ser.get("type") if isinstance(ser, dict) else ser
            raise _refuse(where, f"it names serializer {str(name)[:40]!r} with settings draftline never writes")
        if doc.get("storage_key") != key.rsplit("/", 1)[-1]:
            raise _refuse(where, "it points at another record's result")
    else:
        _classes(doc, where)
    return content


class CheckedReads:
    """Mixin for a storage block: every `read_path` returns a record `check_record` accepted. A metadata
    record is accepted only with its result, so a bad result makes the cache lookup miss (the stage runs)
    instead of failing the read later."""

    def _checked(self, path: str, content: bytes) -> bytes:
        base = str(self.basepath).rstrip("/")
        role = base.rsplit("/", 1)[-1]
        check_record(role, path, content)
        if role == "cache-keys":
            results = self.model_copy(update={"basepath": base[: -len("cache-keys")] + "results"})
            check_record("results", path, super(CheckedReads, results).read_path(path, _sync=True))
        return content

    async def aread_path(self, path: str) -> bytes:
        return self._checked(path, await super().aread_path(path))

    @async_dispatch(aread_path)
    def read_path(self, path: str) -> bytes:
        return self._checked(path, super().read_path(path, _sync=True))


class StoreLocalFileSystem(CheckedReads, LocalFileSystem):
    """Prefect's LocalFileSystem for a file:// store's `_prefect/` folders, reading only checked records."""

    _block_type_name = "Draftline Store Local File System"


@dataclass
class StoreArtifactPolicy(CachePolicy):
    """Key = STAGE-DIGEST: the artifact's address, from the task's `digest` argument."""

    stage: str = ""

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs) -> str | None:
        digest = inputs.get("digest")
        return f"{self.stage}-{digest}" if digest else None


_SAVED: dict[str, Any] = {}


class StoreS3FileSystem(CheckedReads, RemoteFileSystem):
    """Prefect's RemoteFileSystem for the store's S3 prefix, writing an object without `makedirs` first: S3 has
    no folders, and s3fs's makedirs checks that the bucket exists (HeadBucket) and otherwise tries to create
    it, which keys scoped to the store's prefix may not do; Prefect's cache records were then silently lost.
    Reads return checked records only (CheckedReads)."""

    _block_type_name = "Draftline Store S3 File System"

    def _put(self, path: str, content: bytes) -> str:
        path = self._resolve_path(path)
        with self.filesystem.open(path, "wb") as fh:
            fh.write(content)
        return path

    async def awrite_path(self, path: str, content: bytes) -> str:
        return self._put(path, content)

    @async_dispatch(awrite_path)
    def write_path(self, path: str, content: bytes) -> str:
        return self._put(path, content)


def result_storage(store: Store, sub: str = "results"):
    """A filesystem block over STORE/_prefect/SUB, saved under a name derived from the store URI.

    Prefect wants result storage saved server-side. The block holds the path and the
    endpoint only; S3 keys stay in the environment, where s3fs reads them.
    """
    name = f"draftline-{sub}-" + hashlib.sha256(store.uri.encode()).hexdigest()[:16]
    if name in _SAVED:
        return _SAVED[name]
    if store.is_local:
        path = Path(store.root) / "_prefect" / sub
        path.mkdir(parents=True, exist_ok=True)
        block = StoreLocalFileSystem(basepath=str(path))
    else:
        settings = {k: v for k, v in store.storage_options.items() if k in ("client_kwargs",)}
        block = StoreS3FileSystem(basepath=f"s3://{store.root}/_prefect/{sub}", settings=settings)
    block.save(name, overwrite=True)
    _SAVED[name] = block
    return block


_LOCKS: dict[str, LeaseLockManager] = {}


def lock_folder(store: Store) -> Path:
    return Path(store.root) / "_prefect" / "locks"


def lock_manager(store: Store) -> LeaseLockManager | None:
    """Serialize two runs of one stage on one machine, with locks that die with their holder
    (flows/locks.py); across machines (S3) there is no lock: the store's attempt folders keep
    concurrent writers apart (both copies valid), at the cost of computing twice."""
    if not store.is_local:
        return None
    folder = str(lock_folder(store))
    if folder not in _LOCKS:
        _LOCKS[folder] = LeaseLockManager(Path(folder))
    return _LOCKS[folder]


def stage_options(stage: str, store: Store, digest: str) -> dict[str, Any]:
    """Task options for a stage task whose signature has a `digest` parameter.

    The store is the truth: when the artifact at `digest` is not committed (never made,
    deleted, or un-committed as corrupt) the task ignores any Prefect record and runs
    (`refresh_cache`); its new record is written as usual.
    """
    storage = result_storage(store)
    policy = StoreArtifactPolicy(stage=stage)
    lm = lock_manager(store)
    # Cache records (metadata) and results under different folders: same key names.
    policy = policy.configure(key_storage=result_storage(store, "cache-keys"), lock_manager=lm,
                              isolation_level="SERIALIZABLE" if lm else None)
    return dict(
        cache_policy=policy,
        persist_result=True,
        result_storage=storage,
        result_serializer="json",
        refresh_cache=store.find(stage, digest) is None,
    )
