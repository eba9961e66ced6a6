"""What runs that died leave behind, for `draftline gc`.

- on the store, only under a root that holds draftline's store marker (`Store.collectable`): attempt folders
  named as draftline names them that no manifest names, and manifest temp files
  (tasks/store/gc.py `garbage_detail`);
- stale locks of a file:// store (tasks/store/leases.py, in STORE/_locks and, left by versions that locked
  through Prefect, STORE/_prefect/locks): a dead holder's, an expired lease's, or an older version's (which
  were never released when their run was killed). Nothing else under STORE/_prefect is touched;
- on this machine: the node part cache's temp files whose filler died (tasks/store/part_cache.py; the next
  fill of that part removes them too), engine work folders (hidden-state files and ring buffers in /dev/shm, i.e. RAM),
  temporary checkpoint, draft and export copies (`draftline-KIND-WHEN-<16 hex>` under the temp folder,
  `owners.owned_name`), whose recorded owner process is gone (tasks/core/owners.py). A folder of an older
  version (`draftline-*` with an owner record) counts too; a `draftline-*` folder with neither the name
  nor a record is not draftline's and is never touched.

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

from tasks.core import owners
from tasks.engine.process import engine_tmp_base
from tasks.store.artifacts import Store
from tasks.store.leases import lock_files, lock_folder
from tasks.store.part_cache import PartCache, default_root


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
    state = {True: "alive", False: "dead", None: "cannot check: another host"}[owner.get("alive")]
    return f"pid {owner.get('pid')} on {owner.get('host')} ({state})"


def _temp_kind(path: Path) -> str | None:
    """temp-dir / engine-dir for a folder draftline made in a temp folder, None for any other folder."""
    parsed = owners.parse_owned_name(path.name)
    if parsed is not None:
        return "engine-dir" if parsed["kind"].startswith("engine-") else "temp-dir"
    if not (path / owners.OWNER_FILE).is_file():  # an older version's folder names its owner in a record
        return None
    return "temp-dir" if path.name.startswith(("draftline-ckpt-", "draftline-draft-", "draftline-cfg-",
                                               "draftline-ranks-")) else "engine-dir"


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
             for g in store.garbage_detail(min_age_s)]  # raises NotAStore on a root draftline did not mark
    if store.is_local and store.has_marker():
        for path, info, why in lock_files(lock_folder(store)) + lock_files(lock_folder(store, old=True)):
            if why:
                found.append(Leftover("lock", str(path), now - path.stat().st_mtime,
                                      owners.describe(info.get("owner")), why))
    if default_root().joinpath("tmp").is_dir():
        for path, age, owner in PartCache(default_root(), cap_gib=0).dead_temps():
            found.append(Leftover("cache-temp", str(path), age, owner, "its filler is gone"))
    for base in local_folders():
        for p in sorted(base.glob("draftline-*")):
            if p.is_symlink() or not p.is_dir() or (kind := _temp_kind(p)) is None:
                continue
            with contextlib.suppress(FileNotFoundError):
                owner = owners.read(p)
                age = now - max(p.stat().st_mtime, owners.last_seen(owner))
                live = owners.alive(owner)
                if live is False:
                    found.append(Leftover(kind, str(p), age, owners.describe(owner), "its owner is gone"))
                elif live is None and age >= min_age_s:
                    found.append(Leftover(kind, str(p), age, owners.describe(owner) if owner else "owner unknown",
                                          f"older than {min_age_s:.0f} s"))
    return found


def human_age(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"
