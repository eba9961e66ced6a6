"""What `draftline gc` may delete: the leftovers of writers that did not commit (attempt folders no manifest
names, manifest temp files), only under a store's marked root and only under names draftline makes; an attempt
whose writer still runs is kept.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from typing import Any

from tasks.core import owners
from tasks.store.model import ArtifactCorrupt
from tasks.core.capped import RECORD_CAP
from tasks.store.trust import read_capped

# Attempt folders of draftline before owner records (`a<time>-<host tag>-<pid>-<8 hex>`): still draftline's
# leftovers, but the tag cannot tell hosts apart, so they go by age only.
_LEGACY_ATTEMPT_RE = re.compile(r"^a\d{8}T\d{6}-[A-Za-z0-9]{1,16}-\d+-[0-9a-f]{8}$")
_TEMP_FILE_RE = re.compile(r"^manifest\.json\.tmp-[0-9a-f]{32}$")


def is_attempt_name(name: str) -> bool:
    """Whether a folder under STAGE/DIGEST is an attempt draftline made (the one check gc applies)."""
    parsed = owners.parse_owned_name(name)
    return (parsed is not None and parsed["kind"] == "attempt") or bool(_LEGACY_ATTEMPT_RE.match(name))


def garbage_detail(store: Any, min_age_s: float = 3600) -> list[dict[str, Any]]:
    """`Store.garbage` with each leftover's age in seconds and its writer (its owner record, alive?).

    Only under a marked store (`collectable`; NotAStore otherwise), and only what draftline names:
    STAGE/DIGEST/<attempt> folders whose name `is_attempt_name` accepts and that no manifest names,
    and STAGE/DIGEST/manifest.json.tmp-<32 hex> files. An attempt whose writer runs on this machine is
    kept; one whose writer is gone goes at once; one of another host (or boot) is kept while any of its
    files or its owner record (the writer's lease, refreshed while it writes) is younger than min_age_s."""
    out: list[dict[str, Any]] = []
    now = time.time()
    if not store.is_local:
        store.fs.invalidate_cache()
    if not store.collectable():
        return out
    for s in store._dirs(store.root):
        if s.startswith("_"):
            continue
        for d in store._dirs(store.key(s)):
            try:
                m = store.manifest(s, d)
            except ArtifactCorrupt:
                continue  # a manifest naming unsafe paths: leave the whole artifact for a person to see
            live = m.attempt if m else None
            for a in store._dirs(store.key(s, d)):
                if a == live or not is_attempt_name(a):
                    continue
                key = store.key(s, d, a)
                found = store.fs.find(key, detail=True)
                if not any(i.get("type") == "file" and k.rstrip("/") != key for k, i in found.items()):
                    continue  # an empty prefix some S3 servers keep after deletion: nothing to free
                age, writer = _age(store, key, now), _attempt_owner(store, key)
                if writer.get("alive") is True:
                    continue
                if age >= min_age_s or writer.get("alive") is False:
                    out.append({"kind": "attempt", "key": key, "age_s": age, "owner": writer})
            try:
                files = store.fs.ls(store.key(s, d), detail=False)
            except FileNotFoundError:
                files = []
            for f in files:
                if _TEMP_FILE_RE.match(f.rsplit("/", 1)[-1]) and (age := _age(store, f, now)) >= min_age_s:
                    out.append({"kind": "temp-file", "key": f, "age_s": age, "owner": {}})
    return out


def _attempt_owner(store: Any, key: str) -> dict[str, Any]:
    """The attempt's owner record ({} for none) with `alive`: True/False on this machine, None elsewhere."""
    try:
        record = json.loads(read_capped(store.fs, f"{key}/{owners.OWNER_FILE}", RECORD_CAP, store.is_local))
    except (FileNotFoundError, ValueError):
        return {}
    if not isinstance(record, dict):
        return {}
    return {**record, "alive": owners.alive(record)}


def _age(store: Any, key: str, now: float) -> float:
    try:
        newest = 0.0
        for _path, info in store.fs.find(key, detail=True, withdirs=False).items() if store.fs.isdir(key) else [(key, store.fs.info(key))]:
            t = info.get("mtime") or info.get("LastModified") or info.get("created") or 0
            if hasattr(t, "timestamp"):
                t = t.timestamp()
            newest = max(newest, float(t))
        return now - newest if newest else float("inf")
    except FileNotFoundError:
        return float("inf")


def collect(store: Any, min_age_s: float = 3600) -> list[str]:
    """Delete what `garbage_detail` finds; the keys deleted."""
    removed = [g["key"] for g in garbage_detail(store, min_age_s)]
    for key in removed:
        with contextlib.suppress(FileNotFoundError):
            store.fs.rm(key, recursive=True)
    return removed
