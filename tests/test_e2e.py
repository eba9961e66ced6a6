"""The whole pipeline through the CLI, as a user runs it: a small config, real vLLM, real Prefect.

One run executes every stage; a second run with the same config reuses every
artifact (nothing executes, no engine starts) and still reports the benchmark
figures, read from the artifact that measured them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SMALL = [
    "data.max_samples=24", "data.num_shards=2", "data.heldout=4", "data.max_length=256",
    "regenerate.max_tokens=24", "vocab.draft_vocab_size=2048",
    "train.max_steps=6", "train.max_minutes=null", "train.batch_tokens=512", "train.checkpoint_every=3",
    "train.warmup_steps=1",
    "benchmark.num_speculative_tokens=[2]", "benchmark.batch_sizes=[4]", "benchmark.max_tokens=16",
    "benchmark.evals=[{name: mtbench, source: {preset: mtbench}, num_prompts: 4}, "
    "{name: heldout, source: heldout, num_prompts: 4}]",
]


def draftline(*args: str, env: dict | None = None, timeout: float = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def small_run(prefect_server, tmp_path_factory):
    store = tmp_path_factory.mktemp("e2e") / "store"
    sets = [f"store.uri=file://{store}", *SMALL]
    args = ["run", "configs/demo.yaml", "--json"] + [x for s in sets for x in ("--set", s)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.time()
    first = draftline(*args, env=env)
    t1 = time.time()
    second = draftline(*args, env=env)
    t2 = time.time()
    return {"store": store, "first": first, "second": second, "t_first": t1 - t0, "t_second": t2 - t1}


def _summary(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR:\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_first_run_executes_every_stage(small_run):
    s = _summary(small_run["first"])
    assert s["state"] == "COMPLETED" and s["flow_run_id"]
    for stage in ("prepare", "regenerate", "vocab", "train", "benchmark"):
        assert s["stages"][stage]["status"] == "ran", (stage, s["stages"][stage])
        assert s["stages"][stage]["artifact"].startswith("file://")
    ext = s["stages"]["extract"]
    assert (ext["executed"], ext["cached"], ext["failed"]) == (2, 0, 0)


@pytest.mark.slow
def test_benchmark_figures_in_json_are_measured_and_shaped(small_run):
    bench = _summary(small_run["first"])["benchmark"]
    assert set(bench) == {"mtbench", "heldout"}
    for name, per_k in bench.items():
        fig = per_k["2"]
        assert 1.0 <= fig["mean_acceptance_length"] <= 3.0
        assert len(fig["per_position_acceptance"]) == 2
        assert fig["output_tokens_per_s"] > 0 and fig["baseline_output_tokens_per_s"] > 0
        assert fig["speedup"] == pytest.approx(fig["output_tokens_per_s"] / fig["baseline_output_tokens_per_s"],
                                               rel=1e-3)


@pytest.mark.slow
def test_second_run_reuses_everything(small_run):
    first, second = _summary(small_run["first"]), _summary(small_run["second"])
    for stage, rec in second["stages"].items():
        assert rec["executed"] == 0, (stage, rec)
        assert rec["status"] in ("cached", "skipped"), (stage, rec)
    assert second["stages"]["extract"]["cached"] == 2
    # the figures come from the artifact that measured them, unchanged
    assert second["benchmark"] == first["benchmark"]
    assert small_run["t_second"] < small_run["t_first"] / 2


@pytest.mark.slow
def test_store_lists_committed_artifacts(small_run):
    out = draftline("ls", "configs/demo.yaml", "--set", f"store.uri=file://{small_run['store']}")
    assert out.returncode == 0, out.stderr
    for stage in ("prepare", "regenerate", "vocab", "extract", "train", "benchmark"):
        assert stage in out.stdout
