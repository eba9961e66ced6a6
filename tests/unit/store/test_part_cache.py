"""The node-local part cache (tasks/store/part_cache.py) against the real S3 server, and the deal of parts to
ranks that makes it pay (tasks/train/stream.py): each byte over the network once per node."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from tasks.core.config import StoreConfig
from tasks.store.part_cache import PartCache, PartCacheError, cached_copy
from tasks.store.artifacts import Store
from tasks.train.stream import BatchStream, PartReader, PartSpec, deal

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_part_cache import count_gets  # noqa: E402


@pytest.fixture
def s3(s3_server) -> Store:
    return Store.from_config(StoreConfig(uri=f"s3://draftline-test/{uuid.uuid4().hex[:12]}"))


def blob_artifact(store: Store, sizes: list[int], seed: int = 0):
    """An artifact of random files `f{i}.bin` of the given sizes."""
    g = torch.Generator().manual_seed(seed)
    with store.write("extract", f"blobs{uuid.uuid4().hex[:12]}", "v1") as w:
        for i, n in enumerate(sizes):
            w.write_bytes(f"f{i}.bin", torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes())
        return w.commit()


CHILD = """
import json, sys
from tasks.core.config import StoreConfig
from tasks.store.part_cache import PartCache
from tasks.store.artifacts import Store
a = json.loads(sys.argv[1])
store = Store.from_config(StoreConfig(uri=a["store"]))
art = store.open("extract", a["digest"])
entry = art.manifest.file(a["name"])
cache = PartCache(a["root"], cap_gib=1)
print("ready", flush=True)
sys.stdin.readline()  # all children start their lease at once
lease = cache.lease(entry.sha256, entry.bytes, lambda fh: art.copy_to(a["name"], fh, chunk=a["chunk"], inflight=1))
print(json.dumps({"fetched": lease.fetched, "path": lease.path}), flush=True)
"""


def child(tmp_path: Path, store: Store, art, name: str, chunk: int, **env) -> subprocess.Popen:
    args = json.dumps({"store": store.uri, "digest": art.digest, "name": name, "root": str(tmp_path / "cache"),
                       "chunk": chunk})
    return subprocess.Popen([sys.executable, "-c", CHILD, args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), **env})


def test_a_killed_filler_leaves_a_temp_file_that_is_never_data_and_is_cleaned(tmp_path, s3, monkeypatch):
    art = blob_artifact(s3, [256 * 1024])
    entry = art.manifest.file("f0.bin")
    p = child(tmp_path, s3, art, "f0.bin", chunk=4096, DRAFTLINE_FAULT_KILL="cache.mid-fill")
    assert p.stdout.readline().strip() == "ready"
    p.stdin.write("go\n")
    p.stdin.flush()
    assert p.wait(timeout=120) == -signal.SIGKILL, p.stderr.read()[-2000:]

    cache = PartCache(tmp_path / "cache", cap_gib=1)
    temps = list((tmp_path / "cache" / "tmp").iterdir())
    assert len(temps) == 1 and 0 < temps[0].stat().st_size < entry.bytes  # killed mid-fill
    assert not cache.path(entry.sha256).exists() and cache.entries() == []  # not data
    assert [t[0] for t in cache.dead_temps()] == temps  # `draftline gc` lists it

    from cli.leftovers import find

    monkeypatch.setenv("DRAFTLINE_CACHE_DIR", str(tmp_path / "cache"))
    assert [x.where for x in find(s3, 3600) if x.kind == "cache-temp"] == [str(temps[0])]

    with cache.lease(entry.sha256, entry.bytes, lambda fh: art.copy_to("f0.bin", fh)) as lease:
        assert lease.fetched == entry.bytes
        assert hashlib.sha256(Path(lease.path).read_bytes()).hexdigest() == entry.sha256
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []  # the next filler removed the dead one's file


def test_ranks_filling_the_same_part_at_once_download_it_once(tmp_path, s3):
    art = blob_artifact(s3, [512 * 1024])
    entry = art.manifest.file("f0.bin")
    procs = [child(tmp_path, s3, art, "f0.bin", chunk=16 * 1024) for _ in range(3)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()[-2000:]
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["fetched"] for r in results) == [0, 0, entry.bytes]  # one filler, two waited and reused
    assert len({r["path"] for r in results}) == 1
    assert hashlib.sha256(Path(results[0]["path"]).read_bytes()).hexdigest() == entry.sha256


def test_a_corrupt_or_truncated_cached_file_is_detected_and_fetched_again(tmp_path, s3):
    art = blob_artifact(s3, [100_000])
    entry = art.manifest.file("f0.bin")
    fill = lambda fh: art.copy_to("f0.bin", fh)  # noqa: E731
    with PartCache(tmp_path, cap_gib=1).lease(entry.sha256, entry.bytes, fill) as lease:
        path = Path(lease.path)
    raw = bytearray(path.read_bytes())
    raw[5000] ^= 0xFF
    path.write_bytes(bytes(raw))  # a flipped bit, same size

    cache = PartCache(tmp_path, cap_gib=1)  # another process: it hashes the entry before its first use
    with cache.lease(entry.sha256, entry.bytes, fill) as lease:
        assert lease.fetched == entry.bytes and cache.stats.refetched_corrupt == 1
        assert hashlib.sha256(Path(lease.path).read_bytes()).hexdigest() == entry.sha256
    with cache.lease(entry.sha256, entry.bytes, fill) as lease:
        assert lease.fetched == 0 and cache.stats.hits == 1  # now good: a hit, not hashed again

    path.write_bytes(path.read_bytes()[:1000])  # truncated
    with cache.lease(entry.sha256, entry.bytes, fill) as lease:
        assert lease.fetched == entry.bytes and cache.stats.refetched_corrupt == 2


def test_the_cap_evicts_the_least_recently_used_part_never_a_leased_one(tmp_path, s3, caplog):
    size = 100_000
    art = blob_artifact(s3, [size] * 4)
    entries = [art.manifest.file(f"f{i}.bin") for i in range(4)]
    cache = PartCache(tmp_path, cap_gib=2.5 * size / (1 << 30))  # room for two parts

    def lease(i):
        return cache.lease(entries[i].sha256, size, lambda fh: art.copy_to(f"f{i}.bin", fh))

    for i in (0, 1):
        lease(i).release()
    os.utime(cache.path(entries[0].sha256), (1, 1))  # f0 used longest ago
    lease(2).release()
    held = {sha for sha, _, _ in cache.entries()}
    assert held == {entries[1].sha256, entries[2].sha256} and cache.stats.evicted == 1

    os.utime(cache.path(entries[1].sha256), (1, 1))  # f1 is now the oldest, but a live reader holds it
    keep = lease(1)
    assert keep.fetched == 0
    os.utime(cache.path(entries[1].sha256), (1, 1))
    lease(3).release()
    assert {sha for sha, _, _ in cache.entries()} == {entries[1].sha256, entries[3].sha256}  # f2 went, not f1
    assert Path(keep.path).exists()
    keep.release()

    tiny = PartCache(tmp_path / "tiny", cap_gib=size / 2 / (1 << 30))
    with pytest.raises(PartCacheError, match=r"larger than the part cache's cap .* raise train.cache_gib"):
        tiny.lease(entries[0].sha256, size, lambda fh: art.copy_to("f0.bin", fh))


# ============================================================================ affinity


def specs(n: int) -> list[PartSpec]:
    return [PartSpec(index=i, shard=i // 4, digest=f"d{i // 4}", name=f"part-{i:05d}.safetensors") for i in range(n)]


def test_parts_are_dealt_once_and_each_rank_reads_its_share_every_epoch():
    parts = specs(10)
    shares = deal(10, seed=7, world=4)
    assert sorted(i for s in shares for i in s) == list(range(10)) and {len(s) for s in shares} == {2, 3}
    assert deal(10, seed=7, world=4) == shares  # deterministic: every node and every resume computes the same
    for rank in range(4):
        s = BatchStream(parts, lambda p: None, batch_tokens=16, seed=7, rank=rank, world=4, prefetch=0)
        orders = [[p.index for p in s.part_order(e)] for e in range(6)]
        assert all(sorted(o) == shares[rank] for o in orders)  # the same share every epoch...
        if len(shares[rank]) == 3:
            assert len({tuple(o) for o in orders}) > 1  # ...in a new order
    assert deal(10, seed=7, world=3) != shares[:3]  # another rank count: another deal
    one = BatchStream(parts, lambda p: None, batch_tokens=16, seed=7, prefetch=0)
    assert sorted(p.index for p in one.part_order(0)) == list(range(10))


def test_three_epochs_through_the_cache_read_each_part_once_per_node_and_resume_exactly(tmp_path, s3):
    """Two nodes of two ranks each, parts on S3 (the extraction layout): each node fetches only its
    ranks' shares, once, over three epochs; a rank restarted from a position continues exactly."""
    from train_data import make_tiny_target, generate_samples, write_extract

    target = make_tiny_target(tmp_path / "target")
    samples = generate_samples(target, 16, prompt_len=4, new_tokens=12)
    refs = write_extract(s3, target, samples, [1, 2, 3, 4], shards=2, part_samples=2)
    arts = {r.digest: s3.open("extract", r.digest) for r in refs}
    names = [(r.digest, n) for r in refs for n in sorted(arts[r.digest].files("part-"))]
    parts = [PartSpec(index=i, shard=0, digest=d, name=n) for i, (d, n) in enumerate(names)]
    sizes = {(p.digest, p.name): arts[p.digest].manifest.file(p.name).bytes for p in parts}
    got = count_gets(s3)
    world, per_node = 4, 2
    caches = [PartCache(tmp_path / f"node{n}", cap_gib=1) for n in range(world // per_node)]
    streams, tokens = [], 0
    for rank in range(world):
        reader = PartReader(arts, [1, 2, 3, 4], 64, cache=caches[rank // per_node])
        streams.append(BatchStream(parts, reader, batch_tokens=32, seed=1, rank=rank, world=world, prefetch=0))
    for s in streams:
        while s.position["epoch"] < 3:
            s.next()
    total = sum(sizes.values())
    assert sum(got) == total  # every byte once: each node read its own ranks' shares, and only once
    for n, cache in enumerate(caches):
        mine = {(p.digest, p.name) for r in range(n * per_node, (n + 1) * per_node) for p in streams[r].share()}
        assert cache.stats.fetched_bytes == sum(sizes[k] for k in mine)
        assert cache.stats.hits >= 2 * len(mine)  # epochs 2 and 3 (and the epoch-3 peek) were hits
    # exact resume of rank 1 from its position mid-run
    s = BatchStream(parts, PartReader(arts, [1, 2, 3, 4], 64, cache=caches[0]), batch_tokens=32, seed=1, rank=1,
                    world=world, prefetch=0)
    first = [s.next() for _ in range(5)]
    again = BatchStream(parts, PartReader(arts, [1, 2, 3, 4], 64, cache=caches[0]), batch_tokens=32, seed=1,
                        rank=1, world=world, prefetch=2, position=first[1].position)
    try:
        for b in first[2:]:
            nb = again.next()
            assert torch.equal(nb.input_ids, b.input_ids) and torch.equal(nb.hidden_states, b.hidden_states)
    finally:
        again.close()


def test_cached_copy_without_a_cache_streams_a_temporary_copy(tmp_path, s3):
    art = blob_artifact(s3, [3 * 1024 * 1024 + 5])
    entry = art.manifest.file("f0.bin")
    with cached_copy(None, art, "f0.bin") as path:
        assert hashlib.sha256(Path(path).read_bytes()).hexdigest() == entry.sha256
    assert not Path(path).exists()


def test_a_part_corrupted_on_the_store_is_never_cached(tmp_path, s3):
    """The fill hashes while it streams: a store copy whose bytes changed (same size) raises ArtifactCorrupt
    naming the file, un-commits the artifact (so the stage runs again), and leaves no entry and no temp file."""
    from tasks.store.artifacts import ArtifactCorrupt

    art = blob_artifact(s3, [300_000])
    entry = art.manifest.file("f0.bin")
    key = art.key("f0.bin")
    raw = bytearray(s3.fs.cat_file(key))
    raw[123_456] ^= 0xFF
    s3.fs.pipe_file(key, bytes(raw))
    cache = PartCache(tmp_path, cap_gib=1)
    with pytest.raises(ArtifactCorrupt, match="f0.bin fails its size/sha256 check"):
        cache.lease(entry.sha256, entry.bytes, lambda fh: art.copy_to("f0.bin", fh, chunk=64 * 1024))
    assert cache.entries() == [] and list((tmp_path / "tmp").iterdir()) == []
    assert s3.find("extract", art.digest) is None


FULL_DISK_CHILD = """
import json, resource, sys
from tasks.store.part_cache import PartCache, PartCacheError
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # a write past 4 KiB fails (EFBIG), as a full disk's would
cache = PartCache(sys.argv[1], cap_gib=1)
try:
    cache.lease("ab" * 32, 65536, lambda fh: fh.write(b"x" * 65536))
    print(json.dumps({"error": None}))
except PartCacheError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def test_a_full_cache_disk_names_the_setting_and_leaves_no_entry(tmp_path):
    """A part that does not fit the cache's disk fails with what to change (train.cache_gib, the cache's folder),
    and neither an entry nor its temp file is left (tasks/core/errors.py full_disk_as, as the store's writer and
    prepare's spill use it)."""
    out = subprocess.run([sys.executable, "-c", FULL_DISK_CHILD, str(tmp_path / "cache")], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stderr[-2000:]
    msg = json.loads(out.stdout.strip().splitlines()[-1])["error"]
    assert msg and "the part cache's disk" in msg and "is full while caching a 0.00 GB part" in msg, msg
    assert "lower train.cache_gib (now 1.0 GiB)" in msg and "or point DRAFTLINE_CACHE_DIR at a bigger disk" in msg
    left = sorted(p.name for p in (tmp_path / "cache").rglob("*") if p.is_file() and "ab" * 32 in p.name)
    assert left == ["ab" * 32 + ".fill", "ab" * 32 + ".lease"], left  # its two locks only: no entry, no temp file
