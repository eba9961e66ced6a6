"""Many manifests of one S3 folder in a few requests: one LIST that names each committed manifest with its ETag,
and an index file of manifests that a sharded stage's parent writes when the stage ends.

A store the Kimi preset fills holds 1,024 extraction and 512 regeneration shard manifests. Read one GET each,
`draftline ls` spends ~2 ms of client CPU per manifest in botocore (signing, hooks, parsing: no single hot
spot), ~4 s in all (benchmarks/RESULTS.md, "Listing commands on the preset's store"). Here:

- `list_folder`: one paged LIST of STAGE/ with the delimiter `/draftline-`, which rolls each digest's attempt
  folders (`draftline-attempt-...`, tasks/core/owners.py) up into one prefix and leaves each
  `DIGEST/manifest.json` as a key with its ETag (a 1,024-shard folder: ~2,000 entries, 2-3 pages). A server that
  does not roll up as asked (it ignores the delimiter, or knows only `/`) is noticed and the caller reads every
  manifest as before.
- An index, `STAGE/draftline-index-<32 hex>.json`: `{"stage": STAGE, "manifests": {DIGEST: the manifest's
  bytes, as read}}`, written by `write_index` (flows/shard_nodes.py, at a sharded stage's end). An entry is used only
  where the MD5 of its bytes is the ETag the LIST gave for that digest's manifest (S3's ETag of an object put in
  one request), so an index, stale or planted, can never show other bytes than the manifest on the store: it
  saves the GET, nothing else; the bytes are then checked as a GET's would be (tasks/store/manifests.py
  `parse`). Where ETags are not MD5s (SSE-KMS), nothing matches and every manifest is read as before.

A file:// store reads its manifests from the local disk, as fast as that goes: neither is used there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from tasks.core.errors import DraftlineError
from tasks.store.model import MANIFEST
from tasks.store.trust import NAME_RE, RefusedStoreFile, check_name, read_capped

INDEX_PREFIX = "draftline-index-"
ROLL_UP = "/draftline-"  # every attempt folder's name starts so (tasks/core/owners.py owned_name; a test pins it)
INDEX_CAP = 64 << 20  # 1,024 extraction manifests of the preset (~60 parts listed each): ~10 MB
INDEXES_READ = 8  # the newest indexes read at most per folder (each stage run over other shards leaves one)
MANY = 16  # fewer manifests than this are read one GET each: a LIST and an index cost more than they save


class NotRolledUp(DraftlineError, RuntimeError):
    """The server did not roll the attempt folders up as asked: read every manifest instead."""


@dataclass
class Folder:
    """What one LIST says of a stage's folder: each committed manifest's ETag by digest, the digests with an
    attempt folder, the index files (newest first). Never trusted for what is *not* there: SeaweedFS 4.48 drops a
    manifest whose digest's rolled-up prefix ends a page (its next page starts after the whole folder), so a
    digest without an ETag here is read by a GET, as before."""

    etags: dict[str, str] = field(default_factory=dict)
    attempted: set[str] = field(default_factory=set)
    indexes: list[str] = field(default_factory=list)

    def digests(self) -> set[str]:
        return set(self.etags) | self.attempted


def listable(store: Any) -> bool:
    """An S3 store (s3fs): a file:// store reads its manifests from the local disk, as fast as that goes."""
    return not store.is_local and hasattr(store.fs, "_iterdir")


def usable(store: Any, count: int = MANY) -> bool:
    """Whether COUNT manifests of one folder are better read through its LIST and indexes."""
    return listable(store) and count >= MANY


def list_folder(store: Any, stage: str) -> Folder | None:
    """The LIST of STAGE's folder (module docstring); None where the server does not roll up as asked."""
    from fsspec.asyn import sync

    bucket, _, prefix = store.key(check_name("stage", stage)).partition("/")
    prefix += "/"

    async def walk() -> Folder:
        out, dated = Folder(), []
        async for e in store.fs._iterdir(bucket, delimiter=ROLL_UP, prefix=prefix):
            rest = e["Key"].split("/", 1)[1][len(prefix):]
            if e.get("type") == "directory":
                if not (e["Key"] + ROLL_UP[-1]).endswith(ROLL_UP):  # s3fs drops a prefix's last character
                    raise NotRolledUp(e["Key"])
                out.attempted.add(rest.split("/", 1)[0])
                continue
            if ROLL_UP in rest:
                raise NotRolledUp(rest)
            digest, _, name = rest.partition("/")
            if name == MANIFEST and NAME_RE.match(digest) and e.get("ETag"):
                out.etags[digest] = e["ETag"].strip('"')
            elif not name and digest.startswith(INDEX_PREFIX) and digest.endswith(".json") and e["size"] <= INDEX_CAP:
                dated.append((str(e.get("LastModified", "")), e["Key"]))  # one over the cap is never read
        out.indexes = [k for _, k in sorted(dated, reverse=True)]
        return out

    try:
        return sync(store.fs.loop, walk)
    except Exception:  # not rolled up, or refused (a delimiter other than '/'): each manifest is read by a GET,
        return None  # whose own errors say what is wrong with the store


def from_indexes(store: Any, folder: Folder, wanted: set[str]) -> dict[str, bytes]:
    """The manifests' bytes of WANTED (digests) that FOLDER's indexes hold as the store does (their MD5 is the
    manifest's ETag), read newest index first until every one is found or INDEXES_READ are read."""
    out: dict[str, bytes] = {}
    left = {d for d in wanted if d in folder.etags}
    for key in folder.indexes[:INDEXES_READ]:
        if not left:
            break
        try:
            held = json.loads(read_capped(store.fs, key, INDEX_CAP, False)).get("manifests", {})
        except (FileNotFoundError, RefusedStoreFile, ValueError, AttributeError):
            continue  # gone meanwhile, too big, or not JSON: its manifests are read one by one
        if not isinstance(held, dict):
            continue
        for digest in list(left):
            raw = held.get(digest)
            if isinstance(raw, str) and etag_of(raw.encode()) == folder.etags[digest]:
                out[digest] = raw.encode()
                left.discard(digest)
    return out


def etag_of(body: bytes) -> str:
    """S3's ETag of an object put in one request: the MD5 of its bytes (a checksum here, not a secret)."""
    return hashlib.md5(body, usedforsecurity=False).hexdigest()


def index_key(store: Any, stage: str, digests: list[str]) -> str:
    """One index per set of shards: a stage run again over the same shards replaces its own."""
    name = hashlib.sha256("\n".join(sorted(digests)).encode()).hexdigest()[:32]
    return store.key(check_name("stage", stage), f"{INDEX_PREFIX}{name}.json")


def write_index(store: Any, stage: str, manifests: dict[str, bytes], folder: Folder | None) -> str | None:
    """Write the index of MANIFESTS (digest -> the manifest's bytes as read from the store, whichever draftline
    version wrote them) in STAGE's folder (FOLDER: its LIST); its key, or None where none is written: nothing to
    index, one not UTF-8, too big, or the same index already there (a cached run writes nothing)."""
    if not manifests:
        return None
    try:
        held = {d: raw.decode() for d, raw in sorted(manifests.items())}
    except UnicodeDecodeError:
        return None
    body = json.dumps({"stage": stage, "manifests": held}).encode()
    key = index_key(store, stage, list(manifests))
    if len(body) > INDEX_CAP:
        return None
    if folder is not None and key in folder.indexes:
        with contextlib.suppress(FileNotFoundError, RefusedStoreFile):
            if read_capped(store.fs, key, INDEX_CAP, False) == body:
                return None
    store.fs.pipe_file(key, body)  # one PUT: a reader sees the old index or the new
    return key
