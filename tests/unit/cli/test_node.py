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

from cli.commands import doctor

ROOT = Path(__file__).resolve().parents[3]


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

    from cli.app import app

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


# =========================================================================== FlashInfer's kernels

STANDIN_FLASHINFER = '''
import os, pathlib
def download_artifacts():
    if os.environ.get("STANDIN_OFFLINE"):
        raise RuntimeError("Failed to fetch the checksum manifest: no route to host")
    d = pathlib.Path(os.environ["FLASHINFER_CUBIN_DIR"])
    (d / "fmha").mkdir(parents=True, exist_ok=True)
    (d / "fmha" / "checksums.txt").write_text("stand-in")
    with open(d.parent / "calls", "a") as f:
        f.write(os.environ.get("FLASHINFER_WORKSPACE_BASE", "") + "\\n")
'''


def test_bootstrap_fetches_flashinfers_kernels_into_the_node_cache(tmp_path):
    """FlashInfer's own downloader (flashinfer.artifacts.download_artifacts, flashinfer-python 0.7.2.post1) is
    GPU-stack only and needs NVIDIA's server: a stand-in module records the call. The script must call it with
    the node cache as FLASHINFER_CUBIN_DIR, write that folder into the worker's environment, and stop with the
    fix when the download fails."""
    import deploy_harness as harness

    pkg = tmp_path / "standin" / "flashinfer"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "artifacts.py").write_text(STANDIN_FLASHINFER)
    cache = tmp_path / "cache"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PREFECT_API_URL": "http://127.0.0.1:9/api",
           "DRAFTLINE_STORE_URI": f"file://{tmp_path}/store", "DRAFTLINE_RELEASE": f"v{harness.version()}",
           "DRAFTLINE_SOURCE_DIR": str(ROOT), "DRAFTLINE_VENV": sys.prefix, "DRAFTLINE_EXPECT_GPUS": "0",
           "DRAFTLINE_PREFIX": str(tmp_path / "opt"), "DRAFTLINE_CACHE": str(cache),
           "PYTHONPATH": f"{tmp_path / 'standin'}:{ROOT}"}
    run = lambda extra: subprocess.run(["bash", str(ROOT / "infra" / "node-bootstrap.sh"), "--no-install"],
                                       env={**env, **extra}, capture_output=True, text=True, timeout=300)
    out = run({"STANDIN_OFFLINE": "1"})
    assert out.returncode == 2 and "could not fetch FlashInfer's kernels" in out.stderr, out.stderr[-2000:]
    assert "FLASHINFER_CUBINS_REPOSITORY" in out.stderr and "draftline doctor" not in out.stdout
    out = run({})
    cubins = cache / "flashinfer" / "cubins"
    assert (cubins / "fmha" / "checksums.txt").is_file(), out.stdout + out.stderr[-2000:]
    assert (cache / "flashinfer" / "calls").read_text().split() == [str(cache)]
    worker_env = (tmp_path / "opt" / f"worker-v{harness.version()}.env").read_text()
    assert f"FLASHINFER_CUBIN_DIR={cubins}\n" in worker_env and f"FLASHINFER_WORKSPACE_BASE={cache}\n" in worker_env
    # then doctor ran (and stopped the script on the unreachable Prefect API given here)
    assert "node-bootstrap: draftline doctor" in out.stdout and out.returncode == 2


def test_doctor_says_whether_flashinfers_kernels_are_on_disk(tmp_path, monkeypatch):
    real = doctor.installed_version
    assert real("flashinfer-python") is None and doctor.check_flashinfer() is None  # the CPU set has none
    monkeypatch.setattr(doctor, "installed_version",
                        lambda n: "0.7.2.post1" if n == "flashinfer-python" else real(n))
    monkeypatch.setenv("FLASHINFER_CUBIN_DIR", str(tmp_path / "cubins"))
    bad = doctor.check_flashinfer()
    assert bad.status == "fail" and "without internet" in bad.detail
    assert "node-bootstrap.sh" in bad.fix and "download-cubin" in bad.fix
    (tmp_path / "cubins" / "fmha").mkdir(parents=True)
    (tmp_path / "cubins" / "fmha" / "k.cubin").write_bytes(b"\0")
    assert doctor.check_flashinfer().status == "ok"


# =========================================================================== infra/Dockerfile

def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) of each Dockerfile instruction: continuation lines joined as written, BuildKit
    heredocs (`<<'PY' ... PY`) included."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        if not lines[i].strip() or lines[i].lstrip().startswith("#"):
            i += 1
            continue
        buf = [lines[i]]
        while buf[-1].endswith("\\"):
            i += 1
            buf.append(lines[i])
        m = re.search(r"<<-?'?([A-Za-z_]+)'?\s*$", buf[-1])
        if m:
            while lines[i] != m.group(1):
                i += 1
                buf.append(lines[i])
        body = "\n".join(buf)
        word, rest = body.split(None, 1)
        out.append((word.upper(), rest))
        i += 1
    return out


def test_the_dockerfiles_own_checks_run_against_this_tree(tmp_path):
    """The image cannot be built here (no Docker daemon, no base image): its COPY sources must exist and pass
    its .dockerignore, and its RUN step runs as written against this checkout in place of /opt/draftline
    (DRAFTLINE_VENV: this environment instead of a fresh one). Its last command, the drift check, must import
    and judge this machine: it holds the CPU set, not requirements/gpu.lock, and says so."""
    steps = dockerfile_instructions((ROOT / "infra" / "Dockerfile").read_text())
    ignore = [p[1:] for p in (ROOT / "infra" / "Dockerfile.dockerignore").read_text().splitlines()
              if p.startswith("!")]
    from fnmatch import fnmatch

    copies = [rest.split()[0] for word, rest in steps if word == "COPY"]
    assert copies and "requirements" in copies and "cli" in copies and "flows" in copies
    for src in copies:
        assert (ROOT / src).exists(), src
        assert any(fnmatch(src, p) or fnmatch(f"{src}/x", p) for p in ignore), f"{src} is left out by .dockerignore"
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "HOME": str(tmp_path),
           "DRAFTLINE_VENV": sys.prefix, "PYTHONPATH": str(ROOT)}
    for word, rest in steps:
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            env[k.strip()] = v.strip().strip('"')
    env_block = next(rest for word, rest in steps if word == "ENV")
    for k, v in re.findall(r"(\w+)=(\S+)", env_block.replace("\\\n", " ")):
        if k != "PATH":
            env[k] = v.replace("/opt/draftline", str(ROOT)).replace("/cache", str(tmp_path / "cache")).replace(
                "/opt/flashinfer", str(tmp_path / "flashinfer"))
    runs = [re.sub(r"^--mount=\S+\s*\\?\s*", "", rest) for word, rest in steps if word == "RUN"]
    build = next(r for r in runs if "node-bootstrap.sh --install-only" in r)
    image_code = tmp_path / "image-code"  # where the image records its commit, /opt/draftline
    image_code.mkdir()
    script = build.replace("/opt/draftline/.draftline-commit", str(image_code / ".draftline-commit")).replace(
        "/opt/draftline", str(ROOT))
    # without the commit (the build context has no .git), the build stops and says how to give it
    assert env["DRAFTLINE_COMMIT"] == ""
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "--build-arg DRAFTLINE_COMMIT=" in out.stderr, out.stderr[-2000:]
    from flows.release import code_commit

    env["DRAFTLINE_COMMIT"] = code_commit(ROOT)
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert code_commit(image_code) == env["DRAFTLINE_COMMIT"], text[-2000:]
    assert "installed into" in text and "--install-only" in text, text[-3000:]  # the node's install step
    assert "ModuleNotFoundError" not in text and "ImportError" not in text, text[-3000:]
    assert out.returncode != 0 and "image does not match requirements/gpu.lock" in text, text[-3000:]
    assert re.search(r"torch: 2\.13\.0\+cpu installed, tested with 2\.14\.0", text), text[-3000:]
    # the same check on the set this machine does hold passes: it fails on drift, not always
    same = script.replace('check_versions("gpu")', 'check_versions("cpu")')
    assert same != script
    out = subprocess.run(["bash", "-c", same], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "versions match" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert next(rest for word, rest in steps if word == "CMD") == '["draftline", "doctor", "--flavor", "gpu"]'


def test_the_gpu_lock_holds_no_flashinfer_kernels_of_another_version():
    """A flashinfer-cubin / flashinfer-jit-cache that does not match flashinfer-python is ignored by FlashInfer:
    if the lock ever carries one, it is the matching one (today none: PyPI has no 0.7 kernels, docs/STACK.md)."""
    from tests.repo.test_locks import GPU_LOCK, pins

    lock = pins(GPU_LOCK)
    for name in ("flashinfer-cubin", "flashinfer-jit-cache"):
        if name in lock:
            assert lock[name].split("+")[0] == lock["flashinfer-python"], (name, lock[name])
    if "flashinfer-cubin" not in lock:  # then the node's install step fetches them
        script = (ROOT / "infra" / "node-bootstrap.sh").read_text()
        assert "download_artifacts()" in script and 'echo "FLASHINFER_CUBIN_DIR=$FLASHINFER_CUBINS"' in script


def test_bootstrap_fetches_the_weights_before_doctor_and_the_worker(tmp_path):
    """--weights CONFIG runs `draftline weights CONFIG` from the release with the worker's environment (the
    node's cache), after the install and before doctor and the worker; a failure stops the script there."""
    import deploy_harness as harness

    from cli.app import app
    import typer

    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PREFECT_API_URL": "http://127.0.0.1:9/api",
           "DRAFTLINE_STORE_URI": f"file://{tmp_path}/store", "DRAFTLINE_RELEASE": f"v{harness.version()}",
           "DRAFTLINE_SOURCE_DIR": str(ROOT), "DRAFTLINE_VENV": sys.prefix, "DRAFTLINE_EXPECT_GPUS": "0",
           "DRAFTLINE_PREFIX": str(tmp_path / "opt"), "DRAFTLINE_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT)}
    script = ["bash", str(ROOT / "infra" / "node-bootstrap.sh")]
    bad = subprocess.run([*script, "--check", "--weights", "/etc/passwd"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--weights takes a config inside the release" in bad.stderr
    out = subprocess.run([*script, "--no-install", "--weights", "configs/demo.yaml"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 2, out.stdout + out.stderr[-2000:]
    step = out.stdout.index("node-bootstrap: draftline weights configs/demo.yaml")
    has_weights = "weights" in {c.name for c in typer.main.get_command(app).commands.values()}
    if has_weights:  # the preset's weights are local: nothing to fetch, then doctor (the API here is unreachable)
        assert out.stdout.index("node-bootstrap: draftline doctor") > step, out.stdout
    else:  # before `draftline weights` exists (another branch), the script stops at that step, saying so
        assert "draftline weights configs/demo.yaml failed" in out.stderr and "draftline doctor" not in out.stdout


def test_the_kimi_preset_on_a_node_with_an_old_driver(tmp_path, monkeypatch):
    """`draftline doctor configs/kimi-k2.5-b300.yaml --json` on a B300 node whose driver predates CUDA 13 (a
    stand-in nvidia-smi): the driver trap is caught before any run, with the fix, and the config itself loads."""
    bin_ = tmp_path / "bin"
    fake_smi(bin_, node(8, "575.57.08"))
    monkeypatch.setenv("DRAFTLINE_STORE_URI", f"file://{tmp_path}/store")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, checks = doctor_json([str(ROOT / "configs" / "kimi-k2.5-b300.yaml"), "--flavor", "gpu", "--expect-gpus", "8"],
                             tmp_path, monkeypatch, bin_)
    assert rc == 1
    assert "config" not in checks and checks["store"]["status"] == "ok"
    assert checks["driver"]["status"] == "fail" and "575.57.08 is too old" in checks["driver"]["detail"]
    assert "R580 or newer" in checks["driver"]["fix"]
