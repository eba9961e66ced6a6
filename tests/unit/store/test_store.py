"""The artifact store, on a local folder and on a real S3 server (SeaweedFS)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tasks.core.config import StoreConfig
from tasks.store.artifacts import ArtifactCorrupt, ArtifactMissing, Store, StoreError
from tasks.store.trust import check_name


def _write(store: Store, digest: str, payload: bytes, stage: str = "prepare") -> None:
    with store.write(stage, digest, "v1", {"up": "x"}, {"k": 1}) as w:
        w.write_bytes("data/part-0.bin", payload)
        w.write_json("meta.json", {"n": len(payload)})
        w.commit({"rows": 3})


def test_commit_then_read_back(store):
    _write(store, "d1", b"abc" * 1000)
    art = store.open("prepare", "d1", checksums=True)
    assert art.read_bytes("data/part-0.bin") == b"abc" * 1000
    assert art.read_json("meta.json") == {"n": 3000}
    m = art.manifest
    assert m.stage == "prepare" and m.digest == "d1" and m.inputs == {"up": "x"} and m.stats == {"rows": 3}
    assert {f.path: f.bytes for f in m.files} == {"data/part-0.bin": 3000, "meta.json": len(json.dumps({"n": 3000}, indent=2))}
    assert [x.digest for x in store.list()] == ["d1"]
    with art.local_copy("data/part-0.bin") as p:
        assert open(p, "rb").read() == b"abc" * 1000


def test_exception_inside_writer_commits_nothing(store):
    with pytest.raises(RuntimeError, match="boom"):
        with store.write("prepare", "d2", "v1") as w:
            w.write_bytes("x.bin", b"1234")
            raise RuntimeError("boom")
    assert store.find("prepare", "d2") is None
    with pytest.raises(ArtifactMissing):
        store.open("prepare", "d2")
    assert store.list() == []


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.getcwd()
    return env


def test_writer_killed_before_manifest_leaves_nothing_visible(store):
    """A real SIGKILL while a writer is mid-artifact: readers see nothing, gc cleans up."""
    script = textwrap.dedent(f"""
        import sys, time
        from tasks.store.artifacts import Store
        s = Store({store.uri!r}, {store.storage_options!r})
        w = s.writer("extract", "dkill", "v1")
        w.write_bytes("part-00000.safetensors", b"x" * 100000)
        print("written", flush=True)
        time.sleep(60)
        w.commit()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=_child_env())
    assert proc.stdout.readline().strip() == b"written"
    assert store.garbage(min_age_s=0) == []  # its writer runs on this machine (its owner record says): kept
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert store.find("extract", "dkill") is None
    assert store.list() == []
    # The attempt's owner record names its writer (host, boot, pid): a dead writer's leftovers go at once.
    (detail,) = store.garbage_detail(min_age_s=3600)
    assert "/extract/dkill/draftline-attempt-" in detail["key"] and detail["kind"] == "attempt"
    assert (detail["owner"]["host"], detail["owner"]["pid"], detail["owner"]["alive"]) == (socket.gethostname(),
                                                                                           proc.pid, False)
    store.gc(min_age_s=3600)
    assert store.garbage(min_age_s=0) == []


def test_large_writes_are_hashed_while_written(store, monkeypatch):
    """Writes of 1 MiB or more are hashed on a helper thread while they are written; the manifest's
    sha256 is still that of the whole file, and a failed write still fails (after its hash ends)."""
    import hashlib

    from tasks.store import writer as store_mod

    payload = os.urandom(3 << 20) + b"tail"
    with store.write("prepare", "dbig", "v1") as w:
        with w.open("big.bin") as fh:
            fh.write(payload[:100])
            fh.write(memoryview(payload)[100:(2 << 20)])  # large: hashed in parallel
            fh.write(payload[(2 << 20):])
        w.commit()
    art = store.open("prepare", "dbig", checksums=True)
    assert art.manifest.file("big.bin").sha256 == hashlib.sha256(payload).hexdigest()
    assert art.read_bytes("big.bin") == payload

    hashed = []
    real_hasher = store_mod._hasher

    def spy():
        hashed.append(1)
        return real_hasher()

    class DiskFull:  # a store that takes no more bytes (file:// or S3: the one writer of both, open_for_write)
        def write(self, b):
            raise OSError("disk full")

    real_open_for_write = store_mod.open_for_write

    @contextlib.contextmanager
    def full(fs, key):
        with real_open_for_write(fs, key) as f:
            yield DiskFull() if key.endswith("x.bin") else f

    monkeypatch.setattr(store_mod, "_hasher", spy)
    monkeypatch.setattr(store_mod, "open_for_write", full)
    with pytest.raises(OSError, match="disk full"):
        with store.write("prepare", "dfail", "v1") as w:
            w.write_bytes("x.bin", payload)
    assert hashed and store.find("prepare", "dfail") is None


def test_corrupted_file_is_detected_and_uncommitted(store):
    _write(store, "d3", b"0123456789" * 100)
    art = store.open("prepare", "d3")
    key = art.key("data/part-0.bin")
    raw = bytearray(store.fs.cat_file(key))
    raw[10] ^= 0xFF  # same size, different bytes: only the checksum can tell
    store.fs.pipe_file(key, bytes(raw))
    assert store.find("prepare", "d3") is not None  # sizes still match
    with pytest.raises(ArtifactCorrupt, match="part-0.bin.*sha256"):
        store.open("prepare", "d3").read_bytes("data/part-0.bin")
    # Un-committed so the stage runs again; the evidence is kept beside it.
    assert store.find("prepare", "d3") is None
    names = [p.rsplit("/", 1)[-1] for p in store.fs.ls(store.key("prepare", "d3"), detail=False)]
    assert any(n.startswith("manifest.corrupt-") for n in names)


def test_a_stale_reader_that_hits_a_missing_file_leaves_a_newer_good_manifest(store):
    """A reader opened attempt 1; a newer writer committed attempt 2 and attempt 1's files went (gc, or the
    other writer's cleanup). The stale reader's miss fails its read, but the newer manifest stays committed."""
    _write(store, "d5", b"old" * 100)
    stale = store.open("prepare", "d5")
    _write(store, "d5", b"new" * 100)
    store.fs.rm(store.key("prepare", "d5", stale.manifest.attempt), recursive=True)
    with pytest.raises(ArtifactCorrupt, match="newer commit has replaced"):
        stale.copy_to("data/part-0.bin", io.BytesIO())
    with pytest.raises(ArtifactCorrupt, match="newer commit has replaced"):
        stale.verify_file("data/part-0.bin")
    fresh = store.find("prepare", "d5", checksums=True)
    assert fresh is not None and fresh.read_bytes("data/part-0.bin") == b"new" * 100
    names = [p.rsplit("/", 1)[-1] for p in store.fs.ls(store.key("prepare", "d5"), detail=False)]
    assert not any(n.startswith("manifest.corrupt-") for n in names)


def test_truncated_file_counts_as_missing(store):
    _write(store, "d4", b"z" * 5000)
    art = store.open("prepare", "d4")
    store.fs.pipe_file(art.key("data/part-0.bin"), b"z" * 10)
    assert store.find("prepare", "d4") is None


def test_two_concurrent_writers_of_one_digest_end_with_one_valid_artifact(store):
    barrier = threading.Barrier(2)
    errors = []

    def writer(tag: bytes):
        try:
            w = store.writer("extract", "dsame", "v1")
            w.write_bytes("part.bin", tag * 50000)
            barrier.wait()
            w.commit({"tag": tag.decode()})
        except Exception as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in (b"A", b"B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    art = store.open("extract", "dsame", checksums=True)
    data = art.read_bytes("part.bin")
    assert data == art.stats["tag"].encode() * 50000  # the manifest and its files agree
    store.gc(min_age_s=0)  # the losing attempt is garbage; the winner survives gc
    assert store.open("extract", "dsame", checksums=True).read_bytes("part.bin") == data


@pytest.mark.parametrize("bad", ["../up", "a/b", "", ".hidden", "x" * 200, "a..b"])
def test_names_from_data_cannot_escape_the_store(bad):
    with pytest.raises(ValueError, match="invalid"):
        check_name("sample id", bad)


def test_file_paths_cannot_escape_the_artifact(store):
    w = store.writer("prepare", "d5", "v1")
    for bad in ("../../etc/passwd", "/abs", "a//b", "./x"):
        with pytest.raises(ValueError):
            w.write_bytes(bad, b"x")
    w.abort()


def test_s3_wrong_credentials_named(s3_server, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    st = Store.from_config(StoreConfig(uri="s3://draftline-test/x"))
    with pytest.raises(StoreError, match="credentials"):
        st.check()


def test_s3_missing_bucket_named(s3_server):
    st = Store.from_config(StoreConfig(uri="s3://no-such-bucket-here/x"))
    with pytest.raises(StoreError, match="bucket 'no-such-bucket-here' does not exist"):
        st.check()


def test_s3_unreachable_named(s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    st = Store.from_config(StoreConfig(uri="s3://draftline-test/x"))
    t0 = time.time()
    with pytest.raises(StoreError, match="unreachable"):
        st.check()
    assert time.time() - t0 < 60


@pytest.mark.parametrize("n", [3, 150])
def test_listing_reads_every_manifest_at_once_and_skips_missing_unsafe_and_unreadable_ones(store, n, monkeypatch):
    """Store.list and Store.manifests (the concurrent reads behind `draftline ls`, `check`, `plan --from-store`)
    at two counts: every committed manifest, none twice; a folder without a manifest, an unreadable manifest and
    one naming a path outside its folder list as nothing; asked for one by digest, the unsafe one is refused."""
    for i in range(n):
        with store.write("extract", f"s{i:04d}", "v1") as w:
            w.write_bytes("p.bin", b"x")
            w.commit({"shard": i})
    good = store.manifest("extract", "s0000")
    unsafe = good.model_copy(update={"digest": "unsafe"})
    unsafe.files[0].path = "../../escaped"
    store.fs.pipe_file(store.key("extract", "unsafe", "manifest.json"), unsafe.model_dump_json().encode())
    store.fs.pipe_file(store.key("extract", "garbled", "manifest.json"), b"{not json")
    store.fs.pipe_file(store.key("extract", "uncommitted", "a1", "p.bin"), b"x")  # an attempt, no manifest
    calls: list[str] = []  # on S3, the requests the listing makes (each goes to the real server)
    if not store.is_local:
        real_call = store.fs._call_s3

        async def counted(method, *args, **kwargs):
            calls.append(method)
            return await real_call(method, *args, **kwargs)

        monkeypatch.setattr(store.fs, "_call_s3", counted)
    listed = store.list("extract")
    assert sorted(m.stats["shard"] for m in listed) == list(range(n))
    if not store.is_local:  # one GET per folder's manifest, no HEAD before it (that doubled the requests)
        assert calls.count("get_object") == n + 3 and "head_object" not in calls, sorted(set(calls))
    assert len(store.list()) == n
    got = store.manifests("extract", [f"s{i:04d}" for i in range(n)] + ["uncommitted", "garbled", "nowhere"])
    assert [got[f"s{i:04d}"].stats["shard"] for i in range(n)] == list(range(n))
    assert got["uncommitted"] is None and got["garbled"] is None and got["nowhere"] is None
    assert store.manifests("extract", ["unsafe"], skip_unsafe=True) == {"unsafe": None}
    with pytest.raises(ArtifactCorrupt, match="leaves the artifact's folder"):
        store.manifest("extract", "unsafe")
    # find_many: what find says of each, the manifests read at once; a file of the wrong size is not found
    art = store.open("extract", "s0001")
    store.fs.pipe_file(art.key("p.bin"), b"xx")
    found = store.find_many("extract", [f"s{i:04d}" for i in range(n)] + ["unsafe", "garbled", "nowhere"])
    assert {d for d, a in found.items() if a is not None} == {f"s{i:04d}" for i in range(n) if i != 1}
    assert all(found[d].manifest.digest == d for d in found if found[d] is not None)
    assert store.find("extract", "s0001") is None


@pytest.mark.parametrize("n", [4, 64])
def test_a_reader_of_one_file_checks_that_file_not_all_n(store, n, monkeypatch):
    """A stage's shard opens its input (the prepare artifact: one file per shard) checking only the file it
    reads: N shards each checking all N files were N² store requests (benchmarks/RESULTS.md, the rehearsal)."""
    with store.write("prepare", "data", "v1") as w:
        for i in range(n):
            w.write_bytes(f"shard-{i:05d}.parquet", b"x" * (i + 1))
        w.commit({})
    sized = []
    real_size = store.fs.size
    monkeypatch.setattr(store.fs, "size", lambda key: sized.append(key) or real_size(key))
    art = store.open("prepare", "data", only="shard-00001.parquet")
    assert len(sized) == 1 and sized[0].endswith("shard-00001.parquet")
    assert art.read_bytes("shard-00001.parquet") == b"xx"
    store.open("prepare", "data")
    assert len(sized) == 1 + n  # without `only`, every file
    store.fs.pipe_file(art.key("shard-00001.parquet"), b"x")  # its own file damaged: refused
    with pytest.raises(ArtifactCorrupt, match="shard-00001.parquet has 1 bytes"):
        store.open("prepare", "data", only="shard-00001.parquet")
