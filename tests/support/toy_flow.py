"""A two-stage flow built like draftline's stage tasks, run in a fresh process per call.

Usage: python toy_flow.py STORE_URI MARKER_FILE
Each stage body appends its name to MARKER_FILE when it actually computes.
Prints one JSON line: {stage: the state name the flow saw, "api": {stage: the state name the Prefect API
holds for its task run}, "refs": {stage: the ArtifactRef the flow got, as JSON}}.
"""

import json
import sys
import time

from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.runtime import flow_run

from flows.caching import TASK_OPTIONS, as_ref, finished_or_run
from tasks.core.digest import stage_digest
from tasks.store.artifacts import Store

STORE_URI, MARKER = sys.argv[1], sys.argv[2]


def body(stage: str, digest: str, payload: bytes):
    store = Store(STORE_URI)
    with open(MARKER, "a") as fh:
        fh.write(stage + "\n")
    with store.write(stage, digest, "v1") as w:
        w.write_bytes("out.bin", payload)
        return w.commit({"bytes": len(payload)}).ref()


@task(name="prepare", task_run_name="prepare", **TASK_OPTIONS)
def first(digest: str):
    return finished_or_run("prepare", Store(STORE_URI), digest, lambda: body("prepare", digest, b"first" * 100))


@task(name="vocab", task_run_name="vocab", **TASK_OPTIONS)
def second(digest: str, upstream):
    return finished_or_run("vocab", Store(STORE_URI), digest,
                           lambda: body("vocab", digest, b"second" * 100 + upstream.digest.encode()))


@flow
def toy():
    d1 = stage_digest("prepare", {"x": 1})
    s1 = first(d1, return_state=True)  # called, as the flow's single stages are
    r1 = as_ref(s1)
    d2 = stage_digest("vocab", {"y": 2}, {"data": r1.digest})
    f2 = second.submit(d2, r1)  # submitted, as the flow's shards are
    r2 = as_ref(f2.result())
    return {"prepare": s1.name, "vocab": f2.state.name, "flow_run": str(flow_run.id),
            "refs": {"prepare": r1.model_dump(mode="json"), "vocab": r2.model_dump(mode="json")}}


def api_states(flow_run_id: str, timeout: float = 60) -> dict[str, str]:
    """{task run name: its state's name} as the Prefect API (and so the UI) holds them; the API records a task
    run's states from events, a moment after the flow returns."""
    deadline = time.time() + timeout
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            states = {r.name: r.state.name for r in runs if r.state is not None}
            if (len(states) == 2 and all(r.state.is_final() for r in runs)) or time.time() > deadline:
                return states
            time.sleep(0.5)


if __name__ == "__main__":
    out = toy()
    out["api"] = api_states(out.pop("flow_run"))
    print(json.dumps(out))
