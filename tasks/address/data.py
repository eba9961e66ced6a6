"""What the training data IS, not where it sits: each data source's content identity, in the prepare address.

A local file enters by the sha256 of its bytes (hashed once per node and remembered by the file's stat, the cache
the target's weights use: tasks/engine/weights.py `file_sha256s`), so the same file at another path or on another
machine has the same address and a file edited in place has a new one. An object on a remote fsspec store (s3://)
enters by what the store says its content is (its ETag, and its VersionId where the bucket keeps versions); a store
that says nothing is read once and hashed. A hub dataset enters by its commit: a branch or tag is resolved once per
run (`pin_data`, as the target's revision is: tasks/engine/weights.py `pin_run`) and the commit is what the run's
tasks, its child runs and the address read. The offline presets are named: they come with a package.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
from typing import Any

from tasks.core.errors import DraftlineError

log = logging.getLogger("draftline.data")

_COMMIT = re.compile(r"[0-9a-f]{40}")
# What an fsspec store says about an object's content (s3fs: ETag, VersionId; gcsfs: md5Hash, crc32c, generation;
# adlfs: etag, version_id).
_CONTENT_TAGS = ("ETag", "VersionId", "md5Hash", "crc32c", "generation", "etag", "version_id")


class DataIdentityError(DraftlineError, ValueError):
    """A data source whose content cannot be named; the message says what to fix."""


def _suffix(path: str) -> str:
    """How the file is read (tasks/data/sources.py chooses the reader and the compression by its name)."""
    name = path.rsplit("/", 1)[-1].lower()
    for ext in (".jsonl.gz", ".json.gz", ".jsonl", ".ndjson", ".json", ".parquet"):
        if name.endswith(ext):
            return ext
    return name.rsplit(".", 1)[-1] if "." in name else ""


def file_identity(path: str) -> dict[str, Any]:
    """A data file's content identity: {"sha256"} of a local file, an object store's content tags, or the sha256
    of an object read once where the store gives none."""
    import fsspec

    try:
        fs, inner = fsspec.core.url_to_fs(path)
        if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
            from tasks.engine.weights import file_sha256s

            real = os.path.realpath(inner)
            if not os.path.isfile(real):
                raise FileNotFoundError(real)
            return {"sha256": file_sha256s([real])[real]}
        fs.invalidate_cache(inner)  # what the store says now, not a listing this process cached
        info = fs.info(inner)
    except FileNotFoundError:
        raise DataIdentityError(f"source file {path} not found; fix data.sources[].path (a source is addressed by "
                                "its content, so the file must be readable where the run's addresses are made)"
                                ) from None
    tags = {k: str(info[k]).strip('"') for k in _CONTENT_TAGS if info.get(k) not in (None, "", {})}
    if tags:
        return {"size": int(info.get("size") or 0), **tags}
    h = hashlib.sha256()
    with fs.open(inner, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return {"sha256": h.hexdigest()}


@functools.lru_cache(maxsize=64)
def dataset_commit(repo: str, revision: str | None) -> str:
    """The commit `revision` (None: main) of the hub dataset `repo` names now (one call per process; a 40-hex
    revision is a commit already). Offline: the commit this node's Hugging Face cache recorded for it."""
    if revision and _COMMIT.fullmatch(revision):
        return revision
    from huggingface_hub import constants

    ref = os.path.join(constants.HF_HUB_CACHE, f"datasets--{repo.replace('/', '--')}", "refs", revision or "main")
    if constants.HF_HUB_OFFLINE:
        try:
            sha = open(ref).read(64).strip()
        except OSError:
            sha = ""
        if _COMMIT.fullmatch(sha):
            return sha
        raise DataIdentityError(f"source hub={repo!r}: HF_HUB_OFFLINE=1 and this node has no record of which commit "
                                f"{revision or 'main'} names; set data.sources[].revision to the dataset's commit, "
                                "or run once where the hub can be reached")
    from huggingface_hub import HfApi

    try:
        sha = HfApi().dataset_info(repo, revision=revision or "main").sha
    except Exception as exc:  # noqa: BLE001 - any hub failure: say what to check
        raise DataIdentityError(f"source hub={repo!r}: cannot resolve revision {revision or 'main'} on the hub "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); "
                                "check the id, HF_TOKEN for a gated dataset, or give `path:` to a local copy") from None
    if not sha or not _COMMIT.fullmatch(sha):
        raise DataIdentityError(f"source hub={repo!r}: the hub answered no commit for {revision or 'main'}")
    return sha


def source_identity(src) -> dict[str, Any]:
    """One source as its address sees it: its settings, with `path` replaced by the file's content identity (and
    the reader its name chooses) and a hub id's revision by its commit."""
    out = src.model_dump(mode="json")
    if src.path:
        out.pop("path")
        out["name"] = src.label  # the `source` column the rows get (defaults to the file's stem)
        out["file"] = {"reader": _suffix(src.path), **file_identity(src.path)}
    elif src.hub:
        out["revision"] = dataset_commit(src.hub, src.revision)
    return out


# Data keys that change how fast prepare runs, not one byte of what it writes (the encoding processes).
DATA_SCHEDULING_KEYS = {"workers"}


def data_identity(data) -> dict[str, Any]:
    """The data section as the prepare address hashes it: each path source by content, each hub source at a commit,
    without the scheduling keys. A config of presets only is the section as it was (the demo keeps its addresses)."""
    out = data.model_dump(mode="json", exclude=DATA_SCHEDULING_KEYS)
    out["sources"] = [source_identity(s) if (s.path or s.hub) else s.model_dump(mode="json") for s in data.sources]
    return out


def pin_data(cfg, overrides: list[str]) -> list[str]:
    """At a run's start: every hub source without a commit is resolved ONCE and pinned in `cfg` and in the
    overrides the run's children and records get (the whole `data.sources` list: an override replaces a list),
    so every task and node of the run reads one version of the dataset."""
    hubs = [s for s in cfg.data.sources if s.hub and not (s.revision and _COMMIT.fullmatch(s.revision))]
    if not hubs:
        return overrides
    for s in hubs:
        commit = dataset_commit(s.hub, s.revision)
        log.info(f"data: {s.hub} revision {s.revision or 'main'} is commit {commit}")
        s.revision = commit
    listed = json.dumps([s.model_dump(mode="json", exclude_defaults=True) for s in cfg.data.sources])
    return [*overrides, f"data.sources={listed}"]
