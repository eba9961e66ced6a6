"""What runs that died leave behind, for `draftline gc`.

- on the store: attempt folders no manifest names and temp files (tasks/store/artifacts.py `garbage_detail`);
- stale locks of a file:// store (flows/locks.py): a dead holder's, an expired lease's, or an older
  version's (which were never released when their run was killed);
- on this machine: the node part cache's temp files whose filler died (tasks/store/part_cache.py; the next
  fill of that part removes them too), engine work folders (hidden-state files and ring buffers in /dev/shm, i.e. RAM),
  temporary checkpoint and export copies of a killed trainer (`draftline-*` under the temp folder),
  whose recorded owner process is gone (tasks/core/owners.py). Folders without an owner record (older
  versions) go once older than the age limit.

A leftover whose owner is provably dead is removed whatever its age; the age limit protects work
whose owner may still be running (another host, or no owner recorded).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from flows.caching import lock_folder
from flows.locks import lock_files
from tasks.core import owners
from tasks.engine.process import engine_tmp_base
from tasks.store.artifacts import Store


@dataclass
class Leftover:
    kind: str        # attempt | temp-file | lock | cache-temp | engine-dir | temp-dir
    where: str       # a store key or a local path
    age_s: float
    owner: str       # who made it, and whether it still runs
    why: str         # why it is safe to remove

    def remove(self, store: Store) -> None:
        if self.kind in ("attempt", "temp-file"):
            with contextlib.suppress(FileNotFoundError):
                store.fs.rm(self.where, recursive=True)
        elif os.path.isdir(self.where):
            shutil.rmtree(self.where, ignore_errors=True)
        else:
            Path(self.where).unlink(missing_ok=True)


def _writer(owner: dict) -> str:
    if not owner:
        return "writer unknown"
    state = {True: "alive", False: "dead", None: "cannot check"}[owner.get("alive")]
    return f"pid {owner['pid']} on {owner['host']} ({state})"


def local_folders() -> list[Path]:
    """Where this machine's engines and trainers put their temporary folders."""
    out = []
    for base in (os.environ.get("DRAFTLINE_ENGINE_TMP"), engine_tmp_base(), "/dev/shm", tempfile.gettempdir()):
        if base and os.path.isdir(base) and Path(base).resolve() not in out:
            out.append(Path(base).resolve())
    return out


def find(store: Store, min_age_s: float) -> list[Leftover]:
    now = time.time()
    found = [Leftover(g["kind"], g["key"], g["age_s"], _writer(g["owner"]),
                      "its writer is gone" if g["owner"].get("alive") is False else f"older than {min_age_s:.0f} s")
             for g in store.garbage_detail(min_age_s)]
    if store.is_local:
        for path, info, why in lock_files(lock_folder(store)):
            if why:
                found.append(Leftover("lock", str(path), now - path.stat().st_mtime,
                                      owners.describe(info.get("owner")), why))
    from tasks.store.part_cache import PartCache, default_root

    if default_root().joinpath("tmp").is_dir():
        for path, age, owner in PartCache(default_root(), cap_gib=0).dead_temps():
            found.append(Leftover("cache-temp", str(path), age, owner, "its filler is gone"))
    for base in local_folders():
        for p in sorted(base.glob("draftline-*")):
            if not p.is_dir():
                continue
            with contextlib.suppress(FileNotFoundError):
                age = now - p.stat().st_mtime
                owner = owners.read(p)
                live = owners.alive(owner)
                kind = "temp-dir" if p.name.startswith(("draftline-ckpt-", "draftline-draft-", "draftline-cfg-",
                                                        "draftline-ranks-")) \
                    else "engine-dir"
                if live is False:
                    found.append(Leftover(kind, str(p), age, owners.describe(owner), "its owner is gone"))
                elif owner is None and age >= min_age_s:
                    found.append(Leftover(kind, str(p), age, "owner unknown (older version)",
                                          f"older than {min_age_s:.0f} s"))
    return found


def human_age(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"
