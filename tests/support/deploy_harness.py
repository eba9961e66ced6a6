"""The deployment scenario shared by tests/integration/test_deploy.py and tests/e2e/test_ui.py.

It does what the guide (docs/DEPLOY.md) tells a user to do, with real parts: a
Prefect server and SeaweedFS (the session fixtures), `draftline deploy`, a
process worker started by infra/node-bootstrap.sh, `draftline submit`,
`draftline status` and `draftline retry`:

1. deploy `local`, `b300` and `b300-docker`; node A runs infra/node-bootstrap.sh (a worker of pool draftline-b300);
2. submit tests/configs/deploy-small.yaml to b300 with two extraction shards failing for real
   (DRAFTLINE_FAULT_EXTRACT_SHARDS=1,3): attempt 1 fails with shards 1 and 3 failed;
3. `draftline retry`: attempt 2 starts on node A, which dies (worker and flow process SIGKILLed)
   while the run is running: the server still says Running;
4. `draftline status` says the run is dead; `draftline retry` marks it Crashed and reschedules it;
5. node B (a new worker, fresh Prefect home) picks it up: attempt 3 completes, reusing everything
   that was finished, through the shared S3 store.

The scenario runs once per test session (both test modules read its result).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CONFIG = "tests/configs/deploy-small.yaml"
FAULTY = (1, 3)
_RESULT: dict[str, Any] = {}


def version() -> str:
    return re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def draftline(*args: str, env: dict[str, str], timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([str(BIN / "draftline"), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"draftline {' '.join(args)} -> exit {out.returncode}\n{out.stdout[-3000:]}\n"
                             f"{out.stderr[-3000:]}")
    return out


def client(server):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    class _Ctx:
        def __enter__(self):
            self.settings = temporary_settings(updates={PREFECT_API_URL: server.api_url})
            self.settings.__enter__()
            self.c = get_client(sync_client=True)
            return self.c.__enter__()

        def __exit__(self, *exc):
            self.c.__exit__(*exc)
            self.settings.__exit__(*exc)

    return _Ctx()


class Node:
    """A 'rented node': infra/node-bootstrap.sh --foreground, with its own Prefect home."""

    def __init__(self, name: str, tmp: Path, env: dict[str, str], server):
        self.name, self.tmp, self.server = name, tmp / name, server
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.log_path = self.tmp / "bootstrap.log"
        from tasks.core.home import cache_home

        self.env = dict(env, PREFECT_HOME=str(self.tmp / "prefect-home"), DRAFTLINE_RELEASE=f"v{version()}",
                        DRAFTLINE_SOURCE_DIR=str(ROOT), DRAFTLINE_VENV=sys.prefix, DRAFTLINE_EXPECT_GPUS="0",
                        DRAFTLINE_PREFIX=str(self.tmp / "opt"), DRAFTLINE_CACHE=str(cache_home()),
                        DRAFTLINE_POOL="draftline-b300", DRAFTLINE_WORKER_LIMIT="1",
                        DRAFTLINE_WORKER_AS_ROOT="1")  # a test sandbox's root (the script drops a real node's)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300) -> "Node":
        self.launch()
        return self.wait_started(timeout)

    def launch(self) -> None:
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(["bash", str(ROOT / "infra" / "node-bootstrap.sh"), "--foreground"], cwd=ROOT,
                                     env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_started(self, timeout: float = 300) -> "Node":
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"node-bootstrap exited {self.proc.returncode}:\n{self.read_log()[-4000:]}")
            if "started!" in self.read_log():  # prefect: "Worker 'draftline@HOST' started!"
                return self
            time.sleep(1)
        raise AssertionError(f"worker of node {self.name} not started after {timeout}s:\n{self.read_log()[-3000:]}")

    def read_log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """The node dies: SIGKILL to the worker's process group (no chance to report anything)."""
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)

    def stop(self) -> None:
        stop_group(self.proc)


def stop_group(proc: subprocess.Popen | None, grace: float = 30) -> None:
    """SIGTERM to a process group started with start_new_session, SIGKILL after GRACE seconds."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(grace)


class Worker:
    """A node as a plain `prefect worker start --limit 1` (what node-bootstrap.sh ends with), in its own
    process group with its own Prefect home: killing the group is the node dying, with the flow-run
    processes it started (Prefect's process worker keeps them in its group)."""

    def __init__(self, argv: list[str], tmp: Path, env: dict[str, str]):
        """ARGV: `prefect worker start --pool POOL --limit 1 --name draftline@NODE` as the guide shows it."""
        assert argv[1:3] == ["worker", "start"] and "--name" in argv, argv
        self.argv = [str(BIN / "prefect"), *argv[1:]]
        self.name = argv[argv.index("--name") + 1].rsplit("@", 1)[-1]
        self.home = tmp / self.name
        self.home.mkdir(parents=True, exist_ok=True)
        self.log_path = self.home / "worker.log"
        self.env = dict(env, PREFECT_HOME=str(self.home / "prefect-home"))
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Worker":
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def wait_started(self, timeout: float = 120) -> "Worker":
        deadline = time.time() + timeout
        while "started!" not in self.read_log():
            if self.proc.poll() is not None:
                raise AssertionError(f"worker {self.name} exited {self.proc.returncode}:\n{self.read_log()[-4000:]}")
            if time.time() > deadline:
                raise AssertionError(f"worker {self.name} not started after {timeout}s:\n{self.read_log()[-3000:]}")
            time.sleep(0.5)
        return self

    def read_log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        stop_group(self.proc)


def kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def gone(pid: int, timeout: float) -> None:
    """Wait until PID has exited (as `draftline status` judges it: no process, or a zombie)."""
    from tasks.core.owners import pid_running

    deadline = time.time() + timeout
    while pid_running(pid):
        if time.time() > deadline:
            raise AssertionError(f"pid {pid} still running {timeout}s after SIGKILL")
        time.sleep(0.1)


def wait_state(server, run_id: str, states: tuple[str, ...], timeout: float, not_before: dt.datetime | None = None):
    deadline = time.time() + timeout
    with client(server) as c:
        while True:
            run = c.read_flow_run(uuid.UUID(run_id))
            st = run.state.type.value if run.state else None
            fresh = not_before is None or (run.state is not None and run.state.timestamp >= not_before)
            if st in states and fresh:
                return run
            if time.time() > deadline:
                raise AssertionError(f"run {run_id} is {st}, not {states}, after {timeout}s")
            time.sleep(1)


def wait_submitted(server, run_id: str, since: dt.datetime, timeout: float):
    """The run, once the server holds its infrastructure pid and the submitting worker's event since SINCE."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventRelatedFilter

    deadline = time.time() + timeout
    with client(server) as c:
        while True:
            run = c.read_flow_run(uuid.UUID(run_id))
            page = c.read_events(filter=EventFilter(
                event=EventNameFilter(name=["prefect.worker.submitted-flow-run"]),
                related=EventRelatedFilter(id=[f"prefect.flow-run.{run_id}"]),
                occurred=EventOccurredFilter(since=since - dt.timedelta(seconds=5),
                                             until=dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=1)),
            ), limit=5)
            if run.infrastructure_pid and page.events:
                return run
            if time.time() > deadline:
                raise AssertionError(f"run {run_id}: no infrastructure pid ({run.infrastructure_pid!r}) or "
                                     f"submitted-flow-run event ({len(page.events)}) after {timeout}s")
            time.sleep(0.5)


def task_runs(server, run_id: str) -> list[dict[str, Any]]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with client(server) as c:
        trs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(run_id)])), limit=200)
    return [{"name": t.name, "state": t.state.name if t.state else None,
             "type": t.state.type.value if t.state else None, "attempt": t.flow_run_run_count,
             "start": t.start_time} for t in trs]


def run_scenario(prefect_server, s3_server, tmp: Path) -> dict[str, Any]:
    if _RESULT:
        return _RESULT
    tmp.mkdir(parents=True, exist_ok=True)
    prefix = f"deploy-{uuid.uuid4().hex[:8]}"
    store_uri = f"s3://draftline-test/{prefix}"
    env = dict(os.environ, **prefect_server.env(), **s3_server.env(), DRAFTLINE_STORE_URI=store_uri)
    env.pop("PREFECT_UI_URL", None)
    cli_env = dict(env, PREFECT_HOME=str(tmp / "laptop-home"))
    cli_env.pop("DRAFTLINE_STORE_URI")  # the laptop does not choose the store: the node's environment does
    res: dict[str, Any] = {"store_uri": store_uri, "tmp": str(tmp), "t": {}}
    t0 = time.time()

    res["deploy"] = draftline("deploy", env=cli_env, timeout=900).stdout  # all three deployments
    res["t"]["deploy"] = round(time.time() - t0, 1)
    node_a = Node("node-a", tmp, env, prefect_server).start()
    node_b = Node("node-b", tmp, env, prefect_server)
    res["t"]["node_a_up"] = round(time.time() - t0, 1)
    try:
        out = draftline("submit", CONFIG, "--deployment", "b300", "--until", "extract",
                        "--env", f"DRAFTLINE_FAULT_EXTRACT_SHARDS={','.join(map(str, FAULTY))}",
                        "--env", f"DRAFTLINE_FAULT_DIR={tmp / 'faults'}", "--json", env=cli_env)
        sub = json.loads(out.stdout.strip().splitlines()[-1])
        run_id = res["run_id"] = sub["id"]
        res["submit"] = sub
        wait_state(prefect_server, run_id, ("FAILED", "COMPLETED", "CRASHED"), timeout=900)
        res["t"]["attempt1"] = round(time.time() - t0, 1)
        res["status_failed"] = json.loads(draftline("status", run_id, "--json", env=cli_env).stdout)

        # attempt 2, on node A, which dies as soon as the run is running again
        t_retry1 = dt.datetime.now(dt.timezone.utc)
        res["t_retry1"] = t_retry1.isoformat()
        res["retry1"] = draftline("retry", run_id, env=cli_env).stdout
        run = wait_state(prefect_server, run_id, ("RUNNING",), timeout=900, not_before=t_retry1)
        assert run.run_count == 2, run.run_count
        # A node dies minutes into a run, not milliseconds: let the server record who runs it (the
        # worker's submitted-flow-run event and the pid land a moment after Running) before node A dies.
        run = wait_submitted(prefect_server, run_id, t_retry1, timeout=60)
        pid = run.infrastructure_pid
        node_a.kill()
        if pid and str(pid).isdigit():
            kill_pid(int(pid))
            gone(int(pid), timeout=10)  # SIGKILL is delivered asynchronously: dead before anyone asks
        res["killed_pid"] = pid
        res["t"]["node_a_killed"] = round(time.time() - t0, 1)
        res["status_dead"] = json.loads(draftline("status", run_id, "--json", env=cli_env).stdout)
        # node B boots (install checks, doctor) while we look at the dead run and retry it
        node_b.launch()
        res["retry2"] = draftline("retry", run_id, env=cli_env).stdout
        with client(prefect_server) as c:
            res["states_after_retry2"] = [s.type.value for s in c.read_flow_run_states(uuid.UUID(run_id))]

        # attempt 3, on node B
        node_b.wait_started()
        res["t"]["node_b_up"] = round(time.time() - t0, 1)
        run = wait_state(prefect_server, run_id, ("COMPLETED", "FAILED", "CRASHED"), timeout=900,
                         not_before=t_retry1)
        res["final_state"] = run.state.type.value
        res["run_count"] = run.run_count
        res["t"]["attempt3"] = round(time.time() - t0, 1)
        res["status_done"] = json.loads(draftline("status", run_id, "--json", env=cli_env).stdout)
        res["ui"] = draftline("ui", run_id, env=cli_env).stdout.strip()
        res["tasks"] = task_runs(prefect_server, run_id)
        res["node_a_log"] = node_a.read_log()
        res["node_b_log"] = node_b.read_log()
    finally:
        node_a.stop()
        node_b.stop()
    res["t"]["total"] = round(time.time() - t0, 1)
    _RESULT.update(res)
    (tmp / "scenario.json").write_text(json.dumps(res, indent=2, default=str))
    return _RESULT
