"""The runs this machine started, kept on this machine: a flow run's parameters live on the Prefect API, where any
API user can create a run or edit one, so what `draftline retry` re-runs in its own process (and what `last`
means for retry, check and export) comes from this record, never from the API alone.

`draftline run` (a pipeline run outside any deployment, in this process) and `draftline submit` append one JSON line
per run to `started-runs.jsonl` in draftline's folder on this machine (`cache_home()`, $DRAFTLINE_HOME; mode 600):
the flow run's id, the Prefect API it lives on, its parameters and their digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

from tasks.core.config_load import load_config
from tasks.core.home import cache_home

RECORD = "started-runs.jsonl"
# The parameters of a pipeline run, normalized as the flow reads them.
KEYS = ("config_path", "overrides", "until")


def normalized(params: dict[str, Any]) -> dict[str, Any]:
    p = dict(params or {})
    return {"config_path": p.get("config_path"), "overrides": list(p.get("overrides") or []), "until": p.get("until"),
            **{k: v for k, v in p.items() if k not in KEYS}}


def params_digest(params: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(normalized(params), sort_keys=True, default=str).encode()).hexdigest()


def api_url() -> str:
    # here, not at the top: Prefect takes seconds to import (heavy), and the CLI imports this module for every command
    from prefect.settings import PREFECT_API_URL

    return (PREFECT_API_URL.value() or "").rstrip("/")


def record_started(run_id: Any, params: dict[str, Any]) -> None:
    """Note that this machine started flow run RUN_ID with PARAMS (one appended line; a line is written whole)."""
    line = json.dumps({"id": str(run_id), "api": api_url(), "digest": params_digest(params),
                       "parameters": normalized(params), "at": time.time()}, default=str) + "\n"
    fd = os.open(cache_home() / RECORD, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _entries() -> list[dict[str, Any]]:
    path = cache_home() / RECORD
    out = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a crash: the others stand
    return out


def started_here(run_id: Any) -> dict[str, Any] | None:
    """This machine's record of flow run RUN_ID, or None when this machine did not start it."""
    found = [e for e in _entries() if e.get("id") == str(run_id)]
    return found[-1] if found else None


def newest_started() -> list[str]:
    """The ids of the runs this machine started on the current Prefect API, newest first."""
    here = api_url()
    seen: list[str] = []
    for e in sorted(_entries(), key=lambda e: e.get("at") or 0, reverse=True):
        if e.get("api") == here and e.get("id") not in seen:
            seen.append(e["id"])
    return seen


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs between the recorded parameters and the API's, one line each (overrides added/removed)."""
    b, a = normalized(before), normalized(after)
    out = []
    for k in sorted(set(b) | set(a)):
        if k == "overrides":
            out += [f"overrides: + {o}" for o in a[k] if o not in b[k]]
            out += [f"overrides: - {o}" for o in b[k] if o not in a[k]]
        elif b.get(k) != a.get(k):
            out.append(f"{k}: {json.dumps(b.get(k), default=str)[:200]} -> {json.dumps(a.get(k), default=str)[:200]}")
    return out


def risky_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Changes of the effective config that would run code or send data elsewhere: target.trust_remote_code (and
    target.model while it is on), store.uri, store.endpoint_url. The configs are loaded as the flow loads them."""
    b, a = (load_config(p["config_path"], p["overrides"]) for p in (normalized(before), normalized(after)))
    out = []
    if a.target.trust_remote_code and (not b.target.trust_remote_code or a.target.model != b.target.model):
        out.append(f"target.trust_remote_code is on for {a.target.model} (recorded: "
                   f"{'on for ' + b.target.model if b.target.trust_remote_code else 'off'})")
    for name, x, y in (("store.uri", b.store.uri, a.store.uri),
                       ("store.endpoint_url", b.store.endpoint_url, a.store.endpoint_url)):
        if x != y:
            out.append(f"{name} {y!r} (recorded: {x!r})")
    return out
