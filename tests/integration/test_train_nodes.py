"""Training over several nodes (issue 28, item 3): `train.nodes=2` with real parts: a Prefect server,
SeaweedFS S3 and two process workers (`prefect worker start --limit 1`) as the nodes of pool
draftline-local, each with its own part cache folder.

The run (on node A) extracts with the transformers backend on the tiny target of tests/integration/test_train_ranks.py,
then trains: one gloo rank on its own node and one on node B, a child flow run of `draftline-extract/local`
with `stage: train`, joined through one c10d rendezvous hosted by node A. Node B dies mid-training (the
test SIGKILLs its worker's process group, with the child's flow-run process, once a checkpoint is on the
store): the train task fails naming node B; `draftline retry` resumes from the newest checkpoint on the one
node left (the child it sends finds no free node and is cancelled) and commits the draft once.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import signal
import time
from pathlib import Path

import pytest

import deploy_harness as harness
from tasks.core.config import StoreConfig
from tasks.store.artifacts import Store
from tests.integration.test_nodes import ROOT, guide_commands, pool_env, summary_rows
from tests.integration.test_train_ranks import project  # noqa: F401  (the tiny target, its data and config)


def guide_section_commands() -> list[list[str]]:
    """The commands of docs/DEPLOY.md's section on training over several nodes, as a user copies them."""
    text = (ROOT / "docs" / "DEPLOY.md").read_text()
    section = text.split("## 11. Training over several nodes", 1)[1].split("\n## ", 1)[0]
    return [shlex.split(line, comments=True) for block in re.findall(r"```bash\n(.*?)```", section, re.S)
            for line in block.splitlines() if line.strip()]


def test_the_run_node_holds_rank_0_and_every_rank_is_dealt_once():
    from tasks.train.ranks import host_first_rank

    for nodes, local_world in itertools.product((1, 2, 3, 4), (1, 2, 8)):
        for host in range(nodes):
            ranks = [host_first_rank(g, host, nodes, r, local_world) for g in range(nodes) for r in range(local_world)]
            assert sorted(ranks) == list(range(nodes * local_world)), (nodes, local_world, host)
            # the run's node (torch's rendezvous may give it any group rank) holds ranks 0..local_world-1
            assert [host_first_rank(host, host, nodes, r, local_world) for r in range(local_world)] == \
                list(range(local_world))
    with pytest.raises(ValueError):
        host_first_rank(2, 0, 2, 0, 1)


def test_each_node_reads_only_its_ranks_share_and_the_deal_follows_the_world_size():
    from tasks.train.ranks import host_first_rank
    from tasks.train.stream import deal

    parts, seed = 23, 7
    for nodes, local_world in ((2, 1), (2, 4), (3, 2)):
        world = nodes * local_world
        shares = deal(parts, seed, world)
        per_node = [sorted(p for r in range(local_world) for p in shares[host_first_rank(g, 0, nodes, r, local_world)])
                    for g in range(nodes)]
        assert sorted(p for share in per_node for p in share) == list(range(parts))  # each part on one node
        assert max(map(len, per_node)) - min(map(len, per_node)) <= local_world
    assert deal(parts, seed, 2) != deal(parts, seed, 1) * 2  # one node left: its one rank reads every part
    assert deal(parts, seed, 1) == [list(range(parts))]


def test_train_nodes_is_scheduling_not_part_of_the_address():
    from tasks.address import digests as digest
    from tasks.core.config_load import load_config

    one = load_config(harness.CONFIG)
    two = load_config(harness.CONFIG, ["train.nodes=2"])
    assert digest.train(one, _ref("vocab"), [_ref("extract")]) == digest.train(two, _ref("vocab"), [_ref("extract")])


def test_a_child_node_computes_its_train_address_and_refuses_another():
    """A child node's train address is its own resolution's (its config on the store), not taken from the run's
    parameters: one that differs (another version, or a path planted in the parameters) stops the node before
    any rank; the address the parent sent picks the head among several."""
    from flows.train_nodes import child_train_address
    from tasks.store.resolve import Address, Resolution
    from tasks.train import TrainError

    heads = [Address("train", "train", "e" * 64, "eagle3"), Address("train", "train", "d" * 64, "dflash")]
    found = Resolution(addresses={"train": heads})
    assert child_train_address(found, {"digest": "e" * 64}) is heads[0]
    assert child_train_address(found, {"digest": "d" * 64}) is heads[1]
    assert child_train_address(found, {}) is heads[0]  # an older parent sends none
    for sent in ("0" * 32, "../../../home/someone/.ssh"):
        with pytest.raises(TrainError, match=r"this node computes .* different draftline versions .* Fix: install"):
            child_train_address(found, {"digest": sent})


def _ref(stage: str):
    from tasks.store.artifacts import ArtifactRef

    return ArtifactRef(stage=stage, digest=stage[0] * 64, uri=f"file:///x/{stage}", stats={"shard": 0})


@pytest.mark.slow
@pytest.mark.s3
def test_training_over_two_nodes_names_a_lost_node_and_the_retry_resumes_on_the_node_left(
        prefect_server, s3_server, project, tmp_path):  # noqa: F811
    t0 = time.time()
    t: dict[str, float] = {}
    store_uri, env, cli = pool_env(prefect_server, s3_server, tmp_path, "trainnodes")
    deploy, worker_a, worker_b, *_ = guide_commands()
    harness.draftline(*deploy[1:], "--crash-after", "60", env=cli, timeout=600)
    caches = {n: tmp_path / f"cache-{n}" for n in "ab"}
    node_a = harness.Worker(worker_a, tmp_path, dict(env, DRAFTLINE_CACHE_DIR=str(caches["a"]))).start()
    node_b = harness.Worker(worker_b, tmp_path, dict(env, DRAFTLINE_CACHE_DIR=str(caches["b"])))
    store = Store.from_config(StoreConfig(uri=store_uri))
    try:
        node_a.wait_started()
        (submit,) = guide_section_commands()  # the guide's, with the test's tiny config and longer training
        assert submit[1:3] == ["submit", "configs/demo.yaml"] and "train.nodes=2" in submit, submit
        sub = json.loads(harness.draftline(
            submit[1], str(project.config), *submit[3:], "--json",
            "--set", "train.max_steps=300", "--set", "train.checkpoint_every=10",
            env=cli).stdout.strip().splitlines()[-1])
        run_id = sub["id"]
        harness.wait_state(prefect_server, run_id, ("RUNNING",), timeout=300)
        node_b.start().wait_started()  # the parent holds node A (--limit 1): its child can only go to B

        # node B dies once training has written a checkpoint
        deadline = time.time() + 600
        while not store.list("checkpoint"):
            assert time.time() < deadline, "no checkpoint after 600 s:\n" + node_a.read_log()[-4000:]
            assert node_b.proc.poll() is None and not store.list("train"), node_b.read_log()[-4000:]
            time.sleep(0.2)
        os.killpg(node_b.proc.pid, signal.SIGKILL)
        t["killed"] = time.time() - t0
        run = harness.wait_state(prefect_server, run_id, ("FAILED", "COMPLETED", "CRASHED"), timeout=300)
        t["attempt1"] = time.time() - t0
        assert run.state.type.value == "FAILED", run.state
        status = json.loads(harness.draftline("status", run_id, "--json", env=cli).stdout)
        (child,) = status["children"]
        assert child["stage"] == "train" and child["worker"] == "draftline@node-b", child
        # the train task failed naming the lost node: its worker and its child run
        assert "training node lost: draftline@node-b" in status["message"], status["message"]
        assert child["name"] in status["message"] and "draftline retry" in status["message"]
        assert not store.list("train")
        steps = sorted(int(m.digest.rsplit("-s", 1)[1]) for m in store.list("checkpoint"))
        print("attempt 1:", status["message"].splitlines()[0], "| checkpoints:", steps)
        # each node read its rank's share of the parts through its own cache; both read the last part, whose
        # tail is the held-out set every rank evaluates on
        cached = {n: {p.name for p in (c / "data").rglob("*") if p.is_file()} for n, c in caches.items()}
        assert cached["a"] - cached["b"] and cached["b"] - cached["a"] and len(cached["a"] & cached["b"]) <= 1, cached

        out = harness.draftline("retry", run_id, "--watch", "--timeout", "600", env=cli, timeout=700)
        t["retry"] = time.time() - t0
        assert f"retrying {status['name']}" in out.stdout, out.stdout
        done = json.loads(harness.draftline("status", run_id, "--json", env=cli).stdout)
        assert done["state"] == "COMPLETED" and done["run_count"] == 2, done
        rows = summary_rows(prefect_server, run_id)
        assert rows["train"]["status"] == "ran" and rows["extract"]["status"] == "cached", rows
        (draft,) = store.list("train")  # committed once
        assert draft.stats["resumed_from_step"] == steps[-1] and draft.stats["world_size"] == 1, draft.stats
        assert draft.stats["steps"] == 300, draft.stats
        print("retry:", {k: draft.stats[k] for k in ("resumed_from_step", "world_size", "steps")})
        store.open("train", draft.digest).verify(checksums=True)
        # the retry's child found no free node: cancelled, and the run trained on the node there was
        retry_child = [c for c in done["children"] if c["id"] != child["id"]]
        assert [c["state"] for c in retry_child] == ["CANCELLED"], done["children"]
    finally:
        node_a.stop()
        node_b.stop()
        print("timings (s):", {k: round(v, 1) for k, v in t.items()}, "total", round(time.time() - t0, 1))


def _listening(port: int) -> list[str]:
    """The local addresses listening on PORT (from /proc/net/tcp and tcp6)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                out.append(addr)
    return out


def test_the_training_stores_listen_on_the_nodes_address_only_under_a_secret_id(monkeypatch):
    """torch's TCPStore listens on every interface whatever host it is given, with no authentication, and
    the c10d rendezvous unpickles what its store holds: ours listen on the address the nodes use (one
    node: the loopback), and the keys hang under a run id nobody can guess (not shown in logs)."""
    import socket

    from tasks.train.ranks import Rendezvous, _bound_store_server, listening_store, secret_run_id

    plain = __import__("torch").distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert _listening(plain.port) in (["00000000"], ["00000000000000000000000000000000"])  # torch's: everywhere
    ours = listening_store("127.0.0.1")
    assert _listening(ours.port) == ["0100007F"]  # 127.0.0.1 only
    workers = _bound_store_server(None, "127.0.0.1", 0)
    assert _listening(workers.port) == ["0100007F"]
    spec = Rendezvous(endpoint="", control=f"127.0.0.1:{ours.port}", run_id=secret_run_id("d" * 32))
    client = spec.store(timeout=10)
    client.set(f"{spec.run_id}/nodes", "2")
    assert ours.get(f"{spec.run_id}/nodes") == b"2"
    secret = spec.run_id.rsplit("-", 1)[1]
    assert len(secret) == 32 and secret not in spec.label and spec.label.startswith("draftline-dddddddddddd-")
    assert secret_run_id("d" * 32) != spec.run_id
    try:  # another interface of this host, if it has one: nothing answers there
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.connect(("10.255.255.255", 1))
            other = udp.getsockname()[0]
    except OSError:
        other = "127.0.0.1"
    if not other.startswith("127."):
        with pytest.raises(OSError):
            socket.create_connection((other, ours.port), timeout=2)
        socket.create_connection((other, plain.port), timeout=2).close()  # (where torch's own does answer)
