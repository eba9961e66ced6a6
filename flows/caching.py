"""Prefect caching keyed by artifact digests, with keys and results on the store.

The cache key of a stage task is `STAGE-DIGEST`, where DIGEST is the artifact
address from tasks/address/digests.py. The policy only hands Prefect a key when the
store holds a committed artifact at that address that still verifies: a cache
record whose artifact vanished or was corrupted is ignored, and the task runs.
Cache records and results live under `STORE/_prefect/`, so a machine with an
empty Prefect database, pointed at the same store, gets the same hits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect._internal.compatibility.async_dispatch import async_dispatch
from prefect.cache_policies import CachePolicy
from prefect.filesystems import LocalFileSystem, RemoteFileSystem

from flows.locks import LeaseLockManager
from tasks.store.artifacts import Store


@dataclass
class StoreArtifactPolicy(CachePolicy):
    """Key = STAGE-DIGEST: the artifact's address, from the task's `digest` argument."""

    stage: str = ""

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs) -> str | None:
        digest = inputs.get("digest")
        return f"{self.stage}-{digest}" if digest else None


_SAVED: dict[str, Any] = {}


class StoreS3FileSystem(RemoteFileSystem):
    """Prefect's RemoteFileSystem for the store's S3 prefix, writing an object without `makedirs` first: S3 has
    no folders, and s3fs's makedirs checks that the bucket exists (HeadBucket) and otherwise tries to create
    it, which keys scoped to the store's prefix may not do; Prefect's cache records were then silently lost."""

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
        block = LocalFileSystem(basepath=str(path))
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
