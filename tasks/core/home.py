"""draftline's folder on this machine (`cache_home`: the offline model, hub snapshots, the node part cache,
locks; $DRAFTLINE_HOME, else $XDG_CACHE_HOME/draftline, else ~/.cache/draftline), its private folders
(`private_folder`: 0700, e.g. engine logs) and the file lock the processes of one node share it under."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator


def cache_home() -> Path:
    root = os.environ.get("DRAFTLINE_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "draftline")
    p = Path(root)
    p.mkdir(parents=True, exist_ok=True)
    return p


def private_folder(name: str) -> Path:
    """A folder of `cache_home` that only this user may enter (0700): where a dead engine's log is kept
    (never a predictable path in the shared temp folder, which others could read or plant a link at)."""
    p = cache_home() / name
    p.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(p, 0o700)
    return p


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
