"""What draftline believes of what it reads from a store: anyone who can write the bucket (or the folder) is
untrusted, so every name and path read from it, every manifest and every small record is checked here before use.

- Names and paths: a stage, digest, attempt or file name is plain (`check_name`, `check_relpath`); a path read from
  a manifest becomes a local path only through `safe_join`, which never follows a symlink out of its folder.
- A manifest is the manifest of the address it was read from (`check_manifest_address`): its own `stage` and
  `digest` fields, which name the folder its files are read from, must be the folder's.
- Small store files (manifests, lock and owner records) are read with a byte cap, and only when they are regular
  files (`read_capped`): a FIFO planted as a lock would block the reader forever, a huge file would fill its memory.
- A file draftline writes outside an artifact (the export record) is never written through a planted symlink
  (`write_new_file`).
"""

from __future__ import annotations

import os
import re
from typing import Any

from tasks.core.capped import RefusedFile, read_regular, refuse_over_cap
from tasks.core.errors import DraftlineError

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MANIFEST_CAP = 64 << 20  # the largest manifest read (an extraction shard of a long run lists its parts: ~1 MB)


class UnsafePath(DraftlineError, ValueError):
    """A path from a manifest (or a folder written to) that would lead out of its folder."""


class RefusedStoreFile(RefusedFile):
    """A store file that is not what draftline writes there (not a regular file, too big, the wrong address)."""


def check_name(kind: str, value: str) -> str:
    """Names that become store keys (stages, digests, file names from data) must be plain."""
    if not isinstance(value, str) or not NAME_RE.match(value) or ".." in value:
        raise ValueError(
            f"invalid {kind} {value!r}: use letters, digits, '.', '_' and '-' only "
            "(no '/', no '..'), at most 128 characters"
        )
    return value


def check_relpath(value: str) -> str:
    parts = value.split("/") if isinstance(value, str) else []
    if not parts or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid artifact file path {value!r}: relative, no '..' or empty parts")
    for p in parts:
        check_name("file name", p)
    return value


def safe_join(folder: str | os.PathLike, relpath: str) -> str:
    """The one way a path read from a manifest (or an export's file list) becomes a local path to write:
    `relpath` must be relative, without '..' or empty parts (check_relpath), and no part of it under
    `folder` may be a symlink (a planted link is never followed out of the folder). Raises UnsafePath."""
    try:
        check_relpath(relpath)
    except ValueError as exc:
        raise UnsafePath(f"{exc}: refusing to write it under {folder}") from None
    path = os.fspath(folder)
    for part in relpath.split("/"):
        path = refuse_link(os.path.join(path, part))
    return path


def refuse_link(path: str) -> str:
    """`path`, unless it is a symlink (UnsafePath): draftline never writes through one."""
    if os.path.islink(path):
        raise UnsafePath(f"{path} is a symlink (to {os.readlink(path)}): refusing to write through it; remove "
                         "the link (draftline never makes one there)")
    return path


def read_capped(fs: Any, key: str, cap: int, local: bool) -> bytes:
    """The bytes of a small store file, at most `cap`: on a local store only a regular file, opened without
    following a final symlink and without blocking (a FIFO is refused, never waited on: tasks/core/capped.py); on
    any store a file over the cap is refused, never read whole. FileNotFoundError when it is not there;
    RefusedStoreFile otherwise."""
    fix = "remove it (the stage is then recomputed)"
    if local:
        return read_regular(key, cap, RefusedStoreFile, fix)
    return refuse_over_cap(key, fs.cat_file(key, start=0, end=cap + 1), cap, RefusedStoreFile, fix)


def check_manifest_address(manifest: Any, stage: str, digest: str, where: str) -> None:
    """A manifest read from `STAGE/DIGEST/manifest.json` must say it is that artifact's: its `stage` and `digest`
    name the folder its files are read from, so a body naming another (`../../outside`, another artifact's digest)
    would redirect the reader."""
    if manifest.stage != stage or manifest.digest != digest:
        raise RefusedStoreFile(f"{where}: the manifest there says it is {manifest.stage!r}/{manifest.digest!r}, not "
                               f"{stage}/{digest}; draftline never writes that, so nothing was read from it: delete "
                               "it (the stage is then recomputed)")


def write_new_file(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` as `path`, replacing a regular file there but never writing through a symlink (or into a
    FIFO) planted at that name: a temporary file beside it, renamed over the name (a rename replaces a link
    itself, not its target)."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
