"""Who left a lock, a temporary folder or an engine work folder behind, and whether it still runs.

An owner is (host, boot id, pid, process start time). A pid alone is not enough: after its
process dies the number is reused, so the start time (clock ticks since boot, field 22 of
/proc/PID/stat) pins one process. Only a process on this machine (same host name, same
boot) can be checked; for any other owner `alive` answers None, and callers fall back to a
lease that expires or an age limit.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

OWNER_FILE = ".draftline-owner.json"


def _boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return ""


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a live pid on this machine, None if there is none."""
    try:
        raw = Path(f"/proc/{int(pid)}/stat").read_text()
    except (OSError, ValueError):
        return None
    rest = raw.rsplit(")", 1)[-1].split()  # the command name may hold spaces and parentheses
    try:
        return rest[0], int(rest[19])
    except (IndexError, ValueError):
        return None


def pid_running(pid: int) -> bool:
    """Whether `pid` is a live process on this machine (a zombie, killed and not yet reaped, is not)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def me() -> dict[str, Any]:
    """This process as an owner record (JSON-ready)."""
    st = _stat(os.getpid())
    return {"host": socket.gethostname(), "boot": _boot_id(), "pid": os.getpid(),
            "start": st[1] if st else None, "since": round(time.time(), 3)}


def alive(owner: dict[str, Any] | None) -> bool | None:
    """True/False for an owner on this machine; None when it cannot be told (another host, no record)."""
    if not owner or owner.get("host") != socket.gethostname() or owner.get("boot") != _boot_id():
        return None
    st = _stat(owner.get("pid", -1))
    if st is None or st[0] in ("Z", "X"):  # gone, or killed and not yet reaped
        return False
    return owner.get("start") is None or st[1] == owner["start"]


def describe(owner: dict[str, Any] | None) -> str:
    if not owner:
        return "owner unknown"
    state = {True: "alive", False: "dead", None: "cannot check: another host"}[alive(owner)]
    return f"pid {owner.get('pid')} on {owner.get('host')} ({state})"


def mark(folder: str | os.PathLike) -> None:
    """Record this process as the owner of `folder` (a temp or work folder it made)."""
    Path(folder, OWNER_FILE).write_text(json.dumps(me()))


def read(folder: str | os.PathLike) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(Path(folder, OWNER_FILE).read_text())
    return None


def owned_tempdir(prefix: str, dir: str | None = None) -> str:
    """`tempfile.mkdtemp` whose folder names its owner, so `draftline gc` can tell a dead run's
    leftovers from a live run's work."""
    path = tempfile.mkdtemp(prefix=prefix, dir=dir)
    mark(path)
    return path


@contextlib.contextmanager
def owned_temporary_directory(prefix: str, dir: str | None = None) -> Iterator[str]:
    path = owned_tempdir(prefix, dir)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
