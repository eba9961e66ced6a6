"""The Prefect API client the commands use: where the server and its UI are, a run found by id, id
prefix, name or `last`, its task runs and child runs, which stage or shard a task name is, the config a
deployment's run gets, and waiting for a run (`wait_for`, what `submit --watch` and `retry --watch` do).

Everything here talks to the server named by PREFECT_API_URL (infra/local-stack.sh starts a local
one); nothing here changes how a run computes. What the flow itself knows of runs (the flows' names,
config parameters, which worker started a run) is flows/flow_runs.py."""

from __future__ import annotations

# Prefect is imported inside the functions that use it: it takes seconds to import (heavy), and every
# command's --help would wait for it.

import datetime as dt
import logging
import re
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import yaml

from cli.console import ROOT, console
from flows.flow_runs import FLOW_NAME, OpsError, config_parameters
from flows.started_runs import newest_started
from tasks.core.config import STAGES
from tasks.core.stages import parse_task_name

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")

ALIVE = ("RUNNING", "PENDING", "CANCELLING")

# The pull step of the deployments whose nodes run a pinned release (flows/release.py).
RELEASE_STEP = "flows.release.use_release"


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


def find_run(c: Any, ref: str | None, mine: bool = False) -> Any:
    """A draftline flow run by id, id prefix (8+ characters), name, or `last`/None: the newest on the server, or
    with MINE the newest that this machine started (flows/started_runs.py: `retry`, `check`, `export`), never one
    someone else created or scheduled in the future."""
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterName,
    )
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.exceptions import ObjectNotFound

    flows = FlowFilter(name=FlowFilterName(any_=[FLOW_NAME]))
    if ref in (None, "", "last", "latest") and mine:
        for run_id in newest_started():
            try:
                return c.read_flow_run(uuid.UUID(run_id))
            except ObjectNotFound:
                continue  # deleted on the server: the one before
        raise OpsError(f"no run on {api_url() or 'the ephemeral server'} was started from this machine "
                       "(`draftline run` or `submit` here); give the run's id (`draftline status last` shows the "
                       "newest on the server)")
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


PAGE = 200  # Prefect's server refuses a page larger than its PREFECT_API_DEFAULT_LIMIT (200)


def paged(read: Callable[..., list[Any]], **kwargs: Any) -> list[Any]:
    """Every row READ (a client's read_task_runs, read_flow_runs, read_logs) returns for KWARGS, page by page:
    one call answers at most PAGE rows. KWARGS' sort must be a total order (unique key) for the pages to
    neither skip nor repeat a row."""
    out: list[Any] = []
    while True:
        page = read(**kwargs, offset=len(out), limit=PAGE)
        out.extend(page)
        if len(page) < PAGE:
            return out


def task_runs(c: Any, run_id: Any) -> list[Any]:
    """Every task run of RUN_ID, oldest first. Paged by id, a unique key (expected start times need not be
    unique, and offset pages over an order with ties can skip or repeat rows), sorted here."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    out = paged(c.read_task_runs, flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])),
                sort=TaskRunSort.ID_DESC)
    return sorted(out, key=lambda t: (t.expected_start_time or t.created, str(t.id)))


def stage_of(task_name: str) -> str:
    """`extract-shard-3` -> `extract`; stage tasks are named after their stage (tasks/core/stages.py); a name
    no stage's task has is its own."""
    parsed = parse_task_name(task_name)
    return parsed[0] if parsed else task_name


def shard_of(task_name: str) -> int | None:
    """`extract-shard-3` or `regenerate-shard-3` -> 3 (stage_of says which stage)."""
    parsed = parse_task_name(task_name)
    return parsed[1] if parsed else None


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


def child_runs(c: Any, run_id: Any) -> list[Any]:
    """Flow runs started by this run through run_deployment (regeneration and extraction slices on other
    nodes), oldest first."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )
    from prefect.client.schemas.sorting import FlowRunSort

    out = paged(c.read_flow_runs, flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run_id])), sort=FlowRunSort.ID_DESC)
    return sorted(out, key=lambda r: (r.expected_start_time or r.created, str(r.id)))


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


# Flow-run heartbeats come every 30 s (job templates); this much silence means the process is gone.
HEARTBEAT_SECONDS = 30


def progress_line(c: Any, run: Any) -> str:
    """Where a run is, in one line: each stage's task runs (finished/all, running), extraction shards
    included (its child runs' too), and the stages' progress artifacts (regeneration, extraction, training)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType

    runs = [run, *child_runs(c, run.id)]
    stages: dict[str, list[int]] = {}
    for r in runs:
        for name, t in latest_by_name([t for t in task_runs(c, r.id) if "/" not in t.name]).items():
            if name == "extract":  # the stage's artifact, after its shards: the line counts extraction's shards
                continue
            done, total, running = stages.setdefault(stage_of(name), [0, 0, 0])
            kind = t.state.type.value if t.state is not None else ""
            stages[stage_of(name)] = [done + (kind == "COMPLETED"), total + 1, running + (kind == "RUNNING")]
    bars: dict[str, Any] = {}
    try:
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[r.id for r in runs]), type=ArtifactFilterType(any_=["progress"])))
        for a in sorted(arts, key=lambda a: a.updated or a.created):
            bars[(a.key or "").removesuffix("-progress")] = a
    except Exception as exc:  # noqa: BLE001 - progress is a courtesy; the states above stand
        logging.getLogger("draftline.status").warning(
            f"progress bars of run {run.name} not read ({type(exc).__name__}: {exc}); showing the task states only")
    parts = []
    for name in sorted(stages, key=lambda s: STAGES.index(s) if s in STAGES else 99):
        done, total, running = stages[name]
        what = "shards" if name == "extract" else "tasks"
        part = f"{name} {done}/{total} {what}" + (f" ({running} running)" if running else "")
        bar = bars.get(name)
        if bar is not None and done < total:
            part += f", {float(bar.data or 0):.0f}%" + (f" {bar.description}" if bar.description else "")
        parts.append(part)
    return "; ".join(parts)


PROGRESS_EVERY_S = 30.0


def wait_for(c: Any, run_id: Any, timeout: float | None = None, *, quiet: bool = False,
             not_before: dt.datetime | None = None) -> Any:
    """Poll until the run reaches a terminal state (after `not_before`, for a retried run), printing its
    state changes and, every PROGRESS_EVERY_S while it runs, its stage and shard progress when that moved.
    No limit unless `timeout` (seconds): a big run takes days."""
    deadline = time.time() + timeout if timeout else None
    last = shown = None
    since = note = time.time()
    next_progress = 0.0
    while True:
        run = c.read_flow_run(run_id)
        st = state_of(run)
        fresh = not_before is None or (run.state is not None and run.state.timestamp >= not_before)
        now = time.time()
        if st != last and not quiet:
            console.print(f"  {dt.datetime.now().strftime('%H:%M:%S')} {run.name}: {run.state.name if run.state else st}")
            last, since, note = st, now, now
        elif not quiet and st == "RUNNING" and now >= next_progress:
            next_progress = now + PROGRESS_EVERY_S
            line = progress_line(c, run)
            if line and line != shown:
                console.print(f"  {dt.datetime.now().strftime('%H:%M:%S')} {run.name}: {line}")
                shown, note = line, now
        if not quiet and now - note >= 600 or not quiet and st != "RUNNING" and now - note >= 60:
            note = now
            # Never silent: a Scheduled run waits for a worker of its pool, a Running one for its node.
            waits = "for a worker of its pool to pick it up" if st in ("SCHEDULED", "PENDING") else "for it to finish"
            console.print(f"  {dt.datetime.now().strftime('%H:%M:%S')} {run.name}: still {st} after "
                          f"{now - since:.0f} s, waiting {waits}" + (
                              f"; gives up at {time.strftime('%H:%M:%S', time.localtime(deadline))}" if deadline else ""))
        if st in TERMINAL and fresh:
            return run
        if deadline is not None and now > deadline:
            raise OpsError(f"run {run_id} still {st} after {timeout:.0f}s; `draftline status {run_id}` to look")
        time.sleep(2)
