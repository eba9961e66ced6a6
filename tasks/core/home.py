"""draftline's folder on this machine (`cache_home`: the offline model, hub snapshots, the node part cache,
locks; $DRAFTLINE_HOME, else $XDG_CACHE_HOME/draftline, else ~/.cache/draftline), its private folders
(`private_folder`: 0700, e.g. engine logs) and the file locks the processes of one node share it under
(`lock_fd`: an flock, shared or exclusive, that the kernel frees when its holder dies; `file_lock`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator


# The environment every draftline process runs in unless the user set otherwise, applied before Prefect is
# imported (the command line, and the tests, which add their own): a fresh Prefect home migrates its database
# slowly on small machines; nothing phones home; draftline's own loggers (locks, engines, training) reach the
# terminal and the Prefect UI. One list: the Makefile exports only what its shell commands need before Python.
ENV_DEFAULTS = {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PREFECT_LOGGING_EXTRA_LOGGERS": "draftline",
}


def apply_env_defaults(**extra: str) -> None:
    """Set ENV_DEFAULTS (and `extra`) where the environment does not already say otherwise."""
    for key, value in {**ENV_DEFAULTS, **extra}.items():
        os.environ.setdefault(key, value)


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


def lock_fd(path: Path, mode: int, block: bool = True) -> int | None:
    """An flock on `path` (created if missing), held by the returned fd; None when `block` is False and
    another holds it. Re-opens when the file was removed and re-made meanwhile (an eviction), so the
    lock held is always the one on the file that is at `path` now."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, mode | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def unlock_fd(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)  # closing the last fd of the open file releases its flock


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` for the block: the node's processes take turns; the kernel frees it when
    its holder dies (SIGKILL included), so a node-local lock needs no owner record (a store's locks do:
    tasks/store/leases.py)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = lock_fd(path, fcntl.LOCK_EX)
    try:
        yield
    finally:
        unlock_fd(fd)
