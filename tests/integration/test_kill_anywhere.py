"""A run killed at any point never wedges the next one, tried the way it happens.

`draftline run` is killed for real at points across the DAG (tasks/core/faults.py names them): the whole
process group gets SIGKILL, as from a preempted node or the OOM killer. Then the SAME command runs
again and must complete, executing exactly the work the dead run had not committed (the run
summary's counts are checked against what the store held after the kill), with every manifest's
sha256 verifying, no lock of the dead run in the way, no engine of it still running, and its
leftovers found by `draftline gc` as a dead writer's. On a file:// store (with locks) and on the
SeaweedFS S3 store (no locks). Ctrl-C and SIGTERM are sent from outside, as a user or a node
shutdown would.

The runs are chained along the DAG on one store, so each pays only for its own stage: the kill
points come in DAG order, and each resumed run finishes the stage the kill interrupted. The
pass at which an extraction point fires is drawn from a seeded RNG (SEED), the same on both stores.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tasks.store.artifacts import Store
from tasks.store.leases import lock_folder
from warm import finish, start_draftline

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "tests/configs/deploy-small.yaml"
# Engine calls of at most 128 tokens and parts of 256: every shard (~420 tokens) is written in 2-3 parts,
# so a run passes the part points 8-12 times.
TRAIN = ["train.max_steps=6", "train.checkpoint_every=2", "train.batch_tokens=256", "train.max_minutes=null",
         "train.warmup_steps=1", "train.eval_batches=1", "extract.part_tokens=256", "extract.batch_tokens=128"]
BENCH = ["benchmark.num_speculative_tokens=[1]", "benchmark.batch_sizes=[2]", "benchmark.max_tokens=8",
         "benchmark.offline_replay=false", "benchmark.evals=[{name: heldout, source: heldout, num_prompts: 2}]"]
SEED = 16


def args_for(uri: str, until: str | None, *sets: str) -> list[str]:
    out = ["run", CONFIG, "--json", "--set", f"store.uri={uri}"]
    for s in (*TRAIN, *BENCH, *sets):
        out += ["--set", s]
    return out + (["--until", until] if until else [])


def engines_of(pid: int) -> list[str]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if "tasks.engine.process" in cmd and f"--parent {pid}" in cmd:
            found.append(f"{p.pid}: {cmd}")
    return found


def wait_engines_gone(pid: int, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while engines_of(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not engines_of(pid), f"engines of the dead run {pid} still running: {engines_of(pid)}"


def killed_run(args: list[str], point: str, folder: Path, name: str) -> int:
    """`draftline ARGS` in its own session, killed at `point` (tasks/core/faults.py); returns its pid."""
    p = start_draftline(args, folder, name, env={**os.environ, "DRAFTLINE_FAULT_KILL": point}, session=True)
    code, out, err = finish(p, folder, name, timeout=600)
    assert code == -signal.SIGKILL, f"{name}: expected a SIGKILL at {point}, got exit {code}\n{err[-4000:]}"
    wait_engines_gone(p.pid)
    return p.pid


def completed_run(args: list[str], folder: Path, name: str) -> dict:
    p = start_draftline(args, folder, name, session=True)
    t0 = time.monotonic()
    code, out, err = finish(p, folder, name, timeout=600)
    assert code == 0, f"{name}: the resumed run did not complete (exit {code}, {time.monotonic() - t0:.0f} s)\n{err[-5000:]}"
    return json.loads(out)


def counts(summary: dict) -> dict[str, tuple[str, int, int]]:
    return {k: (v["status"], v["executed"], v["cached"]) for k, v in summary["stages"].items()
            if v["status"] != "skipped"}


def committed(store: Store, stage: str) -> set[str]:
    return {m.digest for m in store.list(stage)}


def verify_and_collect(store: Store, dead_pids: set[int]) -> None:
    """Every manifest verifies byte for byte; what is left uncommitted is a dead writer's, which gc
    removes at once; no lock file is left behind."""
    for m in store.list():
        store.open(m.stage, m.digest, checksums=True).verify(checksums=True)
    for g in store.garbage_detail(min_age_s=3600):
        if g["kind"] == "attempt":
            assert g["owner"]["alive"] is False and g["owner"]["pid"] in dead_pids, g
    store.gc(min_age_s=3600)
    assert store.garbage_detail(min_age_s=0) == []
    if store.is_local:
        locks = lock_folder(store)
        assert not locks.exists() or not list(locks.glob("*.lock")), list(locks.glob("*"))


def kill_and_resume(tmp_path: Path, uri: str) -> None:
    store = Store(uri)
    dead: set[int] = set()
    rng = random.Random(SEED)  # the same kill points on every store

    # 1. Killed before the first commit: prepare's files are written, its manifest is not.
    dead.add(killed_run(args_for(uri, "vocab"), "commit.prepare.before-manifest", tmp_path, "k1"))
    assert store.list() == []
    s = completed_run(args_for(uri, "vocab"), tmp_path, "r1")
    assert counts(s) == {"prepare": ("ran", 1, 0), "vocab": ("ran", 1, 0)}, counts(s)

    # 2. Killed mid-shard during extraction: a part of some shard is on the store.
    point = f"extract.part-written:{rng.randint(2, 5)}"
    dead.add(killed_run(args_for(uri, "extract"), point, tmp_path, "k2"))
    done = len(committed(store, "extract"))
    assert done < 4, f"{point}: every shard committed before the kill"
    s = completed_run(args_for(uri, "extract"), tmp_path, "r2")
    assert counts(s) == {"prepare": ("cached", 0, 1), "vocab": ("cached", 0, 1),
                         "extract": ("ran", 4 - done, done)}, (point, done, counts(s))

    # 3. Killed while a part is being written (4 KiB of it on the store); fp8 parts: other shards.
    fp8 = "extract.storage_dtype=fp8"
    dead.add(killed_run(args_for(uri, "extract", fp8), f"store.extract.mid-file:{rng.randint(1, 4)}", tmp_path, "k3"))
    done = len(committed(store, "extract")) - 4
    s = completed_run(args_for(uri, "extract", fp8), tmp_path, "r3")
    assert counts(s)["extract"] == ("ran", 4 - done, done), (done, counts(s))

    # 4. Killed inside the second training checkpoint: one file of it written. The resumed run trains
    # from the first checkpoint (step 2), not from scratch.
    dead.add(killed_run(args_for(uri, "train"), "train.checkpoint-file:2", tmp_path, "k4"))
    assert committed(store, "train") == set()
    s = completed_run(args_for(uri, "train"), tmp_path, "r4")
    assert counts(s) == {"prepare": ("cached", 0, 1), "vocab": ("cached", 0, 1), "extract": ("cached", 0, 4),
                         "train": ("ran", 1, 0)}, counts(s)
    (train,) = store.list("train")
    assert train.stats["resumed_from_step"] == 2 and train.stats["steps"] == 6, train.stats

    verify_and_collect(store, dead)


# The file:// store the chain above left: its train artifact (committed by a resumed run) is where the
# benchmark kill below starts, so that test pays for the benchmark only, not for a second data-and-train run.
_CHAIN_STORE: dict[str, tuple[Path, str]] = {}
# the two tests on one of `make test`'s workers, in this order (the chain above is this process's memory)
CHAIN = pytest.mark.xdist_group("kill-anywhere-chain")


@CHAIN
def test_a_run_killed_anywhere_resumes_exactly_on_a_file_store(prefect_server, tmp_path):
    uri = f"file://{tmp_path}/store"
    kill_and_resume(tmp_path, uri)
    _CHAIN_STORE["file"] = (tmp_path, uri)


@pytest.mark.s3
def test_a_run_killed_anywhere_resumes_exactly_on_s3(prefect_server, s3_server, tmp_path):
    kill_and_resume(tmp_path, f"s3://draftline-test/kill-{uuid.uuid4().hex[:8]}")


def engine_runs(store: Store) -> dict[str, tuple[str, str]]:
    """The benchmark engines committed on the store: name -> (digest, when committed)."""
    return {m.stats["engine"]: (m.digest, m.created) for m in store.list("benchmark-engine")}


@CHAIN
@pytest.mark.slow
def test_a_run_killed_during_the_benchmark_resumes_only_the_benchmark_engines_it_had_not_finished(prefect_server,
                                                                                                  tmp_path):
    """Killed after the baseline and the draft at k=1 were measured (each engine's figures committed as it
    closes), the same command starts only the engine at k=2; the report, made again from the committed engines
    alone, is the same one. On the file store the kill-anywhere chain left (everything up to train committed);
    run alone, a run to train first."""
    folder, uri = _CHAIN_STORE.get("file") or (tmp_path, f"file://{tmp_path}/store")
    store = Store(uri)
    ks = "benchmark.num_speculative_tokens=[1,2]"
    if not committed(store, "train"):
        s = completed_run(args_for(uri, "train"), folder, "warm")
        assert counts(s)["train"] == ("ran", 1, 0)
    assert len(committed(store, "train")) == 1 and not committed(store, "benchmark")
    pid = killed_run(args_for(uri, None, ks), "benchmark.engine-committed:2", folder, "kb")
    assert committed(store, "benchmark") == set()
    before = engine_runs(store)
    assert sorted(before) == ["baseline", "eagle3-k1"], before
    s = completed_run(args_for(uri, None, ks), folder, "rb")
    assert counts(s) == {"prepare": ("cached", 0, 1), "vocab": ("cached", 0, 1), "extract": ("cached", 0, 4),
                         "train": ("cached", 0, 1), "benchmark": ("ran", 1, 0)}, counts(s)
    after = engine_runs(store)
    assert sorted(after) == ["baseline", "eagle3-k1", "eagle3-k2"] and {n: after[n] for n in before} == before
    log = (folder / "rb.log").read_text()
    for name in ("baseline", "eagle3-k1"):
        assert f"benchmark: {name}: reused " in log, log[-3000:]
    assert "benchmark: eagle3-k2: reused" not in log
    (bench,) = store.list("benchmark")
    rep = store.open("benchmark", bench.digest).read_json("report.json")
    assert {n: bool(e.get("reused")) for n, e in rep["engines"].items()} == {
        "baseline": True, "eagle3-k1": True, "eagle3-k2": False}
    verify_and_collect(store, {pid})

    # every engine committed: the benchmark made again starts none and reports the same figures
    import shutil

    shutil.rmtree(Path(uri.removeprefix("file://")) / "benchmark")
    s = completed_run(args_for(uri, None, ks), folder, "again")
    assert counts(s)["benchmark"] == ("ran", 1, 0) and engine_runs(store) == after
    again = store.open("benchmark", bench.digest).read_json("report.json")
    assert all(e.get("reused") for e in again["engines"].values()), again["engines"]

    def same(r: dict) -> dict:  # what was measured, not when the report was assembled
        out = {k: v for k, v in r.items() if k not in ("measured_by", "timing", "engines")}
        out["engines"] = {n: {k: v for k, v in e.items() if k != "reused"} for n, e in r["engines"].items()}
        out["engine_start_s"] = r["timing"]["engine_start_s"]
        return out

    assert same(again) == same(rep)


def _signal_mid_extraction(tmp_path: Path, sig: signal.Signals) -> None:
    """Ctrl-C / SIGTERM from outside while shards are being extracted: the run exits within seconds
    with 128+signal and a message, leaves no process behind, and the same command completes after."""
    uri = f"file://{tmp_path}/store"
    store = Store(uri)
    args = args_for(uri, "extract", "extract.batch_tokens=128")
    p = start_draftline(args, tmp_path, "sig", session=True)
    deadline = time.monotonic() + 300
    while not committed(store, "extract") and time.monotonic() < deadline and p.is_alive():
        time.sleep(0.1)
    assert committed(store, "extract"), (tmp_path / "sig.log").read_text()[-3000:]
    os.kill(p.pid, sig)
    t0 = time.monotonic()
    code, out, err = finish(p, tmp_path, "sig", timeout=60)
    took = time.monotonic() - t0
    assert code == 128 + sig, f"exit {code}\n{err[-3000:]}"
    assert took < 15, f"took {took:.1f} s to stop"
    assert f"stopped by {sig.name}" in err and "run the same command again to resume" in err
    summary = json.loads(out)
    assert summary["state"] == "STOPPED" and summary["stopped_by"] == sig.name
    wait_engines_gone(p.pid, within=3)
    done = len(committed(store, "extract"))
    s = completed_run(args, tmp_path, "after")
    assert counts(s)["extract"] == ("ran", 4 - done, done), (done, counts(s))
    verify_and_collect(store, {p.pid})


def test_ctrl_c_stops_a_run_within_seconds_and_the_next_run_finishes(prefect_server, tmp_path):
    _signal_mid_extraction(tmp_path, signal.SIGINT)


def test_sigterm_stops_a_run_within_seconds_and_the_next_run_finishes(prefect_server, tmp_path):
    _signal_mid_extraction(tmp_path, signal.SIGTERM)


def test_a_fresh_process_after_a_sigkilled_one_reuses_its_shards_and_clears_its_locks(prefect_server, tmp_path):
    """The reported scenario, with real `draftline` processes (no warm fork): the whole process group
    SIGKILLed after the first shard committed; the same command then finishes the other shards.
    Before the fix, the second run waited forever on the dead run's lock files."""
    uri = f"file://{tmp_path}/store"
    store = Store(uri)
    args = args_for(uri, "extract")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "cli.app", *args]
    first = subprocess.Popen(cmd, cwd=ROOT, env={**env, "DRAFTLINE_FAULT_KILL": "commit.extract.before-manifest:2"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _, err = first.communicate(timeout=600)
    assert first.returncode == -signal.SIGKILL, err[-3000:]
    wait_engines_gone(first.pid)
    assert len(committed(store, "extract")) == 1
    locks = sorted(lock_folder(store).glob("*.lock"))
    assert locks, "the killed run held no lock: this test would not show the old hang"
    second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                            start_new_session=True)
    assert second.returncode == 0, second.stderr[-5000:]
    assert counts(json.loads(second.stdout))["extract"] == ("ran", 3, 1)
    assert second.stderr.count("cleared a stale lock") == len(locks)
    assert "is gone" in second.stderr
    verify_and_collect(store, {first.pid})
