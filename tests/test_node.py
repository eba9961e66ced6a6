"""A node that says the truth: `draftline doctor`'s driver, GPU, disk and pool checks, and the worker image's
own checks (infra/Dockerfile) run against this tree.

This machine has no GPU: the driver decision is tested with a stand-in `nvidia-smi` on PATH (a driver that is
too old, one that is new enough, one that does not answer: faults that cannot be caused for real here), and
the real machine must report that it has no GPU.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows import doctor

ROOT = Path(__file__).resolve().parents[1]


def fake_smi(folder: Path, rows: list[str], rc: int = 0, said: str = "") -> None:
    """An `nvidia-smi` that answers doctor's query with ROWS (index, name, memory, driver), or fails."""
    folder.mkdir(parents=True, exist_ok=True)
    body = "\n".join(rows)
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\n[ $# -gt 0 ] || exit 2\ncat <<'EOF'\n{said or body}\nEOF\nexit {rc}\n")
    script.chmod(0o755)


def node(n: int, driver: str) -> list[str]:
    return [f"{i}, NVIDIA B300 SXM6, 274877 MiB, {driver}" for i in range(n)]


def doctor_json(args: list[str], tmp_path: Path, monkeypatch, path_first: Path | None = None) -> tuple[int, dict]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.cli import app

    monkeypatch.chdir(tmp_path)  # the default store is file://.draftline/store, here
    monkeypatch.setenv("DRAFTLINE_HOME", str(tmp_path / "cache"))
    if path_first is not None:
        monkeypatch.setenv("PATH", f"{path_first}:{os.environ['PATH']}")
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        out = CliRunner().invoke(app, ["doctor", "--json", *args])
    return out.exit_code, {c["name"]: c for c in json.loads(out.output)["checks"]}


def test_a_cpu_machine_says_it_has_no_gpu_and_every_check_is_in_the_json(tmp_path, monkeypatch):
    assert shutil.which("nvidia-smi") is None, "this test is for a machine without the NVIDIA driver"
    rc, checks = doctor_json([], tmp_path, monkeypatch)
    assert rc == 0, checks
    assert checks["driver"]["status"] == "ok" and checks["driver"]["detail"].startswith("no GPU")
    assert "+cpu" in checks["driver"]["detail"]
    assert checks["gpus"]["status"] == "ok" and checks["gpus"]["detail"].startswith("no GPU")
    for name in ("python", "torch", "vllm", "driver", "gpus", "disk: draftline cache", "disk: hf cache", "disk: temp",
                 "store", "prefect api"):
        assert name in checks, name
    assert str(tmp_path / "cache") in checks["disk: draftline cache"]["detail"]
    # the GPU set on this machine: no driver where the lock's torch needs CUDA 13, and the fix
    rc, checks = doctor_json(["--flavor", "gpu"], tmp_path, monkeypatch)
    assert rc == 1
    assert checks["driver"]["status"] == "fail" and "nvidia-smi not found" in checks["driver"]["detail"]
    assert "CUDA 13.0" in checks["driver"]["detail"] and "R580" in checks["driver"]["fix"]


def test_a_pool_check_that_cannot_run_fails_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    rc, checks = doctor_json(["--pool", "draftline-b300"], tmp_path, monkeypatch)
    assert rc == 1
    pool = checks["pool draftline-b300"]
    assert pool["status"] == "fail" and "PREFECT_API_URL is not set" in pool["detail"]
    assert "export PREFECT_API_URL=" in pool["fix"]
    # a server that does not answer: the pool is not checked either
    from prefect_server import free_port

    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api"}):
        checks = {c.name: c for c in doctor.check_prefect("draftline-b300")}
    assert checks["prefect api"].status == "fail"
    assert checks["pool draftline-b300"].status == "fail" and "does not answer" in checks["pool draftline-b300"].detail


def test_the_driver_is_checked_against_the_locks_cuda(tmp_path, monkeypatch):
    """requirements/gpu.lock's torch 2.14.0 is a CUDA 13.0 build: R580 or newer (NVIDIA's table)."""
    assert doctor.lock_cuda("gpu") == "13.0" and doctor.lock_cuda("cpu") is None
    assert doctor.CUDA_MIN_DRIVER[13] == 580
    bin_ = tmp_path / "bin"
    fake_smi(bin_, node(8, "570.172.08"))
    rc, checks = doctor_json(["--flavor", "gpu", "--expect-gpus", "8"], tmp_path, monkeypatch, bin_)
    assert rc == 1
    drv = checks["driver"]
    assert drv["status"] == "fail" and "570.172.08 is too old" in drv["detail"] and "CUDA 13.0" in drv["detail"]
    assert "R580 or newer" in drv["fix"]
    # torch here is a CPU build: nvidia-smi's 8 GPUs are not GPUs torch can use, and doctor says so
    assert checks["gpus"]["status"] == "fail" and "nvidia-smi shows 8" in checks["gpus"]["detail"]
    assert "CPU build" in checks["gpus"]["detail"] and "gpu.lock" in checks["gpus"]["fix"]

    fake_smi(bin_, node(8, "580.95.05"))
    rc, checks = doctor_json(["--flavor", "gpu", "--expect-gpus", "8"], tmp_path, monkeypatch, bin_)
    assert checks["driver"]["status"] == "ok" and "580.95.05 runs CUDA 13.0" in checks["driver"]["detail"]

    fake_smi(bin_, [], rc=9, said="NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    rc, checks = doctor_json(["--flavor", "gpu"], tmp_path, monkeypatch, bin_)
    assert checks["driver"]["status"] == "fail" and "couldn't communicate" in checks["driver"]["detail"]
    assert "reboot" in checks["driver"]["fix"]


def test_the_installed_torchs_cuda_decides_over_the_lock():
    smi = doctor.Smi(node(8, "575.57.08"), "575.57.08", "nvidia-smi")
    cu129 = {"cuda": "12.9", "count": 8, "names": ["NVIDIA H200"] * 8}
    assert doctor.check_driver("gpu", smi, cu129).status == "ok"  # CUDA 12 needs R525
    cu130 = {"cuda": "13.0", "count": 8, "names": ["NVIDIA B300"] * 8}
    bad = doctor.check_driver("gpu", smi, cu130)
    assert bad.status == "fail" and "torch" in bad.detail and "CUDA 13.0" in bad.detail
    # torch sees fewer GPUs than nvidia-smi: a run would use fewer than it was planned for
    assert doctor.check_gpus("gpu", 8, smi, {**cu129, "count": 4}).status == "fail"
    assert doctor.check_gpus("gpu", 8, smi, cu129).status == "ok"


def test_the_disk_check_reads_the_filesystem_that_will_hold_the_path(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    later = tmp_path / "not" / "yet" / "made"
    ok = doctor.check_disk("disk: weights", later, free // 2, "for the weights", "free space")
    assert ok.status == "ok" and str(later) in ok.detail and not later.exists()
    bad = doctor.check_disk("disk: weights", later, free + (1 << 40), "for the weights", "export HF_HOME=/big")
    assert bad.status == "fail" and bad.fix == "export HF_HOME=/big"
    assert re.search(r"[0-9.]+ GiB free at .*; needs for the weights [0-9.]+ GiB", bad.detail)
