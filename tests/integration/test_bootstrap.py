"""infra/node-bootstrap.sh end to end, as on a rented node: clone the release from git, build a fresh
virtualenv holding exactly a lock, write the worker's environment, run `draftline doctor` against the real
Prefect server and S3 store, create the pool and leave a worker polling it.

The CPU lock stands in for the GPU one (`--lock requirements/cpu.lock`: this machine has no GPU, and
requirements/gpu.lock is for Python 3.12 on CUDA); the steps are the ones a node and infra/Dockerfile
(`--install-only`) run. Slow: the install is ~240 packages (pip's cache is warm after `make venv`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import time
import uuid
from pathlib import Path

import pytest

import deploy_harness as harness

ROOT = Path(__file__).resolve().parents[2]
BOOTSTRAP = ROOT / "infra" / "node-bootstrap.sh"


def release_repo(tmp: Path) -> str:
    """A git repository holding this working tree (tracked and new files) tagged as the release, the way
    DRAFTLINE_REPO serves a tag to the node."""
    repo = tmp / "draftline.git"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            (repo / f).write_bytes(src.read_bytes())
            (repo / f).chmod(src.stat().st_mode)
    git = ["git", "-C", str(repo), "-c", "user.name=test", "-c", "user.email=test@example.invalid"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "release"], check=True)
    subprocess.run([*git, "tag", f"v{harness.version()}"], check=True)
    return f"file://{repo}"


def lock_pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9_.\-]*)==(\S+)", line.split("#", 1)[0].strip())
        if m:
            pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return pins


@pytest.mark.slow
@pytest.mark.s3
def test_bootstrap_installs_the_lock_from_a_fresh_virtualenv_and_leaves_a_worker_polling(
        prefect_server, s3_server, tmp_path):
    release = f"v{harness.version()}"
    pool = f"bootstrap-{uuid.uuid4().hex[:6]}"
    prefix = tmp_path / "opt"
    # What docs/DEPLOY.md ("Turn a rented node into a worker") exports, against the local servers; plus
    # what this machine needs: no GPUs, folders it may write, its own Prefect home.
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"),
           "PREFECT_API_URL": prefect_server.api_url,
           "DRAFTLINE_STORE_URI": f"s3://draftline-test/bootstrap-{uuid.uuid4().hex[:8]}",
           **s3_server.env(),
           "DRAFTLINE_REPO": release_repo(tmp_path), "DRAFTLINE_RELEASE": release,
           "DRAFTLINE_PREFIX": str(prefix), "DRAFTLINE_CACHE": str(tmp_path / "cache"),
           "DRAFTLINE_EXPECT_GPUS": "0", "PREFECT_HOME": str(tmp_path / "prefect-home"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
           # pip installs the same files but leaves their bytecode to the first import (byte-compiling the lock's
           # ~28K .py files is ~30-60 s of the install on 2 cores; doctor and the worker compile what they import)
           "PIP_COMPILE": "0",
           "DRAFTLINE_WORKER_AS_ROOT": "1"}  # this sandbox's root: its temp folders are root's (a node's worker drops it)
    t0 = time.time()
    out = subprocess.run(["bash", str(BOOTSTRAP), "--pool", pool, "--lock", "requirements/cpu.lock", "--background"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    took = time.time() - t0
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-5000:]
    code = prefix / "releases" / release
    venv = code / ".venv"
    pidfile = prefix / f"worker-{pool}.pid"
    pid = int(pidfile.read_text())
    try:
        # the release, cloned from the tag
        assert (code / "flows" / "pipeline.py").is_file() and (code / ".git").is_dir()
        assert f"cloning {env['DRAFTLINE_REPO']} at {release}" in log
        # a fresh virtualenv holding exactly the lock (plus draftline itself)
        frozen = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze",
                                 "--exclude-editable"], capture_output=True, text=True, check=True).stdout
        have = {re.sub(r"[-_.]+", "-", n).lower(): v for n, v in (x.split("==", 1) for x in frozen.split())}
        want = lock_pins(ROOT / "requirements" / "cpu.lock")
        extra = set(have) - set(want) - {"pip", "setuptools", "wheel"}
        assert not extra, f"installed but not in the lock: {sorted(extra)}"
        assert {n: have.get(n) for n in want} == want
        # doctor passed against the real store and API (the script stops otherwise)
        assert "node-bootstrap: draftline doctor" in log and "ready" in log, log[-3000:]
        # the worker's environment: mode 600, keys there, never printed
        env_file = prefix / f"worker-{release}.env"
        assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
        assert f"AWS_SECRET_ACCESS_KEY={env['AWS_SECRET_ACCESS_KEY']}" in env_file.read_text()
        assert env["AWS_SECRET_ACCESS_KEY"] not in log
        # a worker polls the pool: the server lists it online
        with harness.client(prefect_server) as c:
            assert c.read_work_pool(pool).type == "process"
            deadline = time.time() + 180
            while True:
                workers = c.read_workers_for_work_pool(pool)
                if any(w.status.value == "ONLINE" for w in workers):
                    break
                assert time.time() < deadline, f"no online worker in {pool}: {workers}\n" + \
                    (prefix / f"worker-{pool}.log").read_text()[-3000:]
                time.sleep(2)
        assert os.kill(pid, 0) is None
        # a second run of the script on the same node installs nothing again and starts no second worker
        again = subprocess.run(["bash", str(BOOTSTRAP), "--pool", pool, "--lock", "requirements/cpu.lock",
                                "--background", "--no-install"], cwd=tmp_path, env=env, capture_output=True,
                               text=True, timeout=600)
        assert again.returncode == 0 and f"a worker is already running (pid {pid})" in again.stdout, again.stderr
        print(json.dumps({"bootstrap_seconds": round(took, 1)}))
    finally:
        stop_worker(pid)


def stop_worker(pid: int, grace: float = 10) -> None:
    """SIGTERM the worker's process group (the script started it in its own session), SIGKILL what is left:
    a Prefect worker that has lost its server may not finish shutting down on SIGTERM."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + grace
        while time.time() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)


def test_install_only_needs_just_the_checkout(tmp_path):
    """The Dockerfile's step asks for no API, store, release or GPUs; a wrong lock or checkout is named.
    (Never pointed at this checkout: its .venv is the developer's.)"""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"),
           "DRAFTLINE_SOURCE_DIR": str(tmp_path / "not-a-checkout"), "DRAFTLINE_VENV": str(tmp_path / "no-venv")}
    out = subprocess.run(["bash", str(BOOTSTRAP), "--install-only", "--lock", "/etc/passwd"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    for name in ("PREFECT_API_URL", "DRAFTLINE_STORE_URI", "DRAFTLINE_RELEASE", "nvidia-smi"):
        assert name not in out.stderr, out.stderr
    assert "is not a draftline checkout" in out.stderr and "path inside the checkout" in out.stderr
    # a lock whose wheels need a newer glibc than this machine's is refused before anything is installed
    checkout = tmp_path / "checkout"
    (checkout / "flows").mkdir(parents=True)
    (checkout / "flows" / "pipeline.py").write_text("")
    (checkout / "requirements").mkdir()
    (checkout / "requirements" / "future.lock").write_text(
        "#    uv pip compile x.in --python-platform x86_64-manylinux_2_99 --python-version 3.11 -o x.lock\n")
    out = subprocess.run(["bash", str(BOOTSTRAP), "--install-only", "--lock", "requirements/future.lock"],
                         env={**env, "DRAFTLINE_SOURCE_DIR": str(checkout), "DRAFTLINE_VENV": ""},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "glibc 2.99 or newer" in out.stderr, out.stderr
    assert not (checkout / ".venv").exists()
    out = subprocess.run(["bash", str(BOOTSTRAP), "--pool"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--pool needs a value" in out.stderr
    out = subprocess.run(["bash", str(BOOTSTRAP), "--install-only", "--docker"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "--install-only goes with none of" in out.stderr
