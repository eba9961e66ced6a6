"""benchmarks/gpu_vllm.sh as a newcomer follows it (issue 47, item 3): each wheel list holds what its steps import,
a failing step stops the script with a non-zero exit, `carry` stops loudly without the environment it needs.

The imports are checked by importing each step's modules in a fresh interpreter that sees only the list's and the
GPU image's packages (tests/support/wheel_lists.py: this environment's files of exactly those distributions, the
CPU build of vLLM standing in for the CUDA one, which cannot load here)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))

import wheel_lists  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "gpu_vllm.sh"
CORE = ROOT / "benchmarks" / "gpu_vllm_core.txt"
FULL = ROOT / "benchmarks" / "gpu_vllm_wheels.txt"
# What the `extract` and `shard` steps import: bench_gpu.py's sections, the stage, the engine child and vLLM's
# connector (loaded by module path in the engine), and the extraction check's norm class (tasks/engine/target.py).
EXTRACT = ["bench_gpu", "gpu_shard", "media", "tasks.extract.stage", "tasks.engine.settings", "tasks.engine.child",
           "tasks.engine.vllm_connector", "tasks.store.artifacts", "speculators.models.eagle3.model_definitions"]
# ... and the steps that run `draftline run`, `draftline export` and `vllm serve` (pipeline, eager, serve, dspark, kimi).
PIPELINE = ["cli.app", "flows.pipeline", "gpu_vllm", "vllm.entrypoints.openai.api_server"]


def _imports(tmp_path: Path, wheel_list: Path, modules: list[str]) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    wheel_lists.view(wheel_list, site)
    return wheel_lists.imports(site, modules)


@pytest.mark.parametrize("wheel_list, modules", [(CORE, EXTRACT), (FULL, EXTRACT + PIPELINE)], ids=["core", "full"])
def test_each_list_holds_what_its_steps_import(tmp_path, wheel_list, modules):
    got = _imports(tmp_path, wheel_list, modules)
    assert got.returncode == 0, f"{wheel_list.name} lacks what its steps import:\n{got.stdout}\n{got.stderr[-2000:]}"


def test_a_list_without_speculators_fails_the_extract_step_and_says_so(tmp_path):
    """The check fails where the device failed (the core list before issue 47 lacked speculators)."""
    short = tmp_path / "core-without-speculators.txt"
    short.write_text("\n".join(line for line in CORE.read_text().splitlines() if not line.startswith("speculators")))
    got = _imports(tmp_path, short, ["tasks.engine.target", "speculators.models.eagle3.model_definitions"])
    assert got.returncode == 1 and "No module named 'speculators'" in got.stdout


def _script(args: list[str], tmp_path: Path, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OUT": str(tmp_path / "out"), "GV_STORE": str(tmp_path / "store"), **env}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, env=full_env,
                          timeout=300)


def test_a_failing_step_stops_the_script_with_a_non_zero_exit(tmp_path):
    # a real failure of bench_gpu.py: the shard step refuses a store in RAM (it measures a disk)
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm here")
    store = shm / f"gv-test-{os.getpid()}"
    path = f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"  # python3 with torch, as on the device
    try:
        got = _script(["shard", "report"], tmp_path, GV_STORE=str(store), PATH=path, GV_SHARD_S="200")
    finally:
        shutil.rmtree(store, ignore_errors=True)
    assert got.returncode != 0, got.stdout
    assert "step shard FAILED" in got.stdout and "rc=1" in got.stdout
    assert "not a disk" in (tmp_path / "out" / "shard.log").read_text()
    assert not (tmp_path / "out" / "gpu_vllm.md").exists()  # `report` did not run
    assert f"where: shard store (GV_STORE) = {store} on tmpfs" in got.stdout


def test_an_unknown_step_exits_non_zero(tmp_path):
    got = _script(["no-such-step"], tmp_path)
    assert got.returncode == 2 and "unknown step no-such-step" in got.stdout


def test_carry_without_the_environment_stops_before_downloading(tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "benchmarks").mkdir(parents=True)
    shutil.copy(SCRIPT, checkout / "benchmarks")
    got = _script(["carry"], tmp_path, cwd=checkout, GV_WHEELS=str(tmp_path / "wheels"))
    assert got.returncode == 1 and "no .venv/bin/python" in got.stdout
    assert not (tmp_path / "wheels").exists() or not any((tmp_path / "wheels").iterdir())


def test_the_prose_names_no_chunk_count_the_script_computes():
    for path in (SCRIPT, CORE, FULL):
        text = path.read_text()
        assert not re.search(r"\b\d+ chunk(s| calls)\b|\(\d+ chunks?\)", text), f"{path.name} states a chunk count"


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


@pytest.mark.parametrize("error_lines", [0, 2])
def test_errors_scans_every_engine_log_and_fails_on_an_error_line(tmp_path, error_lines):
    logs = tmp_path / "home" / "engine-logs"
    logs.mkdir(parents=True)
    (logs / "draftline-extract-0-11.log").write_text(  # a traceback vLLM logs as a warning is a warning
        "INFO 12-06 engine ready\n(pid=1) WARNING 12-06 [base.py:380] Traceback (most recent call last):\n")
    (logs / "draftline-regenerate-0-12.log").write_text(
        "INFO 12-06 start\n" + "ERROR 12-06 [core.py:9] EngineCore failed\n" * error_lines)
    got = _script(["errors"], tmp_path, GV_HOME=str(tmp_path / "home"))
    scan = (tmp_path / "out" / "engine-log-scan.txt").read_text()
    assert "engine logs scanned: 2" in scan and "1 warning line(s)" in scan
    assert f"error lines in all: {error_lines}" in scan
    assert got.returncode == (3 if error_lines else 0), got.stdout
