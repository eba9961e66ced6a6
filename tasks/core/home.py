"""draftline's folder on this machine (`cache_home`: the offline model, hub snapshots, the node part cache,
locks; $DRAFTLINE_HOME, else $XDG_CACHE_HOME/draftline, else ~/.cache/draftline), its private folders
(`private_folder`: 0700, e.g. engine logs) and the file lock the processes of one node share it under."""

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


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
