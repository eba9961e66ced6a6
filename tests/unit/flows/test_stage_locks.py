"""Locks that die with their holder (flows/locks.py), tried with real processes and real signals.

Prefect's own file lock, left by a SIGKILLed run, made every later run of that config wait
forever. These tests hold a lock in a real child process, kill it, and check that the
next taker gets it at once; that a live holder is waited for with a log line and a bound that is
named in the error; that a lease nobody renews runs out; that locks of older versions are
cleared; and that a stop request (Ctrl-C) ends a wait at once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flows.locks import FORMAT, LeaseLockManager, LockWaitTimeout, lock_files, read_lock
from tasks.core import owners, stopping

ROOT = Path(__file__).resolve().parents[3]

HOLD = """
import sys, time
from pathlib import Path
from flows.locks import LeaseLockManager
m = LeaseLockManager(Path(sys.argv[1]), lease_s=float(sys.argv[3]))
assert m.acquire_lock(sys.argv[2], holder="child")
print("held", flush=True)
time.sleep(600)
"""


def hold_in_child(folder: Path, key: str, lease_s: float = 60.0) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), key, str(lease_s)], stdout=subprocess.PIPE,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == b"held"
    return proc


@pytest.fixture(autouse=True)
def no_stop():
    stopping.reset()
    yield
    stopping.reset()


def test_a_sigkilled_holders_lock_is_taken_over_at_once(tmp_path, caplog):
    child = hold_in_child(tmp_path, "extract-abc")
    info = read_lock(tmp_path / "extract-abc.lock")
    assert info["format"] == FORMAT and info["owner"]["pid"] == child.pid and owners.alive(info["owner"]) is True
    child.send_signal(signal.SIGKILL)
    child.wait()

    m = LeaseLockManager(tmp_path)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="draftline.locks"):
        assert m.acquire_lock("extract-abc", holder="me")
    assert time.monotonic() - t0 < 2.0
    assert f"pid {child.pid}" in caplog.text and "is gone" in caplog.text
    assert read_lock(tmp_path / "extract-abc.lock")["holder"] == "me"
    m.release_lock("extract-abc", "me")
    assert not (tmp_path / "extract-abc.lock").exists()


def test_a_live_holder_is_waited_for_with_a_log_line_and_a_named_bound(tmp_path, caplog):
    child = hold_in_child(tmp_path, "train-xyz")
    try:
        m = LeaseLockManager(tmp_path, wait_s=1.5, log_every_s=0.5)
        t0 = time.monotonic()
        with caplog.at_level(logging.INFO, logger="draftline.locks"), pytest.raises(LockWaitTimeout) as err:
            m.acquire_lock("train-xyz", holder="me")
        assert 1.4 < time.monotonic() - t0 < 5
        assert "waiting for the lock on train-xyz" in caplog.text and f"pid {child.pid}" in caplog.text
        msg = str(err.value)
        assert f"pid {child.pid}" in msg and "(alive)" in msg and "DRAFTLINE_LOCK_WAIT_S=2 s" in msg
        assert "draftline gc" in msg
        assert read_lock(tmp_path / "train-xyz.lock")["holder"] == "child"  # a live lock is never broken
    finally:
        child.kill()
        child.wait()


def test_the_lease_is_renewed_while_held_and_runs_out_when_it_is_not(tmp_path):
    child = hold_in_child(tmp_path, "vocab-1", lease_s=0.4)
    try:
        first = read_lock(tmp_path / "vocab-1.lock")
        time.sleep(0.6)
        later = read_lock(tmp_path / "vocab-1.lock")
        assert later["holder"] == "child" and later["renewed"] > first["renewed"] and later["expires"] > time.time()
    finally:
        child.kill()
        child.wait()
    # An owner that cannot be checked from here (another host sharing the folder): only the lease tells.
    rec = {**later, "owner": {**later["owner"], "host": "another-node"}}
    rec["expires"] = time.time() + 30
    (tmp_path / "vocab-1.lock").write_text(json.dumps(rec))
    m = LeaseLockManager(tmp_path, wait_s=0.6)
    with pytest.raises(LockWaitTimeout, match="cannot check: another host"):
        m.acquire_lock("vocab-1", holder="me")
    rec["expires"] = time.time() - 1
    (tmp_path / "vocab-1.lock").write_text(json.dumps(rec))
    assert m.acquire_lock("vocab-1", holder="me")


def test_locks_of_older_versions_are_recognised_and_cleared(tmp_path):
    """What Prefect's FileSystemLockManager (used until this version) leaves: no owner, no expiry."""
    from prefect.locking.filesystem import FileSystemLockManager

    FileSystemLockManager(tmp_path).acquire_lock("extract-old", holder="a-dead-run")
    ((path, info, why),) = lock_files(tmp_path)
    assert info["expiration"] is None and "older draftline" in why
    assert LeaseLockManager(tmp_path).acquire_lock("extract-old", holder="me")
    assert read_lock(path)["holder"] == "me"


def test_a_stop_request_ends_a_wait_at_once(tmp_path):
    child = hold_in_child(tmp_path, "extract-def")
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            LeaseLockManager(tmp_path).acquire_lock("extract-def", holder="me")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    try:
        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        stopping.request("SIGINT")
        t.join(5)
        assert not t.is_alive() and time.monotonic() - t0 < 1.0
        assert isinstance(errors[0], stopping.Stopped) and "waiting for the lock on extract-def" in str(errors[0])
    finally:
        child.kill()
        child.wait()


def test_two_takers_of_a_free_lock_one_wins(tmp_path):
    """The lock file appears whole and only once (link, not create-then-write)."""
    m1, m2 = LeaseLockManager(tmp_path, wait_s=0.5), LeaseLockManager(tmp_path, wait_s=0.5)
    assert m1.acquire_lock("k", holder="one")
    with pytest.raises(LockWaitTimeout):
        m2.acquire_lock("k", holder="two")
    assert m1.is_lock_holder("k", "one") and not m2.is_lock_holder("k", "two") and m2.is_locked("k")
    m1.release_lock("k", "one")
    assert m2.acquire_lock("k", holder="two")
    assert [p.name for p in tmp_path.iterdir()] == ["k.lock"]  # no temp files left


def test_gc_lists_and_removes_what_dead_runs_left_and_spares_the_living(tmp_path):
    """`draftline gc --dry-run` lists, with age and owner: a stale lock of an older version, a dead
    writer's attempt folder, an engine work folder in /dev/shm and a trainer's temporary checkpoint
    whose process is gone. `draftline gc` removes exactly those; a live process's are kept."""
    from prefect.locking.filesystem import FileSystemLockManager

    from tasks.store.artifacts import Store

    store_dir = tmp_path / "store"
    store = Store(f"file://{store_dir}")
    locks = store_dir / "_prefect" / "locks"
    FileSystemLockManager(locks).acquire_lock("extract-old", holder="a-dead-run")
    live_lock = LeaseLockManager(locks)
    live_lock.acquire_lock("extract-live", holder="me")
    temp = tmp_path / "tmp"
    temp.mkdir()
    # A real process that wrote part of an artifact and made two temp folders, then died.
    script = ("import tempfile, sys; from tasks.store.artifacts import Store; from tasks.core.owners import owned_tempdir; "
              f"w = Store({store.uri!r}).writer('extract', 'd0', 'v1'); w.write_bytes('part-00000.safetensors', b'x' * 9); "
              "print(owned_tempdir('ckpt'), owned_tempdir('engine-gctest', '/dev/shm'))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(temp)}
    dead = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    ckpt, shm = dead.stdout.split()
    dead_pid = owners.read(ckpt)["pid"]
    alive_dir = owners.owned_tempdir("ckpt", str(temp))
    try:
        cli = [sys.executable, "-m", "cli.app", "gc", "--set", f"store.uri={store.uri}"]
        dry = subprocess.run([*cli, "--dry-run", "--json"], env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
        assert dry.returncode == 0, dry.stderr[-3000:]
        found = {(x["kind"], x["where"]): x for x in json.loads(dry.stdout)}
        attempt = next(w for k, w in found if k == "attempt" and "/extract/d0/draftline-attempt-" in w)
        for key, owner, why in [(("lock", str(locks / "extract-old.lock")), "owner unknown", "older draftline"),
                                (("attempt", attempt), f"pid {dead_pid}", "its writer is gone"),
                                (("temp-dir", ckpt), f"pid {dead_pid}", "its owner is gone"),
                                (("engine-dir", shm), f"pid {dead_pid}", "its owner is gone")]:
            assert key in found, (key, dry.stdout)
            assert owner in found[key]["owner"] and why in found[key]["why"] and found[key]["age_s"] >= 0, found[key]
            assert found[key]["removed"] is False
        assert not any("extract-live" in w or w == alive_dir for _, w in found)
        assert os.path.isdir(ckpt) and os.path.isdir(shm) and (locks / "extract-old.lock").exists()

        done = subprocess.run([*cli, "--yes"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert not os.path.exists(ckpt) and not os.path.exists(shm)
        assert not (locks / "extract-old.lock").exists() and (locks / "extract-live.lock").exists()
        assert store.garbage_detail(min_age_s=0) == [] and os.path.isdir(alive_dir)
    finally:
        live_lock.release_lock("extract-live", "me")
        import shutil

        shutil.rmtree(shm, ignore_errors=True)
