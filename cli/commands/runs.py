"""`draftline status | retry | ui`: what a run did and whether it is still alive, re-running what
failed, and the run's page in the Prefect UI.

    draftline status RUN     stages and shards of a run, its child runs (extraction slices on other
                             nodes); flags a Running run whose process is gone
    draftline retry RUN      re-run what failed (finished shards are reused)
    draftline ui [RUN]       the run's page in the Prefect UI
    draftline logs [RUN]     the run's and its task runs' logs, from the Prefect API (--follow)

RUN is a flow run id (or its first 8+ characters), a flow run name, or `last` (the default). A run whose process
died stays Running on the server (Prefect marks nothing by itself): its heartbeats, its worker's
host and the pid the worker started tell whether anything still runs it."""

from __future__ import annotations

# Prefect is imported inside the functions that use it: it takes seconds to import (heavy), and every
# command's --help would wait for it.

import datetime as dt
import json
import logging
import socket
import time
import webbrowser
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from cli.console import JsonOpt, RunArg, TimeoutOpt, console, err, fail, mask
from cli.local_run import run_here
from cli.prefect_api import (
    ALIVE,
    TERMINAL,
    child_runs,
    client,
    find_run,
    latest_by_name,
    paged,
    require_server,
    run_url,
    shard_of,
    stage_of,
    state_of,
    task_runs,
    wait_for,
)
from flows.flow_runs import FLOW_NAME, OpsError, child_stage, flow_run_events, submitting_worker, utcnow
from flows.started_runs import changes, risky_changes, started_here
from tasks.core.config import STAGES
from tasks.core.owners import pid_running


HEARTBEAT_GRACE = 150.0


@dataclass
class Liveness:
    """Whether a run that the server calls Running still has a live process behind it."""

    stale: bool
    reasons: list[str] = field(default_factory=list)
    last_progress: str | None = None
    last_heartbeat: str | None = None


def worker_host(worker_name: str | None) -> str | None:
    """Workers started by infra/node-bootstrap.sh are named `draftline@HOST`."""
    if worker_name and "@" in worker_name:
        return worker_name.rsplit("@", 1)[1]
    return None


def last_heartbeat(c: Any, run: Any) -> dt.datetime | None:
    since = (run.start_time or run.expected_start_time or utcnow()) - dt.timedelta(minutes=1)
    events = flow_run_events(c, run.id, "prefect.flow-run.heartbeat", since, about="resource")
    return max((e.occurred for e in events or []), default=None)


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
    now = now or utcnow()
    host = host or socket.gethostname()
    state = state_of(run)
    if state not in ALIVE:
        return Liveness(stale=False)
    reasons: list[str] = []
    pid = str(run.infrastructure_pid or "")
    if pid.isdigit() and worker is not None and worker_host(worker.name) == host and not pid_running(int(pid)):
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


def child_report(c: Any, run: Any, stale_after: float) -> dict[str, Any]:
    """A child run's state, node, liveness and shards (the latest task run of each)."""
    tasks = task_runs(c, run.id)
    shards = {shard_of(n): t for n, t in latest_by_name(tasks).items() if shard_of(n) is not None}
    worker = submitting_worker(c, run)
    live = assess(run, tasks, heartbeat=last_heartbeat(c, run) if state_of(run) in ALIVE else None,
                  worker=worker, stale_after=stale_after)
    return {
        "id": str(run.id), "name": run.name, "state": state_of(run),
        "state_name": run.state.name if run.state else None,
        "message": run.state.message if run.state else None,
        "worker": worker.name if worker is not None else None,
        "stage": child_stage(run),
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
    # a finished run whose task runs are not all final yet: Prefect sends task-run states over its events stream
    # and the server writes them behind it (~100 s behind at 1,024 task runs on a loaded server: benchmarks/RESULTS.md,
    # "A run's page in the Prefect UI at 128 and 1,024 task runs"), so the counts above are not settled yet
    settling = sum(1 for t in latest.values() if t.state is None or not t.state.is_final()) \
        if state_of(run) in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else 0
    deployment = None
    if run.deployment_id:
        try:
            d = c.read_deployment(run.deployment_id)
            deployment = f"{FLOW_NAME}/{d.name}"
        except Exception:
            deployment = str(run.deployment_id)
    worker = submitting_worker(c, run)
    live = assess(run, tasks, heartbeat=last_heartbeat(c, run) if state_of(run) in ALIVE else None,
                  worker=worker, stale_after=stale_after)
    return {
        "id": str(run.id),
        "name": run.name,
        "state": state_of(run),
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
        "settling": settling,
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
    if rep.get("settling"):
        err.print(f"[bold yellow]the server is still writing {rep['settling']} task runs' final states[/] (the run "
                  "has ended; Prefect sends task-run states over its events stream and writes them behind it): "
                  "these counts are not settled; run `draftline status` again in a minute.")
    if rep.get("children"):
        t3 = Table(title="child runs (slices of a stage's shards on other nodes)")
        for col in ("child run", "stage", "state", "worker", "shards"):
            t3.add_column(col, overflow="fold")
        for ch in rep["children"]:
            shards = ", ".join(f"{s} {ch['shard_states'].get(str(s)) or 'not started'}" for s in ch["shards"])
            state = ch["state_name"] or ch["state"]
            if ch["stale"]:
                state += " (looks dead: " + "; ".join(ch["stale_reasons"]) + ")"
            t3.add_row(f"{ch['name']} ({ch['id'][:8]})", ch["stage"], state, ch["worker"] or "-", shards)
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


StaleOpt = typer.Option(30.0, "--stale-after", help="Minutes without progress (and without heartbeats) after "
                                                    "which a Running run counts as dead.")


def status(run: str = RunArg,
           tasks: bool = typer.Option(False, "--tasks", help="List every task run (latest attempt of each)."),
           stale_after: float = StaleOpt,
           as_json: bool = typer.Option(False, "--json", help="Print the status as JSON.")):
    """Where a run stands: its state, each stage's task runs, failed shards, and whether a Running run is dead."""
    with client() as c:
        rep = run_report(c, find_run(c, run), stale_after * 60)
    if as_json:
        print(json.dumps(rep, indent=2, default=str))
    else:
        print_report(rep, tasks)


def retry(run: str = RunArg,
          force: bool = typer.Option(False, "--force", help="Retry a run that looks alive or that completed."),
          stale_after: float = StaleOpt,
          watch: bool = typer.Option(False, "--watch", help="Wait for the retried run; exit 1 unless it completes."),
          timeout: Optional[float] = TimeoutOpt,
          accept: bool = typer.Option(False, "--accept-changed-parameters",
                                      help="A local run whose parameters on the Prefect API differ from what this "
                                           "machine recorded in a way that runs a repository's code or sends data "
                                           "elsewhere (trust_remote_code, store, endpoint): run them anyway."),
          as_json: bool = typer.Option(False, "--json", help="A local run: print its summary as one JSON object.")):
    """Re-run only what did not finish: finished stages and shards are reused from the store.

    A run of a deployment is retried in place (set to Scheduled; a worker of its pool picks it up,
    on the same node or another one sharing the store). A local run (no deployment) is run again
    here, only if this machine started it: its parameters on the Prefect API are compared with this machine's
    record, what differs is shown, and a change of trust_remote_code, the store or its endpoint needs
    --accept-changed-parameters. RUN `last` is the newest run this machine started. A run stuck in Running
    after its node died is marked Crashed first.
    """
    from prefect.states import Crashed

    with client() as c:
        fr = find_run(c, run, mine=True)
        st = state_of(fr)
        # its process may still be exiting (see reschedule); a run retry marks Crashed has none left
        just_ended = st in ("FAILED", "CRASHED") and fr.state is not None and \
            (utcnow() - fr.state.timestamp).total_seconds() < RECENT_END_S
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
            if state_of(ch) in ALIVE:
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
            t0 = utcnow()
            reschedule(c, fr, watch=just_ended)
            pool = getattr(fr, "work_pool_name", None)
            console.print(f"retrying {fr.name} ({fr.id}) in place: scheduled for a worker of pool {pool}; "
                          "finished shards are reused from the store")
            if run_url(fr.id):
                console.print(f"  UI: {run_url(fr.id)}")
            if watch:
                done = wait_for(c, fr.id, timeout, not_before=t0)
                if state_of(done) != "COMPLETED":
                    raise typer.Exit(1)
            return
        params = dict(fr.parameters or {})
    _retry_locally(fr, params, as_json, accept)


# A run that ended moments ago may still have its process exiting; when it exits with an error, Prefect's
# runner reports the run Crashed, and that report lands on top of a retry's Scheduled (the run then never
# starts again). A retry of a run that ended less than RECENT_END_S ago (`watch`) looks for that override
# for up to OVERRIDE_WATCH_S, until a worker takes the run, and schedules it again.
RECENT_END_S = 120.0
OVERRIDE_WATCH_S = 30.0


def reschedule(c: Any, fr: Any, *, watch: bool, watch_s: float = OVERRIDE_WATCH_S, poll_s: float = 1.0) -> None:
    """Set the run Scheduled for a worker of its pool, surviving a late crash report of its last process."""
    from prefect.states import Scheduled

    for _ in range(3):
        res = c.set_flow_run_state(fr.id, Scheduled(message="Retried via draftline retry"), force=True)
        if getattr(res.status, "value", str(res.status)) == "ABORT":
            raise OpsError(f"the server refused to reschedule {fr.name}: {res.details.reason}")
        if not watch:
            return
        ours = getattr(res.state, "id", None)
        deadline = time.time() + watch_s
        while time.time() < deadline:
            cur = c.read_flow_run(fr.id)
            st = state_of(cur)
            if st in ("PENDING", "RUNNING", "COMPLETED"):
                return  # a worker took it
            if st in ("CRASHED", "FAILED") and cur.state.id != ours:
                console.print(f"{fr.name}'s last process reported {st.lower()} after the retry scheduled it "
                              f"({(cur.state.message or '').strip()[:120]}): scheduling it again")
                break
            time.sleep(poll_s)
        else:
            return  # still Scheduled: waiting for a free worker of the pool
    raise OpsError(f"{fr.name} kept being marked crashed after each reschedule; check its worker's log")


def local_rerun_problem(fr: Any, params: dict[str, Any], accept: bool) -> tuple[list[str], str | None]:
    """(what differs from this machine's record of the run, why it may not run here or None). A run's parameters
    come from the Prefect API, which every API user writes: only a run this machine started runs here, and a
    change that would run a repository's code or send data elsewhere needs the user's explicit --accept."""
    mine = started_here(fr.id)
    if mine is None:
        return [], (f"run {fr.name} ({fr.id}) was not started from this machine: its parameters come from the "
                    "Prefect API, which any API user can write, so `draftline retry` does not run them here. Read "
                    f"them (`draftline status {fr.id} --json`) and start it yourself with `draftline run CONFIG "
                    "--set ...` if you trust them")
    diff = changes(mine["parameters"], params)
    if not diff:
        return [], None
    try:
        risky = risky_changes(mine["parameters"], params)
    except Exception as exc:  # noqa: BLE001 - a config that no longer loads: nothing to run
        return diff, f"run {fr.name}'s parameters changed since this machine started it and no longer load: {exc}"
    if risky and not accept:
        return diff, (f"run {fr.name}'s parameters on the Prefect API changed since this machine started it: "
                      f"{'; '.join(risky)}. Check who changed them; pass --accept-changed-parameters to run them "
                      "anyway")
    return diff, None


def _retry_locally(fr: Any, params: dict[str, Any], as_json: bool = False, accept: bool = False) -> None:
    diff, problem = local_rerun_problem(fr, params, accept)
    if diff:
        err.print(mask(f"{fr.name}'s parameters differ from what this machine recorded when it started it:\n  "
                       + "\n  ".join(diff)), markup=False, highlight=False)
    if problem:
        fail(problem)
    cfg_path = params.get("config_path")
    if cfg_path and not Path(cfg_path).is_file():
        fail(f"run {fr.name} read its config from {cfg_path}, which is not here; run the retry from the "
             "folder the run started in")
    (err if as_json else console).print(
        f"{fr.name} was a local run (no deployment): running it again here with the same parameters")
    run_here(cfg_path, list(params.get("overrides") or []), params.get("until"), as_json=as_json)


def ui(run: str = RunArg,
       open_browser: bool = typer.Option(False, "--open", help="Also open it in the default browser."),
       as_json: bool = JsonOpt):
    """Print the run's URL in the Prefect UI (task runs per shard, artifacts, logs)."""
    require_server("draftline ui")
    with client() as c:
        fr = find_run(c, run)
    url = run_url(fr.id)
    if not url:
        fail("cannot tell the UI address from PREFECT_API_URL; set PREFECT_UI_URL")
    print(json.dumps({"id": str(fr.id), "name": fr.name, "state": state_of(fr), "ui_url": url}) if as_json else url)
    if open_browser:
        webbrowser.open(url)


def _log_row(log: Any, names: dict[Any, str]) -> dict[str, Any]:
    return {"time": log.timestamp.isoformat(timespec="seconds"), "level": logging.getLevelName(log.level),
            "task": names.get(log.task_run_id) if log.task_run_id else None, "flow_run_id": str(log.flow_run_id),
            "message": log.message}


def logs(run: str = RunArg,
         follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines until the run ends."),
         tail: Optional[int] = typer.Option(None, "--tail", "-t", metavar="N", help="Only the last N lines."),
         level: str = typer.Option("INFO", "--level", help="Least level shown: DEBUG, INFO, WARNING, ERROR."),
         as_json: bool = typer.Option(False, "--json", help="One JSON object per line (time, level, task, message).")):
    """A run's logs and its task runs' (child runs' too), from the Prefect API: what the UI's Logs tab shows."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterLevel, LogFilterTimestamp
    from prefect.client.schemas.sorting import LogSort

    least = logging.getLevelName(level.upper())
    if not isinstance(least, int):
        fail(f"--level {level!r}: use DEBUG, INFO, WARNING or ERROR")
    require_server("draftline logs")
    with client() as c:
        fr = find_run(c, run)
        after: dt.datetime | None = None
        first = True
        while True:
            ids = [fr.id, *(ch.id for ch in child_runs(c, fr.id))]
            names = {t.id: t.name for i in ids for t in task_runs(c, i)}
            got = paged(c.read_logs, log_filter=LogFilter(  # oldest first
                flow_run_id=LogFilterFlowRunId(any_=ids), level=LogFilterLevel(ge_=least),
                timestamp=LogFilterTimestamp(after_=after) if after else None), sort=LogSort.TIMESTAMP_ASC)
            if after is not None:
                got = [g for g in got if g.timestamp > after]
            if first and tail:
                got = got[-tail:]
            for g in got:
                row = _log_row(g, names)
                if as_json:
                    print(json.dumps(row))
                else:
                    where = f" {row['task']}" if row["task"] else ""
                    console.print(f"{row['time']} {row['level']:<7}{where} | {row['message']}", markup=False,
                                  highlight=False)
            if got:
                after = got[-1].timestamp
            first = False
            if not follow or state_of(c.read_flow_run(fr.id)) in TERMINAL:
                break
            time.sleep(2)
