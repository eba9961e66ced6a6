"""What the stage lock costs, and how fast a dead holder's lock is taken over (docs/RELIABILITY.md).

    .venv/bin/python benchmarks/bench_locks.py [--rounds 2000]

1. acquire + release of one key, side by side in one process: no lock, Prefect's
   FileSystemLockManager (what draftline used before: never released by a killed run), and
   draftline's LeaseLocks (tasks/store/leases.py: owner + renewed lease);
2. takeover after the holder is SIGKILLed: a child process takes the lock and is killed; the time
   from its death until a waiter in this process holds the lock, for an owner on this machine (pid
   check) and for one that cannot be checked (another host: the lease must run out; measured with a
   2 s lease, and it scales with the lease).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefect.locking.filesystem import FileSystemLockManager  # noqa: E402

from tasks.store.leases import LeaseLocks, read_lock  # noqa: E402

HOLD = """
import sys, time
from pathlib import Path
from tasks.store.leases import LeaseLocks
m = LeaseLocks(Path(sys.argv[1]), lease_s=float(sys.argv[2]))
m.acquire("k")
print("held", flush=True)
time.sleep(600)
"""


def per_call_us(fn, rounds: int) -> float:
    t0 = time.perf_counter()
    for i in range(rounds):
        fn(i)
    return (time.perf_counter() - t0) / rounds * 1e6


def overhead(rounds: int) -> dict[str, float]:
    out = {}
    with tempfile.TemporaryDirectory() as d:
        out["none_us"] = per_call_us(lambda i: None, rounds)
        fs = FileSystemLockManager(Path(d) / "prefect")
        out["prefect_filesystem_us"] = per_call_us(
            lambda i: (fs.acquire_lock(f"k{i}", "h"), fs.release_lock(f"k{i}", "h")), rounds)
        lease = LeaseLocks(Path(d) / "lease")
        out["lease_us"] = per_call_us(lambda i: lease.release(f"k{i}", lease.acquire(f"k{i}")), rounds)
    return {k: round(v, 1) for k, v in out.items()}


def takeover(lease_s: float, other_host: bool) -> float:
    with tempfile.TemporaryDirectory() as d:
        child = subprocess.Popen([sys.executable, "-c", HOLD, d, str(lease_s)], stdout=subprocess.PIPE, cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert child.stdout.readline().strip() == b"held"
        if other_host:
            time.sleep(lease_s / 2)  # the lease was renewed at least once
        child.send_signal(signal.SIGKILL)
        child.wait()
        t0 = time.monotonic()
        if other_host:  # as if the holder had run on another node sharing the folder
            path = Path(d) / "k.lock"
            rec = read_lock(path)
            rec["owner"]["host"] = "another-node"
            path.write_text(json.dumps(rec))
        LeaseLocks(Path(d), poll_s=0.05).acquire("k")
        return round(time.monotonic() - t0, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args()
    print(json.dumps({
        "acquire_release": overhead(args.rounds),
        "takeover_after_sigkill_s": {"same_host": takeover(60.0, False),
                                     "other_host_lease_2s": takeover(2.0, True)},
        "prefect_filesystem_takeover": "never (expiration null)",
    }, indent=2))


if __name__ == "__main__":
    main()
