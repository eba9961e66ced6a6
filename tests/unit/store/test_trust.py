"""A store writer's plants never redirect or block a reader (tasks/store/trust.py), on a local folder and on the
real S3 server: a manifest is the manifest of the address it was read from, the extract stage's shard list is the
one its address is made of, small store files are read with a byte cap and only as regular files."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import pytest

from tasks.address import digests
from tasks.extract.shards import ExtractError, extract_shards
from tasks.store.artifacts import ArtifactCorrupt, ArtifactMissing, Store, MANIFEST
from tasks.store.leases import read_lock


def _commit(store: Store, stage: str, digest: str, payload: bytes, inputs=None, stats=None) -> None:
    with store.write(stage, digest, "v1", inputs or {}, {}) as w:
        w.write_bytes("data.bin", payload)
        w.commit(stats or {})


def _plant(store: Store, stage: str, digest: str, manifest: dict) -> None:
    store.fs.pipe_file(store.key(stage, digest, MANIFEST), json.dumps(manifest).encode())
    if not store.is_local:
        store.fs.invalidate_cache()


def test_a_manifest_naming_another_address_is_refused(store):
    """A manifest copied (or written) into `prepare/B/` that says it is `prepare/A` would have B's readers read A's
    files: its own stage/digest must be the folder's."""
    _commit(store, "prepare", "aaaa", b"the real rows")
    body = store.manifest("prepare", "aaaa").model_dump(mode="json")
    _plant(store, "prepare", "bbbb", body)  # says digest "aaaa"
    assert store.find("prepare", "bbbb") is None
    with pytest.raises(ArtifactCorrupt, match="says it is 'prepare'/'aaaa', not prepare/bbbb"):
        store.open("prepare", "bbbb")
    assert store.open("prepare", "aaaa").read_bytes("data.bin") == b"the real rows"  # the real one still reads


def test_a_manifest_digest_of_dot_dots_never_resolves_outside_a_file_root(tmp_path):
    """The hole: `Artifact.key` joined the manifest's own digest, so a body naming `../../outside` read (and
    checksum-verified) a file outside the file:// root."""
    root = tmp_path / "store"
    store = Store(f"file://{root}")
    _commit(store, "prepare", "good", b"x")
    secret = b"outside the store"
    out = tmp_path / "outside" / "a1"
    out.mkdir(parents=True)
    (out / "data.bin").write_bytes(secret)
    body = store.manifest("prepare", "good").model_dump(mode="json")
    body.update(digest="../../outside", attempt="a1",
                files=[{"path": "data.bin", "bytes": len(secret), "sha256": hashlib.sha256(secret).hexdigest()}])
    _plant(store, "prepare", "planted", body)
    assert store.find("prepare", "planted") is None
    with pytest.raises(ArtifactCorrupt, match="not prepare/planted"):
        store.open("prepare", "planted").read_bytes("data.bin")


def test_the_extract_stage_manifest_cannot_redirect_training_to_other_shards(store):
    """The extract stage's address is the digest of its shards' addresses: a 300-byte manifest naming other
    (committed, valid) shards is refused, never trained from."""
    real, other = "e" * 32, "f" * 32
    _commit(store, "extract", real, b"real hidden states", stats={"shard": 0})
    _commit(store, "extract", other, b"someone else's", stats={"shard": 0})
    address = digests.extract_stage([real])
    _commit(store, digests.EXTRACT_STAGE, address, b"", inputs={"shard-0": real})
    ref = store.open(digests.EXTRACT_STAGE, address).ref()
    assert [r.digest for r in extract_shards(store, ref)] == [real]
    body = store.manifest(digests.EXTRACT_STAGE, address).model_dump(mode="json")
    body["inputs"] = {"shard-0": other}
    _plant(store, digests.EXTRACT_STAGE, address, body)
    with pytest.raises(ExtractError, match="names shards whose addresses are not the ones its address is made of"):
        extract_shards(store, ref)
    body["inputs"] = {"shard-0": real, "shard-1": other}  # one shard added
    _plant(store, digests.EXTRACT_STAGE, address, body)
    with pytest.raises(ExtractError, match="not the ones its address is made of"):
        extract_shards(store, ref)


def test_the_extract_stage_writes_no_unread_shard_list(tmp_path):
    """`shards.json` was written and never read: a second list nobody checked. The manifest's inputs, checked
    against the address, are the only list."""
    from tasks.extract.stage import _assemble
    from tasks.core.config import RunConfig
    from tasks.store.artifacts import ArtifactRef

    store = Store(f"file://{tmp_path}/s")
    _commit(store, "extract", "e" * 32, b"h", stats={"shard": 0, "layer_ids": [1, 2, 3]})
    shard = store.open("extract", "e" * 32).ref()
    ref = _assemble(RunConfig(), store, [shard], 0.0, 0, digests.extract_stage([shard.digest]))
    assert store.open(ref.stage, ref.digest).files() == []
    assert [r.digest for r in extract_shards(store, ref)] == [shard.digest]


def _unblock(fifo: Path) -> None:
    """Open the FIFO's write end and close it: a reader blocked on it sees the end of the file."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_a_fifo_planted_as_a_lock_or_a_manifest_never_blocks_a_reader(tmp_path):
    """The hole: a lock file (and a manifest) was read with a plain read, so a FIFO planted at its name blocked the
    reader forever. Now it is refused at once as not a regular file."""
    store = Store(f"file://{tmp_path}/s")
    lock = tmp_path / "s" / "_locks" / "prepare-x.lock"
    lock.parent.mkdir(parents=True)
    os.mkfifo(lock)
    manifest = tmp_path / "s" / "prepare" / "fifo" / MANIFEST
    manifest.parent.mkdir(parents=True)
    os.mkfifo(manifest)
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(lock=read_lock(lock), found=store.find("prepare", "fifo")),
                         daemon=True)
    t.start()
    t.join(10)
    blocked = t.is_alive()
    for f in (lock, manifest):
        _unblock(f)
    t.join(5)
    assert not blocked, "a reader blocked on a FIFO planted in the store"
    assert got == {"lock": {}, "found": None}
    with pytest.raises(ArtifactCorrupt, match="not a regular file"):
        store.open("prepare", "fifo")


def test_a_huge_file_planted_as_a_manifest_or_lock_is_not_read_whole(tmp_path):
    """A (sparse) 1 GB file at a manifest's or a lock's name is refused by its size, never read into memory."""
    store = Store(f"file://{tmp_path}/s")
    manifest = tmp_path / "s" / "prepare" / "huge" / MANIFEST
    manifest.parent.mkdir(parents=True)
    with open(manifest, "wb") as fh:
        fh.truncate(1 << 30)
    with pytest.raises(ArtifactCorrupt, match="larger than the"):
        store.open("prepare", "huge")
    lock = tmp_path / "s" / "_locks" / "x.lock"
    lock.parent.mkdir(parents=True)
    with open(lock, "wb") as fh:
        fh.truncate(1 << 30)
    assert read_lock(lock) == {}


def test_a_symlink_planted_as_a_manifest_is_not_followed(tmp_path):
    """A link at a manifest's name (to a file outside the store) is not read: draftline writes regular files."""
    store = Store(f"file://{tmp_path}/s")
    _commit(store, "prepare", "real", b"r")
    link = tmp_path / "s" / "prepare" / "linked" / MANIFEST
    link.parent.mkdir(parents=True)
    link.symlink_to(tmp_path / "s" / "prepare" / "real" / MANIFEST)
    with pytest.raises((ArtifactCorrupt, ArtifactMissing)):
        store.open("prepare", "linked")


def test_gc_never_takes_a_live_attempt_of_another_container_with_the_same_host_name(store, monkeypatch):
    """Two containers with one host name, one kernel (one boot id) and no machine id (the usual container) sharing
    a store: the other's pids are not this one's, so its writer cannot be checked from here. Its attempt is kept
    while its lease is fresh, never taken as a dead writer's."""
    import socket
    import time

    from tasks.core import owners

    monkeypatch.setattr(owners, "_machine_id", lambda: "")  # a container without /etc/machine-id
    w = store.writer("extract", "other-container", "v1")
    w.write_bytes("part-00000.safetensors", b"x" * 1000)
    now = time.time()
    other = {"host": socket.gethostname(), "boot": owners._boot_id(), "machine": "", "pidns": "pid:[4026530000]",
             "pid": 4_000_000, "start": 1, "since": now, "beat": now}  # a pid no process here has
    key = store.key("extract", "other-container", w.attempt, owners.OWNER_FILE)
    store.fs.pipe_file(key, json.dumps(other).encode())
    assert owners.alive(other) is None  # cannot be told from here
    assert store.garbage(min_age_s=3600) == []
    assert owners.alive({**owners.me(), "pid": 4_000_000}) is False  # this container's own dead writer: told
