"""Finished work, as the flow's tasks see it: the store's manifest decides, Prefect shows it.

A stage task computes its artifact's address once (the stage's `locate`, tasks/store/stages.py), calls
`finished_or_run` with it, and hands the same digest to the stage it runs:

- the store holds a committed artifact there that verifies: the task ends at once in a Completed state
  named "Cached" whose result is the artifact's ArtifactRef (Prefect 3 takes a State a task returns as its
  final state), so the Prefect UI shows reused work as Cached;
- else it takes the address's lock (tasks/store/leases.py: on a file:// store a second run of the same
  config waits here), looks at the manifest again (the first run may have committed it meanwhile: Cached),
  and runs the stage, which computes and commits. A ref the stage found rather than computed (its own
  `Store.found_or_compute`, the rule it follows outside a flow too) ends Cached as well.

Prefect keeps no record of its own: the tasks have no cache policy and persist no result, so there is no
second answer to "is this finished" and nothing on the store for Prefect to decode. A store written by
versions that cached through Prefect still has `STORE/_prefect/` (cache keys, results, locks): nothing
reads those records any more (their artifacts are found by their manifests, whoever wrote the records);
`draftline gc` clears only their stale lock files.
"""

from __future__ import annotations

from typing import Any, Callable

from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.states import Completed, State

from tasks.store.artifacts import ArtifactRef, Store
from tasks.store.leases import address_lock

CACHED = "Cached"  # the state name Prefect's UI shows for reused work
# Options of every stage task: Prefect caches nothing and stores no result (the store is the one record).
TASK_OPTIONS: dict[str, Any] = {"cache_policy": NO_CACHE, "persist_result": False}


def cached(ref: ArtifactRef) -> State:
    """The final state of a task that reused REF: Completed, named Cached, with REF as its result."""
    return Completed(name=CACHED, data=ref, message=f"found committed on the store: {ref.uri}")


def finished_or_run(stage: str, store: Store, digest: str, compute: Callable[[], ArtifactRef]) -> ArtifactRef | State:
    """STAGE/DIGEST from the store when it is committed (a Cached state), else COMPUTE's artifact, computed
    under the address's lock."""
    hit = store.find(stage, digest)
    if hit is not None:
        return cached(hit.ref())
    with address_lock(store, stage, digest, {"flow_run": str(flow_run.id or "") or None}):
        hit = store.find(stage, digest)  # another run may have committed it while this one waited
        ref = hit.ref() if hit is not None else compute()
    return ref if ref.executed_here else cached(ref)


def as_ref(value: Any) -> ArtifactRef:
    """A stage task's result as an ArtifactRef: from the returned value, or the data of its final state."""
    if isinstance(value, State):
        value = value.result()
    return value if isinstance(value, ArtifactRef) else ArtifactRef.model_validate(value)
