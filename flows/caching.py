"""Prefect caching keyed by artifact digests, with keys and results on the store.

The cache key of a stage task is `STAGE-DIGEST`, where DIGEST is the artifact
address from tasks/digest.py. The policy only hands Prefect a key when the
store holds a committed artifact at that address that still verifies: a cache
record whose artifact vanished or was corrupted is ignored, and the task runs.
Cache records and results live under `STORE/_prefect/`, so a machine with an
empty Prefect database, pointed at the same store, gets the same hits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect.cache_policies import CachePolicy
from prefect.filesystems import LocalFileSystem, RemoteFileSystem

from tasks.store import Store


@dataclass
class StoreArtifactPolicy(CachePolicy):
    """Key = STAGE-DIGEST, only while the store holds that committed artifact."""

    stage: str = ""
    store_uri: str = ""
    storage_options: dict[str, Any] | None = None

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs) -> str | None:
        digest = inputs.get("digest")
        if not digest:
            return None
        store = Store(self.store_uri, self.storage_options or {})
        if store.find(self.stage, digest) is None:
            return None  # not committed (or corrupt): the store is the truth, run the task
        return f"{self.stage}-{digest}"


def result_storage(store: Store):
    if store.is_local:
        path = Path(store.root) / "_prefect"
        path.mkdir(parents=True, exist_ok=True)
        return LocalFileSystem(basepath=str(path))
    # Settings hold the endpoint only; keys stay in the environment (s3fs reads them).
    settings = {k: v for k, v in store.storage_options.items() if k in ("client_kwargs",)}
    return RemoteFileSystem(basepath=f"s3://{store.root}/_prefect", settings=settings)


def lock_manager(store: Store):
    """Serialize two runs of one stage on one machine; across machines the store's
    attempt folders keep concurrent writers apart (both copies valid)."""
    if store.is_local:
        from prefect.locking.filesystem import FileSystemLockManager

        return FileSystemLockManager(lock_files_directory=Path(store.root) / "_prefect" / "locks")
    return None


def stage_options(stage: str, store: Store) -> dict[str, Any]:
    """Task options for a stage task whose signature has a `digest` parameter."""
    storage = result_storage(store)
    policy = StoreArtifactPolicy(stage=stage, store_uri=store.uri, storage_options=store.storage_options)
    lm = lock_manager(store)
    policy = policy.configure(key_storage=storage, lock_manager=lm,
                              isolation_level="SERIALIZABLE" if lm else None)
    return dict(
        cache_policy=policy,
        persist_result=True,
        result_storage=storage,
        result_serializer="json",
    )
