"""The config the user edited is the one that runs, and a node runs the commit that was deployed.

`draftline deploy` records its checkout's commit in the release pull step; the node's pull step refuses
another commit of the same version; `draftline submit` sends a config inside the checkout as its path only
when that commit holds the same file, and inlines it otherwise (or refuses `--by-path`, saying why). The
submit tests run against the real Prefect server (the session's `prefect_server`): deployments with the
pull steps `draftline deploy` writes, and the flow run's parameters read back from the server.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

import deploy_harness as harness
from cli.commands import deploy
from flows import release
from cli.prefect_api import RELEASE_STEP
from tasks.core.config_load import load_config

ROOT = Path(__file__).resolve().parents[2]
DEMO = "configs/demo.yaml"


def git(*args: str, stdin: bytes | None = None, env: dict | None = None) -> str:
    import os

    out = subprocess.run(["git", "-C", str(ROOT), *args], input=stdin, capture_output=True, check=True,
                         env={**os.environ, **(env or {})})
    return out.stdout.decode().strip()


def release_with(rel: str, content: bytes, tmp: Path) -> str:
    """A commit object whose copy of REL is CONTENT (the rest: HEAD), the way a release tagged before the
    user's edit holds the file. Only objects are written: no branch, index or working file changes."""
    blob = git("hash-object", "-w", "--stdin", stdin=content)
    index = {"GIT_INDEX_FILE": str(tmp / "index")}
    git("read-tree", "HEAD", env=index)
    git("update-index", "--add", "--cacheinfo", f"100644,{blob},{rel}", env=index)
    tree = git("write-tree", env=index)
    return git("commit-tree", tree, "-p", "HEAD", "-m", "a release whose config differs")


# =========================================================================== the node's pull step

def test_the_pull_step_refuses_another_commit_of_the_same_version(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    head = release.code_commit(ROOT)
    assert head and len(head) == 40
    out = release.use_release(harness.version(), code_dir=str(ROOT), commit=head)
    assert out["commit"] == head
    other = "0" * 40
    with pytest.raises(RuntimeError, match=r"at commit 000000000000 but .* has commit " + head[:12]
                       + r".*same version, other code.*draftline deploy"):
        release.use_release(harness.version(), code_dir=str(ROOT), commit=other)
    # code without git (the worker image): its recorded commit, and none recorded is refused with the fix
    image = tmp_path / "opt-draftline"
    (image / "flows").mkdir(parents=True)
    (image / "flows" / "pipeline.py").write_text("")
    shutil.copy(ROOT / "pyproject.toml", image / "pyproject.toml")
    with pytest.raises(RuntimeError, match=r"says no commit.*--build-arg DRAFTLINE_COMMIT=" + head):
        release.use_release(harness.version(), code_dir=str(image), commit=head)
    (image / release.COMMIT_FILE).write_text(head + "\n")
    assert release.use_release(harness.version(), code_dir=str(image), commit=head)["commit"] == head


def test_deploy_records_this_checkouts_commit_in_the_release_pull_steps():
    deps = deploy.load_deployments()
    spec = deploy.deploy_spec(deps, store=None)
    head = release.code_commit(ROOT)
    pinned = [s[RELEASE_STEP] for d in spec["deployments"] for s in d.get("pull") or [] if RELEASE_STEP in s]
    assert len(pinned) >= 4  # b300 and b300-docker, pipeline and extraction slices
    assert all(p["commit"] == head and p["release"] == harness.version() for p in pinned)
    # the local deployment has no release: it runs the checkout that deployed it
    assert not [d for d in spec["deployments"] if d["name"] == "local" and d.get("pull")]


# =========================================================================== submit, on the real server

@pytest.fixture(scope="module")
def deployments(prefect_server, tmp_path_factory):
    """Deployments of the pipeline flow as `draftline deploy` registers them, by kind of pull step."""
    tmp = tmp_path_factory.mktemp("releases")
    head = release.code_commit(ROOT)
    edited = (ROOT / DEMO).read_bytes().replace(b"max_samples:", b"max_samples: 7 #", 1)
    assert edited != (ROOT / DEMO).read_bytes()
    older = release_with(DEMO, edited, tmp)
    pin = lambda commit: [{RELEASE_STEP: {"release": harness.version(), **({"commit": commit} if commit else {})}}]
    kinds = {"head": pin(head), "older": pin(older), "no-commit": pin(None),
             "folder": [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]}
    suffix = uuid.uuid4().hex[:6]
    names = {}
    with harness.client(prefect_server) as c:
        flow_id = c.create_flow_from_name("draftline")
        for kind, steps in kinds.items():
            name = f"cfg-{kind}-{suffix}"
            c.create_deployment(flow_id=flow_id, name=name, entrypoint="flows/pipeline.py:pipeline",
                                pull_steps=steps, parameters={"config_path": DEMO, "overrides": [], "until": None})
            names[kind] = f"draftline/{name}"
    return names


def submit(prefect_server, monkeypatch, *args: str):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from cli.app import app

    monkeypatch.chdir(ROOT)
    with temporary_settings(updates={PREFECT_API_URL: prefect_server.api_url}):
        return CliRunner().invoke(app, ["submit", *args])


def sent(prefect_server, out) -> tuple[dict, dict]:
    assert out.exit_code == 0, out.output
    info = json.loads(out.output.strip().splitlines()[-1])
    with harness.client(prefect_server) as c:
        run = c.read_flow_run(uuid.UUID(info["id"]))
    return info, run.parameters


def test_an_unchanged_config_travels_as_its_path(deployments, prefect_server, monkeypatch):
    if git("status", "--porcelain", "--", DEMO):
        pytest.skip(f"{DEMO} has uncommitted edits in this checkout")
    for kind in ("head", "folder"):
        info, params = sent(prefect_server, submit(prefect_server, monkeypatch, DEMO, "-d", deployments[kind], "--json"))
        assert params["config_path"] == DEMO and params["overrides"] == [], kind
        assert info["inlined_because"] is None


def test_a_config_that_differs_from_the_releases_copy_is_inlined(deployments, prefect_server, monkeypatch):
    info, params = sent(prefect_server, submit(prefect_server, monkeypatch, DEMO, "-d", deployments["older"],
                                               "--set", "train.max_steps=3", "--json"))
    assert params["config_path"] is None
    assert "differs from its copy in release" in info["inlined_because"] and DEMO in info["inlined_because"]
    # what the node rebuilds from the parameters is the file here, not the release's copy (max_samples 7)
    here = load_config(ROOT / DEMO, ["train.max_steps=3"])
    there = load_config(None, params["overrides"])
    assert there.model_dump(exclude={"store"}) == here.model_dump(exclude={"store"})
    assert there.data.max_samples != 7 and there.train.max_steps == 3
    # the text output says why
    out = submit(prefect_server, monkeypatch, DEMO, "-d", deployments["older"])
    assert out.exit_code == 0 and "sent the config's content" in " ".join(out.output.split()), out.output


def test_by_path_refuses_a_config_the_node_holds_otherwise(deployments, prefect_server, monkeypatch):
    out = submit(prefect_server, monkeypatch, DEMO, "-d", deployments["older"], "--by-path")
    text = " ".join(out.output.split())
    assert out.exit_code == 2 and "differs from its copy in release" in text and "drop --by-path" in text, text
    # a deployment that recorded no commit (registered before this check): the release's copy is unknown
    out = submit(prefect_server, monkeypatch, DEMO, "-d", deployments["no-commit"], "--by-path")
    assert out.exit_code == 2 and "records no commit" in " ".join(out.output.split())
    info, params = sent(prefect_server, submit(prefect_server, monkeypatch, DEMO, "-d", deployments["no-commit"],
                                               "--json"))
    assert params["config_path"] is None and "records no commit" in info["inlined_because"]


def test_a_config_the_release_does_not_have_is_inlined(deployments, prefect_server, monkeypatch, tmp_path):
    scratch = ROOT / ".draftline" / f"test-{uuid.uuid4().hex[:8]}.yaml"  # inside the checkout, never committed
    scratch.parent.mkdir(exist_ok=True)
    scratch.write_text((ROOT / "tests" / "configs" / "deploy-small.yaml").read_text())
    try:
        info, params = sent(prefect_server, submit(prefect_server, monkeypatch, str(scratch.relative_to(ROOT)),
                                                   "-d", deployments["head"], "--json"))
    finally:
        scratch.unlink()
    assert params["config_path"] is None and "which has no such file" in info["inlined_because"]


def test_a_config_whose_base_file_differs_is_inlined(tmp_path):
    """A config that builds on another (`base:`): the worker reads both, so an edit to the base alone also
    sends the content (the worker here is a deployment folder holding the same config on another base)."""
    from cli.prefect_api import config_chain, deployment_config

    here = ROOT / ".draftline" / f"test-{uuid.uuid4().hex[:8]}"  # inside the checkout, never committed
    rel = here.relative_to(ROOT)
    worker = tmp_path / "worker"
    try:
        for folder, base_text in ((here, "data:\n  max_samples: 64\n"), (worker / rel, "data:\n  max_samples: 32\n")):
            folder.mkdir(parents=True)
            (folder / "run.yaml").write_text("base: base.yaml\ntrain:\n  max_steps: 3\n")
            (folder / "base.yaml").write_text(base_text)
        assert config_chain(here / "run.yaml") == [here / "run.yaml", here / "base.yaml"]
        steps = [{"prefect.deployments.steps.set_working_directory": {"directory": str(worker)}}]
        params, _, why = deployment_config(here / "run.yaml", [], None, steps)
        assert params["config_path"] is None and f"{rel.as_posix()}/base.yaml differs" in why
        (worker / rel / "base.yaml").write_text((here / "base.yaml").read_text())  # the same base there: by path
        params, _, why = deployment_config(here / "run.yaml", [], None, steps)
        assert params["config_path"] == f"{rel.as_posix()}/run.yaml" and why is None
        (here / "base.yaml").write_text("base: run.yaml\n")  # a loop ends the chain, it does not hang
        assert config_chain(here / "run.yaml") == [here / "run.yaml", here / "base.yaml"]
    finally:
        shutil.rmtree(here, ignore_errors=True)
