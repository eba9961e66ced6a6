"""Several nodes for one run (issue 18, item 3; issue 24, item 2), with real parts: a Prefect server,
SeaweedFS S3 and two process workers (`prefect worker start --limit 1`) as the nodes of pool
draftline-local.

A run submitted with `extract.nodes=2` (and regeneration on) regenerates one slice of its six shards
on its own node (node A) with a vLLM engine and sends the other slice to node B as a child flow run of
`draftline-extract/local` with `stage: regenerate` (Prefect's run_deployment); then it does the same
with its extraction shards. Node B dies mid-extraction (a drill kill point SIGKILLs its worker's process group,
with the child's flow-run process: the whole node), after one of its three shards is committed.
Nobody on this host tells the server: the heartbeat automation `draftline deploy` created marks the
child Crashed (the workers are named after other hosts, so the same-host pid check cannot help), the
parent sees it and fails naming the two lost shards, `draftline status` shows the child and its
shards, and `draftline retry` extracts exactly the lost shards on the node that is left (summary:
2 ran, 4 cached): the new child for one of them finds no free node, so the parent takes it back.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shlex
import time
import uuid
from pathlib import Path

import pytest

import deploy_harness as harness
from tasks.core.config import StoreConfig
from tasks.store.artifacts import Store
from tasks.store import manifest_index

CRASH_AFTER = 60  # the automation's silence before Crashed (heartbeats every 30 s; the default is 90)
SHARDS = 6  # node A extracts 0, 2, 4; node B 1, 3, 5 and dies after the first of them
ROOT = Path(__file__).resolve().parents[2]
SECTION = "## 10. Several nodes for one run"


def guide_commands() -> list[list[str]]:
    """The commands of docs/DEPLOY.md's section on several nodes, as a user copies them."""
    text = (ROOT / "docs" / "DEPLOY.md").read_text()
    assert SECTION in text, f"docs/DEPLOY.md has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return [argv for block in re.findall(r"```bash\n(.*?)```", section, re.S)
            for argv in map(lambda line: shlex.split(line, comments=True), block.splitlines()) if argv]


def submit_args(submit: list[str]) -> list[str]:
    """The guide's submit with the test's small config in place of configs/demo.yaml (with regeneration on,
    as demo.yaml has it, with short answers)."""
    assert submit[1:3] == ["submit", "configs/demo.yaml"] and "extract.nodes=2" in submit, submit
    return [submit[1], harness.CONFIG, *submit[3:], "--set", f"data.num_shards={SHARDS}",
            "--set", "regenerate.enabled=true", "--set", "regenerate.max_tokens=16"]


def summary_rows(server, run_id: str) -> dict[str, dict]:
    """The newest run-summary table artifact of the run, by stage (what the UI's Artifacts tab shows)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import ArtifactSort

    with harness.client(server) as c:
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["run-summary"])),
                                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(run_id)])),
                                sort=ArtifactSort.CREATED_DESC, limit=1)
    data = arts[0].data
    rows = json.loads(data) if isinstance(data, str) else data
    return {r["stage"]: r for r in rows}


def pool_env(prefect_server, s3_server, tmp_path: Path, prefix: str) -> tuple[str, dict, dict]:
    """A fresh store on SeaweedFS, the nodes' environment (server, S3, DRAFTLINE_STORE_URI) and the
    laptop's (its own Prefect home; no store: the nodes' environment names it)."""
    store_uri = f"s3://draftline-test/{prefix}-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, **prefect_server.env(), **s3_server.env(), DRAFTLINE_STORE_URI=store_uri)
    env.pop("PREFECT_UI_URL", None)
    cli = dict(env, PREFECT_HOME=str(tmp_path / "laptop-home"), COLUMNS="200")
    cli.pop("DRAFTLINE_STORE_URI")
    return store_uri, env, cli


@pytest.mark.slow
@pytest.mark.s3
def newest_index(store: Store, stage: str) -> dict[str, str]:
    """The manifests (digest -> bytes) of the newest index in STAGE's folder (tasks/store/manifest_index.py)."""
    folder = manifest_index.list_folder(store, stage)
    return json.loads(store.fs.cat_file(folder.indexes[0]))["manifests"]


def test_shards_spread_over_two_nodes_and_a_lost_node_costs_only_its_unfinished_shards(
        prefect_server, s3_server, tmp_path):
    t0 = time.time()
    t: dict[str, float] = {}
    store_uri, env, cli = pool_env(prefect_server, s3_server, tmp_path, "nodes")

    # the guide's commands, run as shown (plus: a shorter crash delay, JSON output, the small config)
    deploy, worker_a, worker_b, submit, status_cmd, status_again, retry = guide_commands()
    assert status_again == status_cmd == [".venv/bin/draftline", "status", "last"]
    assert retry == [".venv/bin/draftline", "retry", "last", "--watch"]
    out = harness.draftline(*deploy[1:], "--crash-after", str(CRASH_AFTER), env=cli, timeout=600)
    assert "draftline-extract/local" in out.stdout and "draftline-crash-silent-runs" in out.stdout, out.stdout
    t["deploy"] = time.time() - t0
    # a slice deployment that is not registered: refused here, before a node is taken
    bad = harness.draftline(*submit_args(guide_commands()[3]), "--set", "extract.deployment=nowhere", env=cli,
                            check=False)
    assert bad.returncode == 2 and "draftline-extract/nowhere" in bad.stderr and "draftline deploy --name nowhere" \
        in bad.stderr, bad.stderr
    node_a = harness.Worker(worker_a, tmp_path, env).start()
    # node B is a node that dies at its second shard: after one shard committed, mid-way through the next
    node_b = harness.Worker(worker_b, tmp_path, dict(env, DRAFTLINE_FAULT_KILL="extract.part-written:2"))
    assert (node_a.name, node_b.name) == ("node-a", "node-b")
    try:
        node_a.wait_started()
        sub = json.loads(harness.draftline(*submit_args(submit), "--json", env=cli).stdout.strip().splitlines()[-1])
        run_id = sub["id"]
        harness.wait_state(prefect_server, run_id, ("RUNNING",), timeout=300)
        node_b.start().wait_started()  # the parent holds node A (--limit 1): its child can only go to B
        t["submitted"] = time.time() - t0

        run = harness.wait_state(prefect_server, run_id, ("FAILED", "COMPLETED", "CRASHED"), timeout=600)
        t["attempt1"] = time.time() - t0
        assert node_b.proc.poll() is not None, "node B should have died at its kill point"
        status = json.loads(harness.draftline(*status_cmd[1:], "--json", env=cli).stdout)
        assert status["id"] == run_id and run.state.type.value == "FAILED", status

        # the shards were split over both nodes: 0, 2 and 4 here, 1, 3 and 5 in the child on node B,
        # regeneration's first (then the regenerate artifact assembled here), then extraction's
        assert status["worker"] == "draftline@node-a"
        assert status["stages"]["regenerate"]["states"] == {"Completed": 4}, status["stages"]  # 3 shards + stage
        assert status["stages"]["extract"]["states"] == {"Completed": 3}, status["stages"]
        regen_child, child = status["children"]
        assert regen_child["stage"] == "regenerate" and child["stage"] == "extract", status["children"]
        assert regen_child["worker"] == "draftline@node-b" and regen_child["state"] == "COMPLETED", regen_child
        assert regen_child["shard_states"] == {"1": "Completed", "3": "Completed", "5": "Completed"}, regen_child
        assert child["worker"] == "draftline@node-b" and child["shards"] == [1, 3, 5], child
        # found dead by Prefect's heartbeats (the automation), not by anything on this host
        assert child["state"] == "CRASHED" and "no heartbeat" in child["message"], child
        assert "draftline-crash-silent-runs" in child["message"]
        with harness.client(prefect_server) as c:
            child_run = c.read_flow_run(uuid.UUID(child["id"]))
            parent_states = [x.type.value for x in c.read_flow_run_states(uuid.UUID(run_id))]
        # its flow-run process died with the node
        harness.gone(int(str(child_run.infrastructure_pid).rsplit(":", 1)[-1]), timeout=5)
        assert "CRASHED" not in parent_states, parent_states  # the living parent kept its heartbeats
        done_b = [int(s) for s, st in child["shard_states"].items() if st == "Completed"]
        lost = sorted({1, 3, 5} - set(done_b))
        assert len(done_b) == 1 and len(lost) == 2, child["shard_states"]
        store = Store.from_config(StoreConfig(uri=store_uri))
        assert sorted(m.stats["shard"] for m in store.list("extract")) == sorted(set(range(SHARDS)) - set(lost))
        assert sorted(m.stats["shard"] for m in store.list("regenerate-shard")) == list(range(SHARDS))
        # the stage's end indexed what it found (the next listing reads them in one GET), lost shards or not
        assert sorted(newest_index(store, "extract")) == sorted(m.digest for m in store.list("extract"))
        assert len(newest_index(store, "regenerate-shard")) == SHARDS
        (regen,) = store.list("regenerate")
        assert regen.stats["num_shards"] == SHARDS and regen.stats["samples"] > 0, regen.stats
        assert f"shards {lost}" in status["message"] and "draftline retry" in status["message"], status["message"]
        text = harness.draftline(*status_cmd[1:], env=cli).stdout
        assert "child runs" in text and child["name"] in text and "draftline@node-b" in text, text
        assert f"{child['name']}: no heartbeat for {CRASH_AFTER} s" in text, text

        # the retry: any node of the pool extracts exactly the two lost shards. They are dealt into two
        # slices, but the pool has no free node for the child (B is dead, A runs the parent): no node takes
        # it, so the parent cancels it and extracts its shard itself instead of waiting forever.
        t_retry = dt.datetime.now(dt.timezone.utc)
        out = harness.draftline(*retry[1:], "--timeout", "600", env=cli, timeout=700)
        assert f"retrying {status['name']}" in out.stdout, out.stdout
        t["retry"] = time.time() - t0
        rows = summary_rows(prefect_server, run_id)
        assert (rows["extract"]["status"], rows["extract"]["ran"], rows["extract"]["cached"],
                rows["extract"]["failed"]) == ("ran", 2, SHARDS - 2, 0), rows
        assert (rows["prepare"]["status"], rows["regenerate"]["status"], rows["vocab"]["status"]) == \
            ("cached", "cached", "cached"), rows
        done = json.loads(harness.draftline("status", run_id, "--json", env=cli).stdout)
        assert done["state"] == "COMPLETED" and done["run_count"] == 2 and done["worker"] == "draftline@node-a"
        regen_again, crashed, taken_back = done["children"]
        assert regen_again["id"] == regen_child["id"], done["children"]  # regeneration made no new child
        assert crashed["id"] == child["id"] and taken_back["shards"] == lost[1:], done["children"]
        assert taken_back["state"] == "CANCELLED" and "no node took it" in taken_back["message"], taken_back
        assert taken_back["shard_states"] == {} and taken_back["worker"] is None, taken_back  # it never ran
        ran = {t_["name"] for t_ in done["tasks"] if t_["state"] == "Completed" and t_["name"].startswith("extract")}
        # the lost shards, then the extract stage's artifact (a task named extract) from all of them
        assert ran == {f"extract-shard-{s}" for s in lost} | {"extract"}, done["tasks"]
        shards = {m.stats["shard"]: m for m in store.list("extract")}
        assert sorted(shards) == list(range(SHARDS))
        assert {d: json.loads(raw)["stats"]["shard"] for d, raw in newest_index(store, "extract").items()} == \
            {m.digest: s for s, m in shards.items()}
        for s, m in shards.items():
            store.open("extract", m.digest).verify(checksums=True)
            assert (m.created >= t_retry.isoformat()[:19]) == (s in lost), (s, m.created)
    finally:
        node_a.stop()
        node_b.stop()
        print("timings (s):", {k: round(v, 1) for k, v in t.items()}, "total", round(time.time() - t0, 1))


def test_nodes_and_deployment_are_scheduling_keys_that_change_no_address():
    from tasks.address import digests as digest
    from tasks.core.config_load import load_config

    one = load_config(harness.CONFIG)
    many = load_config(harness.CONFIG, ["extract.nodes=8", "extract.deployment=draftline-extract/b300"])
    assert digest.extract_shard(one, [2, 15, 27, 30], "d" * 64, 3) == \
        digest.extract_shard(many, [2, 15, 27, 30], "d" * 64, 3)


def test_missing_shards_are_dealt_round_robin_into_at_most_one_slice_per_node():
    from flows.shard_nodes import slice_shards

    assert slice_shards([0, 1, 2, 3], 2) == [[0, 2], [1, 3]]
    assert slice_shards([3], 2) == [[3]]  # one shard left: no child run, the run's own node takes it
    assert slice_shards([], 4) == []
    assert slice_shards([1, 4, 5], 8) == [[1], [4], [5]]


def test_a_local_run_with_several_nodes_says_which_deployment_to_name():
    from flows.nodes import child_deployment
    from tasks.core.config_load import load_config

    with pytest.raises(RuntimeError, match=r"not a deployment run: set extract.deployment.*draftline deploy"):
        child_deployment(load_config(harness.CONFIG, ["extract.nodes=2"]))
    assert child_deployment(load_config(harness.CONFIG, ["extract.nodes=2", "extract.deployment=b300"])) == \
        "draftline-extract/b300"


def test_deploy_refuses_a_crash_delay_shorter_than_two_heartbeats():
    env = dict(os.environ, PREFECT_API_URL="http://127.0.0.1:9/api")
    out = harness.draftline("deploy", "--name", "local", "--crash-after", "30", env=env, check=False)
    assert out.returncode == 2 and "--crash-after 30" in out.stderr and "at least 60" in out.stderr, out.stderr


def test_the_take_back_delay_is_a_setting_with_a_clear_error(monkeypatch):
    from flows.nodes import TAKE_BACK_AFTER, TAKE_BACK_ENV, take_back_after

    monkeypatch.delenv(TAKE_BACK_ENV, raising=False)
    assert take_back_after() == TAKE_BACK_AFTER == 30
    monkeypatch.setenv(TAKE_BACK_ENV, "7.5")
    assert take_back_after() == 7.5
    for bad in ("soon", "0"):
        monkeypatch.setenv(TAKE_BACK_ENV, bad)
        with pytest.raises(ValueError, match=rf"DRAFTLINE_TAKE_BACK_S='{bad}': give"):
            take_back_after()


def test_children_get_the_runs_config_even_from_a_file_only_the_parent_has(tmp_path):
    """A config outside the code folder (a laptop's file, `draftline run` sending slices to a pool) reaches
    the children as its content; one inside travels as its path, which every node's code folder has."""
    from flows.nodes import child_config
    from flows.run_record import RunRecord
    from tasks.core.config_load import load_config

    mine = tmp_path / "mine.yaml"
    mine.write_text((ROOT / harness.CONFIG).read_text().replace("heldout: 4", "heldout: 3"))
    sets = ["extract.nodes=2", "extract.deployment=local"]
    sent = child_config(RunRecord(config_path=str(mine), overrides=sets))
    assert sent["config_path"] is None
    assert load_config(None, sent["overrides"]).model_dump() == load_config(mine, sets).model_dump()
    assert child_config(RunRecord(config_path=harness.CONFIG, overrides=sets)) == \
        {"config_path": harness.CONFIG, "overrides": sets}
