"""Ctrl-C and SIGTERM stop a run within seconds and leave no process behind.

On the first SIGINT or SIGTERM the run is told to stop (tasks/core/stopping.py: every wait for a lock,
an engine or a free engine group ends at once), its engines are killed (their whole process
groups: vLLM's engine core too), and the main thread is interrupted, so Prefect records the flow
run as Crashed. Nothing half-written is ever committed (manifest last), so finished work is
reused by the next run. If the process has not exited `DRAFTLINE_STOP_GRACE_S` (15) seconds later
(a thread deep in a computation that cannot be interrupted), it kills every process it started
and exits anyway. A second Ctrl-C exits at once.

Prefect's flow engine bridges SIGTERM into an exception of its own while a flow runs (and sends
the signal again to the previous handler once it has cleaned up); `chain_into_flow` makes our
stop run first inside that bridge, and the re-sent signal is recognised as the same stop.
"""

from __future__ import annotations

# Prefect's server module is imported where it is asked about, and only if Prefect is there: it is heavy, and
# `draftline run` imports this module before it starts the flow.

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator

import psutil

from tasks.core import stopping
from tasks.engine.process import kill_all

REDELIVERY_S = 3.0  # Prefect re-sends the SIGTERM it bridged: the same stop, not a second one
_state: dict[str, Any] = {"signum": None, "t": 0.0, "say": None}
_mutex = threading.Lock()


def _say(msg: str) -> None:
    say = _state.get("say")
    with contextlib.suppress(Exception):
        (say or (lambda m: print(m, file=sys.stderr, flush=True)))(msg)


def exit_code(signum: int) -> int:
    return 128 + signum


def descendants() -> list[Any]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process().children(recursive=True)
    return []


def _prefect_server_pids() -> set[int]:
    """The ephemeral Prefect server this process started (and what it started)."""
    pids: set[int] = set()
    with contextlib.suppress(Exception):
        from prefect.server.api.server import SubprocessASGIServer

        for server in SubprocessASGIServer._instances.values():
            proc = getattr(server, "server_process", None)
            if proc is not None:
                pids.add(proc.pid)
                with contextlib.suppress(psutil.Error):
                    pids.update(p.pid for p in psutil.Process(proc.pid).children(recursive=True))
    return pids


def kill_descendants(spare_prefect_server: bool = False) -> int:
    """SIGKILL every process this one started (engines, their workers, training ranks, and unless
    spared, a Prefect server of its own, which must outlive the run's last log lines); returns how
    many were alive."""
    spare = _prefect_server_pids() if spare_prefect_server else set()
    kids = [p for p in descendants() if p.pid not in spare]
    for p in kids:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(kids, timeout=5)
    return len(kids)


def hard_exit(code: int, why: str) -> None:
    _say(why)
    with contextlib.suppress(Exception):
        kill_descendants()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _watchdog(grace: float, code: int, name: str) -> None:
    time.sleep(grace)
    if os.environ.get("DRAFTLINE_STOP_TRACE"):  # what held the exit up: every thread's stack
        faulthandler.dump_traceback(all_threads=True)
    hard_exit(code, f"draftline: the run did not stop within {grace:.0f} s of {name} "
                    "(DRAFTLINE_STOP_GRACE_S); killed what it had started and exited")


def begin_stop(signum: int) -> bool:
    """Start stopping; False when this is a second, separate signal (the caller exits at once)."""
    name = signal.Signals(signum).name
    with _mutex:
        if _state["signum"] is not None:
            return signum == signal.SIGTERM == _state["signum"] and time.monotonic() - _state["t"] < REDELIVERY_S
        _state.update(signum=signum, t=time.monotonic())
    stopping.request(name)

    killed = kill_all()
    grace = float(os.environ.get("DRAFTLINE_STOP_GRACE_S") or 15)
    _say(f"draftline: {name} received: stopping the run ({killed} engine(s) killed). Nothing incomplete is "
         f"committed; run the same command again to resume (finished work is reused). "
         f"{'Press Ctrl-C again to exit at once.' if signum == signal.SIGINT else ''}".rstrip())
    threading.Thread(target=_watchdog, args=(grace, exit_code(signum), name), name="draftline-stop-watchdog",
                     daemon=True).start()
    return True


def _handler(signum: int, frame: Any) -> None:
    if not begin_stop(signum):
        hard_exit(exit_code(signum), f"draftline: second {signal.Signals(signum).name}: exiting now")
    raise KeyboardInterrupt(signal.Signals(signum).name)


def stop_signal() -> int | None:
    """The signal that stopped this process's run, if one did."""
    return _state["signum"]


@contextlib.contextmanager
def stop_on_signals(say: Callable[[str], None] | None = None) -> Iterator[None]:
    """Around a run in the main thread: SIGINT and SIGTERM stop it as the module docstring says."""
    _state["say"] = say
    old = {s: signal.signal(s, _handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def chain_into_flow() -> None:
    """Inside a flow body (main thread only): run our stop before Prefect's SIGTERM bridge raises.

    Also serves flow runs started by a worker: Prefect cancels them with SIGTERM."""
    with contextlib.suppress(ValueError):  # not the main thread: signals are not ours to handle
        prev = signal.getsignal(signal.SIGTERM)
        if getattr(prev, "_draftline", False):
            return

        def chained(signum: int, frame: Any) -> None:
            begin_stop(signum)
            if callable(prev):
                prev(signum, frame)
            raise KeyboardInterrupt(signal.Signals(signum).name)

        chained._draftline = True  # type: ignore[attr-defined]
        signal.signal(signal.SIGTERM, chained)
