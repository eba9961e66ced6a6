"""One process-wide "stop now" flag, set by Ctrl-C or SIGTERM (flows/interrupts.py).

Anything that waits (for a lock, a free engine, an engine to load) waits through `wait()`,
so a stop request ends the wait within a fraction of a second instead of leaving a thread
that the interpreter would join forever.
"""

from __future__ import annotations

import threading

_STOP = threading.Event()
_REASON: list[str] = []


class Stopped(RuntimeError):
    """The run was asked to stop (Ctrl-C, SIGTERM) while this thread waited or worked."""


def request(reason: str) -> None:
    _REASON[:] = [reason]
    _STOP.set()


def requested() -> bool:
    return _STOP.is_set()


def check(what: str) -> None:
    if _STOP.is_set():
        raise Stopped(f"stopped ({_REASON[0] if _REASON else 'requested'}) while {what}")


def wait(seconds: float, what: str) -> None:
    """Sleep `seconds`, or raise Stopped as soon as a stop is requested."""
    if _STOP.wait(seconds):
        check(what)


def reset() -> None:
    """For tests that run several flows in one process."""
    _REASON.clear()
    _STOP.clear()
