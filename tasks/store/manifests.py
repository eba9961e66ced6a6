"""Reading manifests, one or many at once (Store.manifest, Store.manifests, Store.list, Store.find_many), and the
sizes and whole small files they name.

A store the Kimi preset fills holds 1,024 shard manifests: read one request after another, `draftline ls`,
`check` and `plan --from-store` wait on a round trip each (benchmarks/RESULTS.md, "The store at the preset's
size"). fsspec's `cat` of a list fetches them concurrently (s3fs: its batch of concurrent GETs); on a
file:// store it reads them in turn, which is as fast as a local disk goes. What a manifest names is
untrusted (docs/ARTIFACTS.md): a path that leaves its artifact's folder is never used.
"""

from __future__ import annotations

from typing import Any

from tasks.store import manifest_index
from tasks.store.model import MANIFEST, ArtifactCorrupt, Manifest
from tasks.store.trust import (MANIFEST_CAP, RefusedStoreFile, check_manifest_address, check_name, check_relpath,
                               read_capped)


def read_manifests(store: Any, stage: str, digests: list[str], skip_unsafe: bool = False,
                   folder: manifest_index.Folder | None = None, as_read: dict[str, bytes] | None = None,
                   ) -> dict[str, Manifest | None]:
    """The committed manifest of each of DIGESTS under STAGE, None where there is none or it is unreadable.
    A manifest naming a path outside its folder raises ArtifactCorrupt, or, with SKIP_UNSAFE (a listing),
    reads as None. On S3, many at once come from the folder's LIST and its indexes where they can
    (tasks/store/manifest_index.py; FOLDER: that LIST, when the caller made it), the rest by concurrent GETs.
    AS_READ, when given, gets each usable manifest's bytes as the store holds them (what an index keeps)."""
    keys = {store.key(check_name("stage", stage), check_name("digest", d), MANIFEST): d for d in digests}
    if not keys:
        return {}
    if store.is_local:  # one at a time, each only as a capped regular file (a planted FIFO or link is refused)
        raws: dict[str, object] = {}
        for key in keys:
            try:
                raws[key] = read_capped(store.fs, key, MANIFEST_CAP, True)
            except (FileNotFoundError, RefusedStoreFile) as exc:
                raws[key] = exc
        strip = str
    else:
        strip = store.fs._strip_protocol
        raws = {}
        if folder is None and manifest_index.usable(store, len(keys)):
            folder = manifest_index.list_folder(store, stage)
        if folder is not None:  # what an index holds as the LIST saw it; any other manifest is read by a GET
            held = manifest_index.from_indexes(store, folder, set(keys.values()))
            raws = {strip(key): held[d] for key, d in keys.items() if d in held}
        todo = [key for key in keys if strip(key) not in raws]
        if todo:
            got = store.fs.cat(todo, on_error="return", **read_options(store.fs))
            if not isinstance(got, dict):  # fsspec answers one path with its bytes
                got = {todo[0]: got}
            raws |= {strip(k): v for k, v in got.items()}
    out: dict[str, Manifest | None] = {}
    for key, digest in keys.items():
        raw = raws.get(strip(key))
        if isinstance(raw, FileNotFoundError) or raw is None:
            out[digest] = None
        elif isinstance(raw, RefusedStoreFile) or (isinstance(raw, bytes) and len(raw) > MANIFEST_CAP):
            if not skip_unsafe:
                raise ArtifactCorrupt(str(raw) if isinstance(raw, RefusedStoreFile) else
                                      f"{key}: over {MANIFEST_CAP} bytes, not a manifest draftline wrote; delete it")
            out[digest] = None
        elif isinstance(raw, BaseException):
            raise raw
        else:
            out[digest] = parse(store, stage, digest, key, raw, skip_unsafe)
            if out[digest] is not None and as_read is not None:
                as_read[digest] = raw
    return out


def parse(store: Any, stage: str, digest: str, key: str, raw: bytes, skip_unsafe: bool) -> Manifest | None:
    try:
        m = Manifest.model_validate_json(raw)
    except Exception:
        return None  # an unreadable manifest is not a committed artifact
    try:  # a manifest of another address (`../../outside`, another digest) is never used
        check_manifest_address(m, stage, digest, store.uri_of(stage, digest))
    except RefusedStoreFile as exc:
        if skip_unsafe:
            return None
        raise ArtifactCorrupt(str(exc)) from None
    try:  # paths from the store are untrusted: one that leaves the artifact's folder is never used
        check_name("attempt", m.attempt)
        for f in m.files:
            check_relpath(f.path)
    except ValueError as exc:
        if skip_unsafe:
            return None
        raise ArtifactCorrupt(
            f"{store.uri_of(stage, digest)}: its manifest names a path that leaves the artifact's folder "
            f"({exc}); draftline never writes one, so nothing was read or written from it: delete {key} "
            "(the stage is then recomputed)") from None
    return m


def file_sizes(store: Any, keys: list[str]) -> dict[str, int | None]:
    """The size of each of KEYS, None where the file is missing: on S3 asked at once (s3fs's concurrent
    HEADs), not one request after another (`Store.find_many` checks a stage's 512 shards' files)."""
    if store.is_local or not hasattr(store.fs, "_size"):
        out: dict[str, int | None] = {}
        for key in keys:
            try:
                out[key] = store.fs.size(key)
            except FileNotFoundError:
                out[key] = None
        return out
    from fsspec.asyn import _run_coros_in_chunks, sync

    got = sync(store.fs.loop, _run_coros_in_chunks, [store.fs._size(k) for k in keys], return_exceptions=True)
    for g in got:
        if isinstance(g, BaseException) and not isinstance(g, FileNotFoundError):
            raise g
    return {k: None if isinstance(g, BaseException) else g for k, g in zip(keys, got)}


def read_options(fs: Any, nbytes: int = 0) -> dict[str, int]:
    """`cat`/`cat_file` options for reading whole files of NBYTES each (manifests: small, the default): one GET
    per file. With `max_concurrency` above 1 (tasks/store/uploads.py's upload_options sets it), s3fs asks every
    file's size first (a HEAD) to split one larger than its block over concurrent ranged GETs; for a smaller file
    that HEAD doubles the requests (a listing's 1,024 manifests: 2,048), so it is asked only where the split can
    happen."""
    if not hasattr(fs, "_call_s3") or nbytes > int(getattr(fs, "default_block_size", 0) or 0):
        return {}
    return {"max_concurrency": 1}

