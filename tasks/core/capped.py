"""Small files draftline reads from places others can write (a store's folder, /tmp, /dev/shm): read with a byte
cap and only when they are regular files, so a FIFO planted as a record never blocks the reader and a huge file
never fills its memory. tasks/store/trust.py applies the same rule to store files, local or on S3.
"""

from __future__ import annotations

import os
import stat

from tasks.core.errors import DraftlineError

RECORD_CAP = 64 << 10  # a lock file, an owner record: a few hundred bytes


class RefusedFile(DraftlineError, ValueError):
    """A small file that is not what draftline writes there (not a regular file, or too big)."""


def refuse_over_cap(path: str, data: bytes, cap: int, refuse: type[Exception] = RefusedFile,
                    fix: str = "remove it") -> bytes:
    """DATA (read as at most cap + 1 bytes), unless it is over CAP: then REFUSE, naming the file and the FIX."""
    if len(data) > cap:
        raise refuse(f"{path}: larger than the {cap:,} bytes draftline ever writes there; not read: {fix}")
    return data


def read_regular(path: str | os.PathLike, cap: int, refuse: type[Exception] = RefusedFile,
                 fix: str = "remove it") -> bytes:
    """The bytes of a small local file, at most CAP: only a regular file, opened without following a final symlink
    and without blocking (a FIFO is refused, never waited on). FileNotFoundError when it is not there; REFUSE
    otherwise."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise refuse(f"{path}: cannot be opened as a plain file ({exc.strerror}: a symlink or a special file "
                     "planted there?); draftline writes only regular files: remove it") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise refuse(f"{path}: not a regular file (a FIFO, device or folder planted there?); draftline writes "
                         "only regular files: remove it")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(cap + 1)
    finally:
        os.close(fd)
    return refuse_over_cap(path, data, cap, refuse, fix)
