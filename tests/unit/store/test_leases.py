"""Locks that die with their holder (tasks/store/leases.py), tried with real processes and real signals.

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

from tasks.core import owners, stopping
from tasks.store.leases import FORMAT, LeaseLocks, LockWaitTimeout, lock_files, lock_folder, read_lock

ROOT = Path(__file__).resolve().parents[3]

HOLD = """
import sys, time
from pathlib import Path
from tasks.store.leases import LeaseLocks
m = LeaseLocks(Path(sys.argv[1]), lease_s=float(sys.argv[3]))
m.acquire(sys.argv[2])
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

    m = LeaseLocks(tmp_path)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="draftline.locks"), m.hold("extract-abc", {"flow_run": "r1"}):
        assert time.monotonic() - t0 < 2.0
        assert f"pid {child.pid}" in caplog.text and "is gone" in caplog.text
        info = read_lock(tmp_path / "extract-abc.lock")
        assert info["owner"]["pid"] == os.getpid() and info["flow_run"] == "r1"
    assert not (tmp_path / "extract-abc.lock").exists()  # released when the block ends


def test_a_live_holder_is_waited_for_with_a_log_line_and_a_named_bound(tmp_path, caplog):
    child = hold_in_child(tmp_path, "train-xyz")
    try:
        m = LeaseLocks(tmp_path, wait_s=1.5, log_every_s=0.5)
        t0 = time.monotonic()
        with caplog.at_level(logging.INFO, logger="draftline.locks"), pytest.raises(LockWaitTimeout) as err:
            m.acquire("train-xyz")
        assert 1.4 < time.monotonic() - t0 < 5
        assert "waiting for the lock on train-xyz" in caplog.text and f"pid {child.pid}" in caplog.text
        msg = str(err.value)
        assert f"pid {child.pid}" in msg and "(alive)" in msg and "DRAFTLINE_LOCK_WAIT_S=2 s" in msg
        assert "draftline gc" in msg
        assert read_lock(tmp_path / "train-xyz.lock")["owner"]["pid"] == child.pid  # a live lock is never broken
    finally:
        child.kill()
        child.wait()


def test_the_lease_is_renewed_while_held_and_runs_out_when_it_is_not(tmp_path):
    child = hold_in_child(tmp_path, "vocab-1", lease_s=0.4)
    try:
        first = read_lock(tmp_path / "vocab-1.lock")
        time.sleep(0.6)
        later = read_lock(tmp_path / "vocab-1.lock")
        assert later["holder"] == first["holder"] and later["renewed"] > first["renewed"]
        assert later["expires"] > time.time()
    finally:
        child.kill()
        child.wait()
    # An owner that cannot be checked from here (another host sharing the folder): only the lease tells.
    rec = {**later, "owner": {**later["owner"], "host": "another-node"}}
    rec["expires"] = time.time() + 30
    (tmp_path / "vocab-1.lock").write_text(json.dumps(rec))
    m = LeaseLocks(tmp_path, wait_s=0.6)
    with pytest.raises(LockWaitTimeout, match="cannot check: another host"):
        m.acquire("vocab-1")
    rec["expires"] = time.time() - 1
    (tmp_path / "vocab-1.lock").write_text(json.dumps(rec))
    me = m.acquire("vocab-1")
    assert read_lock(tmp_path / "vocab-1.lock")["holder"] == me


def test_locks_of_older_versions_are_recognised_and_cleared(tmp_path):
    """What Prefect's FileSystemLockManager (used until this version) leaves: no owner, no expiry."""
    from prefect.locking.filesystem import FileSystemLockManager

    FileSystemLockManager(tmp_path).acquire_lock("extract-old", holder="a-dead-run")
    ((path, info, why),) = lock_files(tmp_path)
    assert info["expiration"] is None and "older draftline" in why
    me = LeaseLocks(tmp_path).acquire("extract-old")
    assert read_lock(path)["holder"] == me


def test_a_stop_request_ends_a_wait_at_once(tmp_path):
    child = hold_in_child(tmp_path, "extract-def")
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            LeaseLocks(tmp_path).acquire("extract-def")
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
    m1, m2 = LeaseLocks(tmp_path, wait_s=0.5), LeaseLocks(tmp_path, wait_s=0.5)
    one = m1.acquire("k")
    with pytest.raises(LockWaitTimeout):
        m2.acquire("k")
    assert read_lock(tmp_path / "k.lock")["holder"] == one
    m2.release("k", "not-its-holder")  # a holder that is not the lock's removes nothing
    assert read_lock(tmp_path / "k.lock")["holder"] == one
    m1.release("k", one)
    two = m2.acquire("k")
    assert read_lock(tmp_path / "k.lock")["holder"] == two
    assert [p.name for p in tmp_path.iterdir()] == ["k.lock"]  # no temp files left


def test_an_address_lock_is_a_file_in_the_store_that_marks_it_as_one(tmp_path):
    """The flow's lock of STAGE/DIGEST (flows/caching.py): STORE/_locks/STAGE-DIGEST.lock while held, naming
    the process and flow run; taking it marks the root as a store, so a run killed before its first commit
    leaves a root that `draftline gc` and `store init` know as draftline's."""
    from tasks.store.artifacts import Store
    from tasks.store.leases import address_lock

    store = Store(f"file://{tmp_path}/store")
    with address_lock(store, "extract", "d1", {"flow_run": "run-1"}):
        info = read_lock(lock_folder(store) / "extract-d1.lock")
        assert info["owner"]["pid"] == os.getpid() and info["flow_run"] == "run-1"
        assert store.has_marker()
    assert list(lock_folder(store).iterdir()) == [] and store.collectable() and store.list() == []


def test_gc_lists_and_removes_what_dead_runs_left_and_spares_the_living(tmp_path):
    """`draftline gc --dry-run` lists, with age and owner: a stale lock of an older version (in the folder
    versions that locked through Prefect used, STORE/_prefect/locks), a dead run's lock, a dead writer's
    attempt folder, an engine work folder in /dev/shm and a trainer's temporary checkpoint whose process is
    gone. `draftline gc` removes exactly those; a live process's are kept, and so is everything else an older
    version left under STORE/_prefect (its Prefect cache records: nothing reads them, gc does not judge them)."""
    from prefect.locking.filesystem import FileSystemLockManager

    from tasks.store.artifacts import Store

    store_dir = tmp_path / "store"
    store = Store(f"file://{store_dir}")
    old_locks, locks = lock_folder(store, old=True), lock_folder(store)
    FileSystemLockManager(old_locks).acquire_lock("extract-old", holder="a-dead-run")
    old_records = [store_dir / "_prefect" / "cache-keys" / "prepare-d0", store_dir / "_prefect" / "results" / "r0"]
    for path in old_records:
        path.parent.mkdir(parents=True)
        path.write_text('{"storage_key": "r0"}')
    live_lock = LeaseLocks(locks)
    live = live_lock.acquire("extract-live")
    temp = tmp_path / "tmp"
    temp.mkdir()
    # A real process that took a lock, wrote part of an artifact and made two temp folders, then died.
    script = ("import tempfile, sys; from tasks.store.artifacts import Store; from tasks.core.owners import owned_tempdir; "
              f"from tasks.store.leases import LeaseLocks; LeaseLocks({str(locks)!r}).acquire('extract-d0'); "
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
        for key, owner, why in [(("lock", str(old_locks / "extract-old.lock")), "owner unknown", "older draftline"),
                                (("lock", str(locks / "extract-d0.lock")), f"pid {dead_pid}", "is gone"),
                                (("attempt", attempt), f"pid {dead_pid}", "its writer is gone"),
                                (("temp-dir", ckpt), f"pid {dead_pid}", "its owner is gone"),
                                (("engine-dir", shm), f"pid {dead_pid}", "its owner is gone")]:
            assert key in found, (key, dry.stdout)
            assert owner in found[key]["owner"] and why in found[key]["why"] and found[key]["age_s"] >= 0, found[key]
            assert found[key]["removed"] is False
        assert not any("extract-live" in w or w == alive_dir or "/_prefect/cache-keys" in w or "/_prefect/results" in w
                       for _, w in found), found
        assert os.path.isdir(ckpt) and os.path.isdir(shm) and (old_locks / "extract-old.lock").exists()

        done = subprocess.run([*cli, "--yes"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert not os.path.exists(ckpt) and not os.path.exists(shm)
        assert not (old_locks / "extract-old.lock").exists() and not (locks / "extract-d0.lock").exists()
        assert (locks / "extract-live.lock").exists() and all(p.exists() for p in old_records)
        assert store.garbage_detail(min_age_s=0) == [] and os.path.isdir(alive_dir)
    finally:
        live_lock.release("extract-live", live)
        import shutil

        shutil.rmtree(shm, ignore_errors=True)
