"""The Prefect API as the operations commands use it: where the server and its UI are, a run found by
id, id prefix, name or `last`, its task runs and child runs, and which stage or shard a task name is.

Everything here talks to the server named by PREFECT_API_URL (infra/local-stack.sh starts a local
one); nothing here changes how a run computes."""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
import uuid
from pathlib import Path
from typing import Any


from tasks.core.errors import DraftlineError
from cli.console import ROOT
from tasks.core.config import STAGES

FLOW_NAME = "draftline"

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")

ALIVE = ("RUNNING", "PENDING", "CANCELLING")

# The pull step of the deployments whose nodes run a pinned release (flows/release.py).
RELEASE_STEP = "flows.release.use_release"

# The flow of a slice of a run's regeneration or extraction shards on another node (extract.nodes > 1;
# its `stage` parameter says which). Named before regeneration had slices: registered names stay valid.
EXTRACT_FLOW = "draftline-extract"


def slice_deployment(cfg: Any, own_deployment: str | None) -> str | None:
    """Where a run sends its regeneration and extraction slices: extract.deployment, else draftline-extract/
    plus the name of the run's own deployment (a run of draftline/b300 sends them to draftline-extract/b300)."""
    name = cfg.extract.deployment or own_deployment
    if not name:
        return None
    return name if "/" in name else f"{EXTRACT_FLOW}/{name}"


class OpsError(DraftlineError, RuntimeError):
    """An operation that cannot proceed; the message says what to do."""


def api_url() -> str | None:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


def ui_base() -> str | None:
    from prefect.settings import PREFECT_UI_URL

    url = PREFECT_UI_URL.value()
    if url:
        return str(url).rstrip("/")
    api = api_url()
    return api[: -len("/api")] if api and api.endswith("/api") else None


def run_url(run_id: Any) -> str | None:
    base = ui_base()
    return f"{base}/runs/flow-run/{run_id}" if base else None


def require_server(what: str) -> str:
    url = api_url()
    if not url:
        raise OpsError(
            f"{what} needs a Prefect server, and PREFECT_API_URL is not set (Prefect is in ephemeral mode, "
            "where runs live in this process only). Start one with `infra/local-stack.sh up` and "
            "`source .draftline/stack/env.sh`, or `export PREFECT_API_URL=http://HOST:4200/api`."
        )
    return url


def api_problem(exc: Exception) -> str:
    return (f"the Prefect API at {api_url() or '(ephemeral)'} failed: {type(exc).__name__}: {exc}; "
            "check the server and PREFECT_API_URL (`draftline doctor` tells more)")


def client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def state_of(run: Any) -> str:
    return run.state.type.value if run.state is not None else "UNKNOWN"


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def find_run(c: Any, ref: str | None) -> Any:
    """A draftline flow run by id, id prefix (8+ characters), name, or `last`/None."""
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterName,
    )
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.exceptions import ObjectNotFound

    flows = FlowFilter(name=FlowFilterName(any_=[FLOW_NAME]))
    if ref in (None, "", "last", "latest"):
        runs = c.read_flow_runs(flow_filter=flows, sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=1)
        if not runs:
            raise OpsError(f"no {FLOW_NAME} runs on {api_url() or 'the ephemeral server'} yet")
        return runs[0]
    try:
        return c.read_flow_run(uuid.UUID(ref))
    except ValueError:
        pass
    except ObjectNotFound:
        raise OpsError(f"no flow run {ref} on {api_url() or 'the ephemeral server'}") from None
    runs = c.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[ref])), limit=2)
    if not runs and re.fullmatch(r"[0-9a-fA-F-]{8,}", ref):
        recent = c.read_flow_runs(flow_filter=flows, sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=200)
        runs = [r for r in recent if str(r.id).startswith(ref.lower())]
    if not runs:
        raise OpsError(f"no flow run with id or name {ref!r}; `draftline status last` shows the newest run")
    if len(runs) > 1:
        raise OpsError(f"{ref!r} names several flow runs ({', '.join(str(r.id) for r in runs)}); use the full id")
    return runs[0]


def task_runs(c: Any, run_id: Any) -> list[Any]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    out: list[Any] = []
    while True:
        page = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])),
                                sort=TaskRunSort.EXPECTED_START_TIME_ASC, offset=len(out), limit=200)
        out.extend(page)
        if len(page) < 200:
            return out


def stage_of(task_name: str) -> str:
    """`extract-shard-3` -> `extract`; stage tasks are named after their stage."""
    for s in STAGES:
        if task_name == s or task_name.startswith(s + "-"):
            return s
    return task_name


def shard_of(task_name: str) -> int | None:
    """`extract-shard-3` or `regenerate-shard-3` -> 3 (stage_of says which stage)."""
    m = re.fullmatch(r"(?:extract|regenerate)-shard-(\d+)", task_name)
    return int(m.group(1)) if m else None


def latest_by_name(runs: list[Any]) -> dict[str, Any]:
    """The newest task run per task-run name (a retried flow run adds new ones)."""
    out: dict[str, Any] = {}
    for t in runs:
        key = t.name
        cur = out.get(key)
        when = t.start_time or t.expected_start_time or t.created
        if cur is None or when >= (cur.start_time or cur.expected_start_time or cur.created):
            out[key] = t
    return out


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


def child_runs(c: Any, run_id: Any) -> list[Any]:
    """Flow runs started by this run through run_deployment (regeneration and extraction slices on other
    nodes), oldest first."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )
    from prefect.client.schemas.sorting import FlowRunSort

    return list(c.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run_id])),
        sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=200))


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
    from tasks.core.config import ConfigError, read_config_file

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


def worker_copy(rel: str, pull_steps: list[dict[str, Any]] | None) -> tuple[bytes | None, str]:
    """The copy of REL (a path inside this checkout) that a deployment's workers would read, and where that
    is: the release commit `draftline deploy` recorded in the release pull step (read with git from this
    checkout), or the folder a deployment without a release runs in. None when this checkout cannot tell."""
    for step in pull_steps or []:
        pin = step.get(RELEASE_STEP)
        if isinstance(pin, dict):
            where = f"release {pin.get('release')}"
            commit = pin.get("commit")
            if not commit:
                return None, f"{where} (the deployment records no commit: redeploy it with `draftline deploy`)"
            where += f" at commit {str(commit)[:12]}"
            git = ["git", "-C", str(ROOT)]
            out = subprocess.run([*git, "show", f"{commit}:{rel}"], capture_output=True, timeout=60)
            if out.returncode == 0:
                return out.stdout, where
            known = subprocess.run([*git, "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True,
                                   timeout=60).returncode == 0
            return None, where + (", which has no such file" if known else
                                  ", a commit this checkout does not have (git fetch --tags)")
        folder = (step.get("prefect.deployments.steps.set_working_directory") or {}).get("directory")
        if folder:
            f = Path(folder) / rel
            return (f.read_bytes() if f.is_file() else None), f"the folder {folder}"
    return None, "the deployment's code (its pull steps name no release and no folder)"


def deployment_config(config: Path, overrides: list[str], inline: bool | None,
                      pull_steps: list[dict[str, Any]] | None) -> tuple[dict[str, Any], str | None, str | None]:
    """config_parameters for a run of a deployment: a config inside this checkout travels as its path only
    when the deployment's workers hold the same file (worker_copy); one that differs (the user edited it,
    or it is not in the release) is inlined, or refused with `--by-path` (inline=False). Returns the
    parameters, the config's store.uri (as config_parameters) and why the content was sent, if it was."""
    path = config.resolve()
    why = None
    if path.is_relative_to(ROOT) and path.is_file() and inline is not True:
        for f in config_chain(path):  # the file and the `base:` files it builds on
            rel = f.relative_to(ROOT).as_posix() if f.is_relative_to(ROOT) else None
            theirs, where = worker_copy(rel, pull_steps) if rel else (None, "no release: it is outside the checkout")
            if f.is_file() and theirs == f.read_bytes():
                continue
            name = rel or str(f)
            why = (f"{name} differs from its copy in {where}, which the worker would run" if theirs is not None
                   else f"{name} has no copy the worker would read that this checkout can see: {where}")
            if inline is False:
                raise OpsError(f"{why}; drop --by-path to send this file's content (or commit and release it, "
                               "then redeploy)")
            inline = True
            break
    params, file_store = config_parameters(config, overrides, inline)
    return params, file_store, why


def config_chain(path: Path) -> list[Path]:
    """PATH and the files it builds on through `base:` (a path relative to the including file), in order; the
    worker reads every one of them, so each must be the same there for the path alone to be enough."""
    import yaml  # (here: the module's own import may move with config_parameters)

    chain = [path.resolve()]
    while True:
        try:
            data = yaml.safe_load(chain[-1].read_text()) if chain[-1].is_file() else None
        except yaml.YAMLError:
            return chain
        base = data.get("base") if isinstance(data, dict) else None
        if not isinstance(base, str):
            return chain
        nxt = (chain[-1].parent / base).resolve()
        if nxt in chain:
            return chain
        chain.append(nxt)


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
