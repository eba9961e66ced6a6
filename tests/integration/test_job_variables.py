"""A flow run chooses only what its work pool's template lets it choose: never the command, the working folder,
the image or the environment a node runs it with.

What Prefect 3.7.7 does, checked here against a real `prefect server` and a real worker (the test below holds
each line, so an upgrade that changes one fails it):

- `POST /deployments/{id}/create_flow_run` (what `run_deployment`, `draftline submit` and the UI use) validates
  the run's job variables, merged over the deployment's, against the pool's base job template's `variables`
  schema (`prefect.server.api.deployments.create_flow_run_from_deployment` calls
  `validate_job_variables_for_deployment_flow_run`): with `additionalProperties: false` a `command`,
  `working_dir` or `env.X` key is refused with 422, and `env` of fixed properties refuses any other name.
  `PATCH /flow_runs/{id}` of a Scheduled run validates the same way (read in `prefect.server.api.flow_runs.
  update_flow_run`, not exercised here).
- `POST /flow_runs/` with the (deprecated) `deployment_id`, a `work_pool_name` and `job_variables` validates
  nothing: the run is created Scheduled in the pool's queue with whatever job variables it carries.
- Prefect's worker builds the job from the template's `job_configuration` only, so a variable the template
  does not place (`command`, `working_dir`) is ignored; but it merges a run's `env` into the process's
  environment whatever the schema says. So the deprecated route above would still set `LD_PRELOAD` or
  `PYTHONPATH` on a node: draftline's node worker (flows/node_worker.py, which infra/node-bootstrap.sh starts)
  checks every run's job variables against the template first, marks a run that fails Crashed and starts
  nothing for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import deploy_harness as harness

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "deployments" / "job-templates"

PROBE = '''
import json, os, sys
from prefect import flow

@flow(name="probe")
def probe(out: str):
    with open(out, "a") as fh:
        fh.write(json.dumps({k: os.environ.get(k) for k in ("VLLM_LOGGING_LEVEL", "LD_PRELOAD", "EVIL")}) + "\\n")
'''


def test_templates_declare_only_what_a_run_may_choose():
    for name in ("process.json", "docker-gpu.json"):
        t = json.loads((TEMPLATES / name).read_text())
        var, job = t["variables"], t["job_configuration"]
        assert var["additionalProperties"] is False, name
        for key in ("command", "working_dir", "image", "privileged", "network_mode", "networks",
                    "registry_credentials"):
            assert key not in var["properties"], (name, key)
            assert "{{ " + key + " }}" not in json.dumps(job), (name, key)
        env = var["properties"]["env"]
        assert env["additionalProperties"] is False and env["properties"], name
        assert not {"LD_PRELOAD", "PYTHONPATH", "PREFECT_API_URL", "PATH"} & set(env["properties"]), name
    docker = json.loads((TEMPLATES / "docker-gpu.json").read_text())["job_configuration"]
    assert docker["privileged"] is False and docker["image"] == f"draftline-worker:{harness.version()}"


def _wait(c, run_id, states, timeout=240):
    deadline = time.time() + timeout
    while True:
        run = c.read_flow_run(run_id)
        if run.state and run.state.type.value in states:
            return run
        if time.time() > deadline:
            raise AssertionError(f"run {run_id} is {run.state and run.state.type.value}, not {states}")
        time.sleep(1)


def test_a_flow_run_cannot_choose_a_nodes_command_or_environment(prefect_server, tmp_path):
    import httpx
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import PrefectHTTPStatusError

    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "probe.py").write_text(PROBE)
    out, planted = tmp_path / "out.jsonl", tmp_path / "planted"
    pool = f"draftline-probe-{uuid.uuid4().hex[:6]}"
    with harness.client(prefect_server) as c:
        c.create_work_pool(WorkPoolCreate(name=pool, type="process",
                                          base_job_template=json.loads((TEMPLATES / "process.json").read_text())))
        flow_id = c.create_flow_from_name("probe")
        dep = c.create_deployment(flow_id=flow_id, name="probe", entrypoint="probe.py:probe", work_pool_name=pool,
                                  parameters={"out": str(out)}, pull_steps=[
                                      {"prefect.deployments.steps.set_working_directory":
                                       {"directory": str(tmp_path / "code")}}])
        # the server refuses, at creation, what the template does not declare
        for jv, named in (({"command": f"touch {planted}"}, "'command' was unexpected"),
                          ({"working_dir": "/"}, "'working_dir' was unexpected"),
                          ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, "'LD_PRELOAD' was unexpected"),
                          ({"env.EVIL": "1"}, "'env.EVIL' was unexpected")):
            with pytest.raises(PrefectHTTPStatusError) as exc:
                c.create_flow_run_from_deployment(dep, job_variables=jv)
            assert exc.value.response.status_code == 422 and named in exc.value.response.text, jv
        allowed = c.create_flow_run_from_deployment(dep, job_variables={"env": {"VLLM_LOGGING_LEVEL": "INFO"}})
        # `draftline submit --env` says so before sending, with the names the pool allows and where the rest go
        from cli.commands.deploy import refuse_unnamed_env
        from flows.flow_runs import OpsError

        with pytest.raises(OpsError, match=r"--env LD_PRELOAD: work pool .* lets a run set only .*VLLM_LOGGING_LEVEL"
                                           r".*the worker's environment on the node"):
            refuse_unnamed_env(c.read_work_pool(pool), {"LD_PRELOAD": "/tmp/x.so", "VLLM_LOGGING_LEVEL": "INFO"})
        refuse_unnamed_env(c.read_work_pool(pool), {"VLLM_LOGGING_LEVEL": "INFO", "DRAFTLINE_FAULT_DIR": "/tmp"})
        # ... but not through the deprecated route, which creates the run as given
        r = httpx.post(f"{prefect_server.api_url}/flow_runs/", json={
            "flow_id": str(flow_id), "deployment_id": str(dep), "work_pool_name": pool,
            "parameters": {"out": str(out)}, "state": {"type": "SCHEDULED"},
            "job_variables": {"command": f"touch {planted}", "env": {"EVIL": "1"}}})
        assert r.status_code == 201 and r.json()["job_variables"]["env"] == {"EVIL": "1"}, r.text
        sneaked = uuid.UUID(r.json()["id"])

        env = dict(os.environ, **prefect_server.env())
        env.update(PREFECT_HOME=str(tmp_path / "node-home"),
                   PYTHONPATH=str(ROOT))
        with open(tmp_path / "worker.log", "ab") as log:
            worker = subprocess.Popen([sys.executable, "-m", "flows.node_worker", "--pool", pool, "--limit", "1",
                                       "--name", "draftline@probe"], cwd=ROOT, env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        try:
            done = _wait(c, allowed.id, ("COMPLETED", "FAILED", "CRASHED"))
            refused = _wait(c, sneaked, ("COMPLETED", "FAILED", "CRASHED"))
        finally:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(30)
    assert done.state.type.value == "COMPLETED", (tmp_path / "worker.log").read_text()[-3000:]
    assert refused.state.type.value == "CRASHED"
    assert "not allowed by its work pool's template" in refused.state.message and "'EVIL'" in refused.state.message
    assert not planted.exists()
    # exactly one process ran: the allowed run, with its named variable
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        {"VLLM_LOGGING_LEVEL": "INFO", "LD_PRELOAD": None, "EVIL": None}]


def test_the_b300_default_config_submits_only_where_the_operator_allowed_its_repository(prefect_server, monkeypatch):
    """configs/kimi-k2.5-b300.yaml needs its repository's code (target.trust_remote_code: true). A deployment
    runs it only after its operator's `draftline deploy --name b300 --allow-trust-remote-code moonshotai/Kimi-K2.5`
    (the tag it writes is the one registered here): the same deployment still refuses another repository's code,
    and without the opt-in the refusal names the command."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from typer.testing import CliRunner

    from cli.app import app
    from cli.commands import deploy

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PREFECT_API_URL", prefect_server.api_url)
    tag = uuid.uuid4().hex[:6]
    b300 = next(d for d in deploy.load_deployments() if d["name"] == "b300" and deploy.flow_of(d) == "draftline")
    names = {}
    with harness.client(prefect_server) as c:
        pool = f"draftline-rc-{tag}"
        c.create_work_pool(WorkPoolCreate(name=pool, type="process",
                                          base_job_template=json.loads((TEMPLATES / "process.json").read_text())))
        flow_id = c.create_flow_from_name("draftline")
        for opted in (False, True):
            spec = deploy.deploy_spec([json.loads(json.dumps(b300))], None,
                                      ["moonshotai/Kimi-K2.5"] if opted else [])["deployments"][0]
            names[opted] = f"b300-{tag}-{opted}"
            c.create_deployment(flow_id=flow_id, name=names[opted], entrypoint=b300["entrypoint"], tags=spec["tags"],
                                work_pool_name=pool, pull_steps=spec["pull"], parameters=spec["parameters"])
    try:
        refused = CliRunner().invoke(app, ["submit", "configs/kimi-k2.5-b300.yaml", "-d", names[False]])
        assert refused.exit_code == 2, refused.output
        text = " ".join(refused.output.split())
        assert f"which does not allow it" in text and "moonshotai/Kimi-K2.5" in text
        assert f"draftline deploy --name {names[False]} --allow-trust-remote-code moonshotai/Kimi-K2.5" in text
        done = CliRunner().invoke(app, ["submit", "configs/kimi-k2.5-b300.yaml", "-d", names[True], "--json"])
        assert done.exit_code == 0, done.output
        run_id = json.loads(done.output.strip().splitlines()[-1])["id"]
        other = CliRunner().invoke(app, ["submit", "configs/kimi-k2.5-b300.yaml", "-d", names[True],
                                         "--set", "target.model=someone/else"])
        assert other.exit_code == 2 and "(it allows moonshotai/Kimi-K2.5)" in " ".join(other.output.split())
    finally:
        with harness.client(prefect_server) as c:  # no Scheduled run of ours left to shadow another test's `last`
            for n in names.values():
                d = c.read_deployment_by_name(f"draftline/{n}")
                for r in c.read_flow_runs(limit=50):
                    if r.deployment_id == d.id:
                        c.delete_flow_run(r.id)
                c.delete_deployment(d.id)
