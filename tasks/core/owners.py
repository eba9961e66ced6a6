"""Who left a lock, a temporary folder, an engine work folder or a store attempt behind, and whether it
still runs; and the one name pattern every folder draftline may later delete follows.

An owner is (host name in full, boot id, machine id, pid, process start time), kept in full in an
owner record (`.draftline-owner.json` in the folder it owns), never squeezed into a name. A pid alone
is not enough: after its process dies the number is reused, so the start time (clock ticks since
boot, field 22 of /proc/PID/stat) pins one process. Only a process on this machine (same host name,
same boot, same machine id) can be checked; for any other owner `alive` answers None, and callers
fall back to a lease (the record's `beat`, refreshed while the owner works) or an age limit.

Folder names: `draftline-KIND-YYYYMMDDTHHMMSS-<16 hex>` (`owned_name`), for store attempts and local
temp folders alike; `parse_owned_name` is the one check `draftline gc` applies before it deletes
anything, so a user's folder (`assets`, `archive-2023`, `draftline-notes`) never matches by accident.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from tasks.core.capped import RECORD_CAP, read_regular

OWNER_FILE = ".draftline-owner.json"
_OWNED_RE = re.compile(r"^draftline-(?P<kind>[a-z0-9]+(?:-[a-z0-9]+)*)-(?P<when>\d{8}T\d{6})-(?P<rand>[0-9a-f]{16})$")


def owned_name(kind: str) -> str:
    """A fresh name for a folder draftline makes and may later delete: `draftline-KIND-WHEN-<16 hex>`."""
    kind = re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or "tmp"
    return f"draftline-{kind}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(8)}"


def parse_owned_name(name: str) -> dict[str, str] | None:
    """{kind, when, rand} when `name` is one `owned_name` made, else None (not draftline's: never deleted)."""
    m = _OWNED_RE.match(name)
    return m.groupdict() if m else None


def _read_id(path: str) -> str:
    with contextlib.suppress(OSError):
        return Path(path).read_text().strip()
    return ""


def _boot_id() -> str:
    return _read_id("/proc/sys/kernel/random/boot_id")


def _machine_id() -> str:
    """The machine id, hashed for draftline (systemd asks that the raw id never leave the machine: owner
    records land on a shared store)."""
    raw = _read_id("/etc/machine-id") or _read_id("/var/lib/dbus/machine-id")
    return hashlib.sha256(f"draftline-owner:{raw}".encode()).hexdigest()[:32] if raw else ""


def _pid_namespace() -> str:
    """This process's pid namespace (`pid:[INODE]`): two containers on one kernel share its boot id and often its
    host name, and have no machine id, but never a pid namespace unless they share their pids too."""
    with contextlib.suppress(OSError):
        return os.readlink("/proc/self/ns/pid")
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
    now = round(time.time(), 3)
    return {"host": socket.gethostname(), "boot": _boot_id(), "machine": _machine_id(), "pidns": _pid_namespace(),
            "pid": os.getpid(), "start": st[1] if st else None, "since": now, "beat": now}


def here(owner: dict[str, Any] | None) -> bool:
    """Whether `owner` names this machine as it runs now, where its pids are this process's pids: the same full
    host name, boot id, machine id and pid namespace (pods of one Deployment or EC2's ip-172-31-10-15 /
    ip-172-31-101-5 differ in at least one; two containers of one host name on one kernel, without a machine id,
    differ in their pid namespace). A record of an older draftline (no pid namespace) counts only with a machine
    id: without one, two containers could not be told apart."""
    if not owner or owner.get("host") != socket.gethostname():
        return False
    boot, machine = _boot_id(), _machine_id()
    if not (boot or machine):
        return False  # nothing to tell this boot from another: cannot check
    if owner.get("boot", "") != boot or owner.get("machine", machine) != machine:
        return False
    theirs = owner.get("pidns")
    return bool(machine) if theirs is None else theirs == _pid_namespace() != ""


def alive(owner: dict[str, Any] | None) -> bool | None:
    """True/False for an owner on this machine; None when it cannot be told (another host, no record)."""
    if not here(owner):
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


def last_seen(owner: dict[str, Any] | None) -> float:
    """When the owner last said it works (its record's `beat`, else `since`), in epoch seconds; 0 if never."""
    with contextlib.suppress(TypeError, ValueError):
        return float((owner or {}).get("beat") or (owner or {}).get("since") or 0)
    return 0.0


def read(folder: str | os.PathLike) -> dict[str, Any] | None:
    """FOLDER's owner record, or None when it has none that draftline could have written (missing, unreadable,
    not a regular file, over RECORD_CAP, not JSON): the folder is then of an unknown owner (gc goes by its age)."""
    with contextlib.suppress(OSError, ValueError):  # RefusedFile is a ValueError
        record = json.loads(read_regular(Path(folder, OWNER_FILE), RECORD_CAP))
        return record if isinstance(record, dict) else None
    return None


def owned_tempdir(kind: str, dir: str | None = None) -> str:
    """A private (0700) temp folder named `owned_name(kind)` holding its owner record, so `draftline gc`
    can tell a dead run's leftovers from a live run's work (and never takes a folder it did not make)."""
    base = dir or tempfile.gettempdir()
    while True:
        path = os.path.join(base, owned_name(kind))
        try:
            os.mkdir(path, 0o700)
            break
        except FileExistsError:
            continue
    mark(path)
    return path


@contextlib.contextmanager
def owned_temporary_directory(kind: str, dir: str | None = None) -> Iterator[str]:
    path = owned_tempdir(kind, dir)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
