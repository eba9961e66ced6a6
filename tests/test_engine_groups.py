"""Extraction over several engine groups for real: the pool a GPU node uses, on CPU cores.

`extract.cpu_groups: 2` runs two engine processes side by side, each pinned to its own core, through
the same `EnginePool` and `engine_for_group` path that runs one engine per GPU group on a GPU node
(a group is GPUs there, cores here). A real `draftline run`: the shards spread over both engines and
come out byte-identical to one engine's. One group's engine SIGKILLed at its second request: only
the shard it was extracting fails, the other engine goes on (and the pool restarts the dead one for
the shards after), and `draftline retry` executes exactly that shard.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest

from tasks.store import Store
from warm import finish, start_draftline

CONFIG = "tests/configs/deploy-small.yaml"

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores for 2 engine groups")


def run(folder: Path, name: str, args: list[str], env: dict | None = None) -> tuple[int, dict, str]:
    p = start_draftline(args, folder, name, env=env, session=True)
    code, out, err = finish(p, folder, name, timeout=600)
    try:
        return code, {**json.loads(out), "pid": p.pid}, err
    except ValueError:
        raise AssertionError(f"{name}: exit {code}, no JSON summary\n{out[-2000:]}\n{err[-4000:]}") from None


def extract_manifests(uri: str) -> dict[int, object]:
    return {m.stats["shard"]: m for m in Store(uri).list("extract")}


def test_two_engine_groups_match_one_and_a_killed_engine_fails_only_its_shard(prefect_server, tmp_path):
    base = ["run", CONFIG, "--until", "extract", "--json", "--set", "extract.batch_tokens=128"]
    one, two = f"file://{tmp_path}/one", f"file://{tmp_path}/two"

    code, s, err = run(tmp_path, "one", [*base, "--set", f"store.uri={one}"])
    assert code == 0, err[-3000:]
    ref = extract_manifests(one)
    assert {m.stats["engine"] for m in ref.values()} == {"extract-cpu"} and len(ref) == 4

    env = {**os.environ, "DRAFTLINE_FAULT_KILL": "engine.extract-cpu1.request:2", "DRAFTLINE_FAULT_ONCE_DIR": str(tmp_path)}
    code, s, err = run(tmp_path, "two", [*base, "--set", f"store.uri={two}", "--set", "extract.cpu_groups=2"], env)
    assert code == 1 and s["state"] == "FAILED", err[-3000:]
    ex = s["stages"]["extract"]
    assert (ex["executed"], ex["failed"]) == (3, 1), ex
    assert "extract-cpu1 died" in ex["error"] and "killed by SIGKILL" in ex["error"], ex["error"]
    assert (tmp_path / "fired-engine.extract-cpu1.request").exists()
    got = extract_manifests(two)
    assert len(got) == 3 and {m.stats["engine"] for m in got.values()} == {"extract-cpu0", "extract-cpu1"}, \
        {k: m.stats["engine"] for k, m in got.items()}  # both engines served shards, the restarted one too
    assert not [p for p in psutil.process_iter(["cmdline"])
                if f"--parent {s['pid']}" in " ".join(p.info["cmdline"] or [])], "an engine outlived its run"

    code, s, err = run(tmp_path, "retry", ["retry", s["flow_run_id"], "--json"])
    assert code == 0 and s["state"] == "COMPLETED", err[-3000:]
    assert (s["stages"]["extract"]["executed"], s["stages"]["extract"]["cached"]) == (1, 3), s["stages"]["extract"]

    got = extract_manifests(two)
    assert sorted(got) == sorted(ref) == [0, 1, 2, 3]
    for shard, m in ref.items():  # same addresses, byte-identical parts: the groups change nothing
        assert got[shard].digest == m.digest
        assert [(f.path, f.sha256) for f in got[shard].files] == [(f.path, f.sha256) for f in m.files], shard
