"""A two-stage flow built with draftline's caching, run in a fresh process per call.

Usage: python toy_flow.py STORE_URI MARKER_FILE
Each stage body appends its name to MARKER_FILE when it actually computes.
Prints one JSON line: {stage: prefect state name}.
"""

import json
import sys

from prefect import flow, task

from flows.caching import stage_options
from tasks.core.digest import stage_digest
from tasks.store.artifacts import ArtifactRef, Store

STORE_URI, MARKER = sys.argv[1], sys.argv[2]


def body(stage: str, digest: str, payload: bytes):
    store = Store(STORE_URI)
    hit = store.find(stage, digest)
    if hit is not None:
        return hit.ref()
    with open(MARKER, "a") as fh:
        fh.write(stage + "\n")
    with store.write(stage, digest, "v1") as w:
        w.write_bytes("out.bin", payload)
        return w.commit({"bytes": len(payload)}).ref()


@task
def first(digest: str):
    return body("prepare", digest, b"first" * 100)


@task
def second(digest: str, upstream):
    return body("vocab", digest, b"second" * 100 + upstream.digest.encode())


@flow
def toy():
    store = Store(STORE_URI)
    d1 = stage_digest("prepare", {"x": 1})
    s1 = first.with_options(**stage_options("prepare", store, d1))(d1, return_state=True)
    r1 = ArtifactRef.model_validate(s1.result())  # JSON results may come back as dicts
    d2 = stage_digest("vocab", {"y": 2}, {"data": r1.digest})
    s2 = second.with_options(**stage_options("vocab", store, d2))(d2, r1, return_state=True)
    s2.result()
    return {"prepare": s1.name, "vocab": s2.name}


if __name__ == "__main__":
    print(json.dumps(toy()))
