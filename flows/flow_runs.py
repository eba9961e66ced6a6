"""What the flow and the commands both know of flow runs: the flows' names, where a run sends its slices of
shards (`slice_deployment`) and which stage a child run works on, the parameters a config travels as to
another node (`config_parameters`), and which worker started a run (`submitting_worker`). The flow uses
them to start and watch its children (flows/nodes.py); the commands (cli/) to submit and to look."""

from __future__ import annotations

# Prefect is imported inside the functions that use it: the commands import this module, and Prefect is heavy
# (seconds to import) for a `--help`.

import datetime as dt
import json
from pathlib import Path
from typing import Any

from tasks.core.config_load import CHECKOUT as ROOT, read_config_file
from tasks.core.errors import ConfigError
from tasks.core.errors import DraftlineError

FLOW_NAME = "draftline"


# The flow of a slice of a run's regeneration or extraction shards on another node (extract.nodes > 1;
# its `stage` parameter says which). Named before regeneration had slices: registered names stay valid.
EXTRACT_FLOW = "draftline-extract"


class OpsError(DraftlineError, RuntimeError):
    """An operation that cannot proceed; the message says what to do."""


def slice_deployment(cfg: Any, own_deployment: str | None) -> str | None:
    """Where a run sends its regeneration and extraction slices: extract.deployment, else draftline-extract/
    plus the name of the run's own deployment (a run of draftline/b300 sends them to draftline-extract/b300)."""
    name = cfg.extract.deployment or own_deployment
    if not name:
        return None
    return name if "/" in name else f"{EXTRACT_FLOW}/{name}"


def child_stage(run: Any) -> str:
    """The stage whose shards a slice child runs (extraction's children carry no `stage` parameter)."""
    return (run.parameters or {}).get("stage") or "extract"


def config_parameters(config: Path, overrides: list[str], inline: bool | None) -> tuple[dict[str, Any], str | None]:
    """Flow parameters for CONFIG: its path relative to the code folder when the worker has the same
    file (inside this checkout), else its content inlined as `section=...` overrides. Returns the
    parameters and, for an inlined config, its store.uri (the caller turns it into a job variable so
    that the worker's DRAFTLINE_STORE_URI keeps the precedence it has over a config file)."""
    path = config.resolve()
    if not path.is_file():
        raise OpsError(f"config file {config} not found")
    try:
        rel = path.relative_to(ROOT)
    except ValueError:
        rel = None
    if inline is None:
        inline = rel is None
    if not inline:
        if rel is None:
            raise OpsError(f"{config} is outside the checkout {ROOT}: the worker cannot read it; "
                           "drop --by-path to inline it")
        return {"config_path": rel.as_posix(), "overrides": list(overrides)}, None
    try:
        data = read_config_file(path)  # with its `base:` merged in: the worker may not have that file either
    except ConfigError as exc:
        raise OpsError(str(exc)) from None
    file_store = None
    store = data.get("store")
    if isinstance(store, dict) and "uri" in store:
        store = dict(store)
        file_store = store.pop("uri")
        data["store"] = store
    sets = [f"{k}={json.dumps(v)}" for k, v in data.items() if not (k == "store" and not v)]
    return {"config_path": None, "overrides": sets + list(overrides)}, file_store


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def flow_run_events(c: Any, run_id: Any, event: str, since: dt.datetime, *, about: str = "resource",
                    limit: int = 1) -> list[Any] | None:
    """Events named EVENT since SINCE whose resource (`about="resource"`) or a related resource
    (`about="related"`) is the flow run; None when the events API cannot be read (best-effort evidence)."""
    from prefect.events.filters import (
        EventFilter,
        EventNameFilter,
        EventOccurredFilter,
        EventRelatedFilter,
        EventResourceFilter,
    )

    ident = [f"prefect.flow-run.{run_id}"]
    where = ({"resource": EventResourceFilter(id=ident)} if about == "resource"
             else {"related": EventRelatedFilter(id=ident)})
    until = utcnow() + dt.timedelta(minutes=1)
    try:
        page = c.read_events(filter=EventFilter(event=EventNameFilter(name=[event]),
                                                occurred=EventOccurredFilter(since=since, until=until), **where),
                             limit=limit)
    except Exception:  # noqa: BLE001 - liveness evidence is best effort
        return None
    return list(page.events)


def submitting_worker(c: Any, run: Any) -> Any | None:
    """The worker that started the run's current attempt (from its `submitted-flow-run` event)."""
    pool = getattr(run, "work_pool_name", None)
    if not pool:
        return None
    since = (run.expected_start_time or run.created or utcnow()) - dt.timedelta(minutes=5)
    events = flow_run_events(c, run.id, "prefect.worker.submitted-flow-run", since, about="related", limit=5)
    if not events:
        return None
    try:
        name = max(events, key=lambda e: e.occurred).resource.get("prefect.resource.name")
        for w in c.read_workers_for_work_pool(pool):
            if w.name == name:
                return w
    except Exception:  # noqa: BLE001 - liveness evidence is best effort
        return None
    return None
