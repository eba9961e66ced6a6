"""Many manifests of an S3 folder read through its LIST and the index a sharded stage's end writes
(tasks/store/manifest_index.py), on the real S3 server (SeaweedFS): the same manifests as one GET each, in a
number of requests that does not grow with the count, and never other bytes than the store holds."""

from __future__ import annotations

import json
import uuid

import pytest

from tasks.core.config import StoreConfig
from tasks.core.owners import owned_name
from tasks.store import manifest_index
from tasks.store.artifacts import Store
from tasks.store.model import Manifest


@pytest.fixture
def s3_store(s3_server) -> Store:
    return Store.from_config(StoreConfig(uri=f"s3://draftline-test/{uuid.uuid4().hex[:12]}"))


def plant(store: Store, n: int) -> list[str]:
    """N committed shards as the writer leaves them (an attempt folder with a file, the manifest naming it),
    put in one batch of concurrent PUTs (committing 600 through the writer takes minutes on SeaweedFS); two in three
    manifests formatted otherwise, as another draftline version may have written them."""
    digests = [f"{i:064x}" for i in range(n)]
    objects = {}
    for i, d in enumerate(digests):
        attempt = owned_name("attempt")
        m = Manifest(stage="extract", digest=d, version="v1", attempt=attempt, created=f"2026-12-07T00:00:{i % 60:02d}",
                     files=[{"path": "p.bin", "bytes": 1, "sha256": "0" * 64}], stats={"shard": i, "rate": 0.992})
        objects[store.key("extract", d, attempt, "p.bin")] = b"x"
        # two in three as compact JSON, bytes the writer of today would not make: indexed as read all the same
        objects[store.key("extract", d, "manifest.json")] = m.model_dump_json(indent=None if i % 3 else 2).encode()
    store.fs.pipe(objects)
    return digests


def counted(store: Store, monkeypatch) -> list[str]:
    calls: list[str] = []
    real_call = store.fs._call_s3

    async def call(method, *args, **kwargs):
        calls.append(method)
        return await real_call(method, *args, **kwargs)

    monkeypatch.setattr(store.fs, "_call_s3", call)
    return calls


def one_get_each(store: Store, stage: str, digests: list[str], monkeypatch) -> dict:
    """The manifests as read before the index: a GET each."""
    with monkeypatch.context() as m:
        m.setattr(manifest_index, "MANY", 10**9)
        return {d: x and x.model_dump() for d, x in store.manifests(stage, digests).items()}


def test_attempt_folders_are_what_the_listing_rolls_up():
    assert owned_name("attempt").startswith(manifest_index.ROLL_UP[1:])


@pytest.mark.parametrize("n", [20, 600])
def test_an_indexed_folder_is_listed_in_a_few_requests_and_only_as_the_store_holds_it(s3_store, n, monkeypatch):
    """At 20 and 600 shards (600: the LIST runs over pages, and the odd file below, listed before the digests,
    puts a digest's rolled-up prefix at a page's end, where SeaweedFS drops that digest's manifest from the next
    page; the manifest is then read by a GET): after the stage's
    index, `ls` and `check` read the same manifests as one GET each in at most a handful of GETs; a manifest
    committed again after the index, one committed after it, and a planted index claiming other bytes are read
    as the store holds them."""
    store = s3_store
    digests = plant(store, n)
    store.fs.pipe_file(store.key("extract", "0-odd.txt"), b"shifts the pages by one")
    assert store.write_index("extract", digests) is not None
    assert store.write_index("extract", digests) is None  # the same index already there: nothing written
    # after the index: shard 0 committed again (other stats), a late shard, a planted index forging shard 1
    again = store.manifest("extract", digests[0]).model_copy(update={"stats": {"shard": 0, "again": True}})
    store.fs.pipe_file(store.key("extract", digests[0], "manifest.json"), again.model_dump_json(indent=2).encode())
    late = f"{n:064x}"
    with store.write("extract", late, "v1") as w:
        w.write_bytes("p.bin", b"x")
        w.commit({"shard": n})
    forged = store.manifest("extract", digests[1]).model_copy(update={"stats": {"shard": 1, "forged": True}})
    store.fs.pipe_file(store.key("extract", "draftline-index-" + "f" * 32 + ".json"),
                       json.dumps({"manifests": {digests[1]: forged.model_dump_json(indent=2)}}).encode())
    asked = [*digests, late, "nowhere"]
    expected = one_get_each(store, "extract", asked, monkeypatch)
    calls = counted(store, monkeypatch)
    got = {d: m and m.model_dump() for d, m in store.manifests("extract", asked).items()}
    assert got == expected
    assert got[digests[0]]["stats"] == {"shard": 0, "again": True} and "forged" not in got[digests[1]]["stats"]
    assert got[late]["stats"]["shard"] == n and got["nowhere"] is None
    # the GETs: the two indexes, shard 0, the late one, "nowhere" (404), at most one digest per LIST page
    gets = calls.count("get_object")
    assert 5 <= gets <= 5 + n // 400, (gets, sorted(set(calls)))
    calls.clear()
    listed = store.list("extract")
    assert [m.model_dump() for m in listed] == sorted((v for v in expected.values() if v),
                                                      key=lambda m: (m["stage"], m["created"]))
    assert 4 <= calls.count("get_object") <= 4 + n // 400


@pytest.mark.parametrize("n", [20, 600])
def test_a_server_that_does_not_roll_up_is_read_one_get_each(s3_store, n, monkeypatch):
    """A server that ignores the delimiter (asked here with none: every key comes back) is noticed on the first
    page: each manifest is read by its GET, the same manifests, none missing."""
    store = s3_store
    digests = plant(store, n)
    store.write_index("extract", digests)
    real = store.fs._iterdir
    monkeypatch.setattr(store.fs, "_iterdir", lambda bucket, delimiter="/", prefix="", **kw:
                        real(bucket, delimiter="", prefix=prefix, **kw))
    assert manifest_index.list_folder(store, "extract") is None
    calls = counted(store, monkeypatch)
    got = store.manifests("extract", digests)
    assert [got[d].stats["shard"] for d in digests] == list(range(n))
    assert calls.count("get_object") == n


def test_an_index_over_its_cap_is_not_read(s3_store, monkeypatch):
    store = s3_store
    digests = plant(store, 20)
    key = store.write_index("extract", digests)
    monkeypatch.setattr(manifest_index, "INDEX_CAP", store.fs.size(key) - 1)
    folder = manifest_index.list_folder(store, "extract")
    assert folder.indexes == [] and len(folder.etags) == 20
    calls = counted(store, monkeypatch)
    assert len(store.manifests("extract", digests)) == 20 and calls.count("get_object") == 20
