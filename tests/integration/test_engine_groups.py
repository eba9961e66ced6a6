"""Regeneration and extraction over several engine groups for real: the pool a GPU node uses, on CPU cores.

`extract.cpu_groups: 2` runs two engine processes side by side, each pinned to its own core, through
the same `EnginePool` and `engine_for_group` path that runs one engine per GPU group on a GPU node
(a group is GPUs there, cores here), for both stages that run engines over shards: regeneration (vLLM
decoding engines, `regenerate-cpuN`) and extraction (`extract-cpuN`). A real `draftline run`: the shards
of both stages spread over both engines and come out byte-identical to one engine's. One group's
engine SIGKILLed: only the shard it was serving fails, the other engine goes on (and the pool restarts
the dead one for the shards after), and `draftline retry` executes exactly that shard, first in
regeneration, then (a kill in the retry) in extraction.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.conftest import amx_variant_kernels
from tasks.store.artifacts import Store
from warm import finish, start_draftline

CONFIG = "tests/configs/deploy-small.yaml"

two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores for 2 engine groups")


def run(folder: Path, name: str, args: list[str], env: dict | None = None) -> tuple[int, dict, str]:
    p = start_draftline(args, folder, name, env=env, session=True)
    code, out, err = finish(p, folder, name, timeout=900)
    try:
        return code, {**json.loads(out), "pid": p.pid}, err
    except ValueError:
        raise AssertionError(f"{name}: exit {code}, no JSON summary\n{out[-2000:]}\n{err[-4000:]}") from None


def manifests(uri: str, stage: str) -> dict[int, object]:
    return {m.stats["shard"]: m for m in Store(uri).list(stage)}


def same_bytes(got: dict[int, object], ref: dict[int, object]) -> None:
    assert sorted(got) == sorted(ref) == [0, 1, 2, 3]
    for shard, m in ref.items():  # same addresses, byte-identical files: the groups change nothing
        assert got[shard].digest == m.digest
        assert [(f.path, f.sha256) for f in got[shard].files] == [(f.path, f.sha256) for f in m.files], shard


def no_engine_left(pid: int) -> None:
    assert not [p for p in psutil.process_iter(["cmdline"])
                if f"--parent {pid}" in " ".join(p.info["cmdline"] or [])], "an engine outlived its run"


def progress_artifacts(run_id: str, key: str) -> list[tuple[float, str]]:
    """(percent, description) of the run's progress artifacts named KEY (one per attempt), as the UI lists them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterType, FlowRunFilter, FlowRunFilterId

    deadline = time.time() + 30  # what a run published reaches the API's listing a moment later under load
    while True:
        with get_client(sync_client=True) as c:
            arts = c.read_artifacts(artifact_filter=ArtifactFilter(type=ArtifactFilterType(any_=["progress"])),
                                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(run_id)])))
        found = [(float(a.data), a.description or "") for a in arts if a.key == key]
        if found or time.time() > deadline:
            return found
        time.sleep(2)


@two_cores
@pytest.mark.slow
@amx_variant_kernels
def test_two_engine_groups_match_one_and_a_killed_engine_fails_only_its_shard(prefect_server, tmp_path):
    base = ["run", CONFIG, "--until", "extract", "--json", "--set", "extract.batch_tokens=128",
            "--set", "regenerate.enabled=true", "--set", "regenerate.max_tokens=24"]
    one, two = f"file://{tmp_path}/one", f"file://{tmp_path}/two"
    once = {"DRAFTLINE_FAULT_ONCE_DIR": str(tmp_path)}

    code, s, err = run(tmp_path, "one", [*base, "--set", f"store.uri={one}"])
    assert code == 0, err[-3000:]
    ref_regen, ref = manifests(one, "regenerate-shard"), manifests(one, "extract")
    assert {m.stats["engine"] for m in ref_regen.values()} == {"regenerate-cpu"} and len(ref_regen) == 4
    assert {m.stats["engine"] for m in ref.values()} == {"extract-cpu"} and len(ref) == 4

    # regeneration over two groups; the engine of group 1 dies at its first request (a shard's only one)
    env = {**os.environ, **once, "DRAFTLINE_FAULT_KILL": "engine.regenerate-cpu1.request:1"}
    code, s, err = run(tmp_path, "two", [*base, "--set", f"store.uri={two}", "--set", "extract.cpu_groups=2"], env)
    assert code == 1 and s["state"] == "FAILED", err[-3000:]
    rg = s["stages"]["regenerate"]
    assert (rg["status"], rg["executed"], rg["failed"]) == ("partial", 3, 1), rg
    assert "regenerate-cpu1 died" in rg["error"] and "killed by SIGKILL" in rg["error"], rg["error"]
    assert s["stages"]["extract"]["status"] == "pending", s["stages"]
    got = manifests(two, "regenerate-shard")
    # the other group's engine went on serving; whether group 1's restarted engine took one of the remaining shards
    # depends on its start time against group 0's pace (the pool hands a shard to the first free engine)
    engines = {m.stats["engine"] for m in got.values()}
    assert len(got) == 3 and "regenerate-cpu0" in engines and engines <= {"regenerate-cpu0", "regenerate-cpu1"}, \
        {k: m.stats["engine"] for k, m in got.items()}
    assert Store(two).list("regenerate") == []  # no stage artifact from 3 of 4 shards
    no_engine_left(s["pid"])
    run_id = s["flow_run_id"]

    # the retry regenerates exactly the failed shard; this time an extraction engine dies
    env = {**os.environ, **once, "DRAFTLINE_FAULT_KILL": "engine.extract-cpu1.request:2"}
    code, s, err = run(tmp_path, "retry", ["retry", run_id, "--json"], env)
    assert code == 1 and s["state"] == "FAILED", err[-3000:]
    rg = s["stages"]["regenerate"]
    assert (rg["status"], rg["executed"], rg["cached"], rg["failed"]) == ("ran", 1, 3, 0), rg
    assert rg["stats"]["shards"] == 4 and rg["stats"]["samples"] > 0, rg  # the stage's figures beside the counts
    ex = s["stages"]["extract"]
    assert (ex["executed"], ex["failed"]) == (3, 1), ex
    assert "extract-cpu1 died" in ex["error"] and "killed by SIGKILL" in ex["error"], ex["error"]
    assert (tmp_path / "fired-engine.regenerate-cpu1.request").exists()
    assert (tmp_path / "fired-engine.extract-cpu1.request").exists()
    got = manifests(two, "extract")
    assert len(got) == 3 and {m.stats["engine"] for m in got.values()} == {"extract-cpu0", "extract-cpu1"}, \
        {k: m.stats["engine"] for k, m in got.items()}
    no_engine_left(s["pid"])
    # the UI's progress of regeneration: the first run's with its failed shard, the retry's (a new local run)
    shown = progress_artifacts(run_id, "regenerate-progress")
    assert [d.split(",")[:2] for _, d in shown] == [["Regeneration: 4/4 shards", " 1 failed"]], shown
    shown = progress_artifacts(s["flow_run_id"], "regenerate-progress")
    assert len(shown) == 1 and shown[0][0] == 100.0 and shown[0][1].startswith("Regeneration: 4/4 shards, 0 failed") \
        and "generated tok/s" in shown[0][1], shown

    code, s, err = run(tmp_path, "retry2", ["retry", run_id, "--json"])
    assert code == 0 and s["state"] == "COMPLETED", err[-3000:]
    assert s["stages"]["regenerate"]["status"] == "cached", s["stages"]["regenerate"]
    assert (s["stages"]["extract"]["executed"], s["stages"]["extract"]["cached"]) == (1, 3), s["stages"]["extract"]

    same_bytes(manifests(two, "regenerate-shard"), ref_regen)
    same_bytes(manifests(two, "extract"), ref)
    (r1,), (r2,) = Store(one).list("regenerate"), Store(two).list("regenerate")
    assert r1.digest == r2.digest and [(f.path, f.sha256) for f in r1.files] == [(f.path, f.sha256) for f in r2.files]


def test_a_regeneration_engine_sees_only_its_group(tmp_path):
    """The decision a GPU node makes (no GPU here to run it): a regeneration engine of a GPU group gets
    that group's CUDA_VISIBLE_DEVICES and the group's tensor-parallel size, one of a core group its cores;
    a decoding engine is vLLM without extraction settings whatever extract.backend says."""
    from tasks.core.config import RunConfig
    from tasks.engine.settings import EngineGroup, engine_for_group
    from train_data import make_tiny_target

    model = make_tiny_target(tmp_path / "llama")
    cfg = RunConfig.model_validate({"target": {"model": model, "dtype": "bfloat16"},
                                    "extract": {"backend": "transformers", "tensor_parallel_size": 2}})
    gpu = engine_for_group(cfg, model, [2, 3], "regenerate")
    assert (gpu.name, gpu.kind, gpu.env["CUDA_VISIBLE_DEVICES"]) == ("regenerate-gpu2-3", "vllm", "2,3")
    assert gpu.llm_kwargs["tensor_parallel_size"] == 2 and gpu.llm_kwargs["dtype"] == "bfloat16"
    assert "speculative_config" not in gpu.llm_kwargs and "kv_transfer_config" not in gpu.llm_kwargs
    cpu = engine_for_group(cfg, model, EngineGroup(cpus=(1,)), "regenerate")
    assert (cpu.name, cpu.env["CUDA_VISIBLE_DEVICES"], cpu.env["DRAFTLINE_ENGINE_CPUS"]) == ("regenerate-cpu1", "", "1")
    with pytest.raises(ValueError, match="purpose 'train'"):
        engine_for_group(cfg, model, [], "train")
