"""Every data input is addressed by its content (tasks/address/data.py): a file edited in place is new data and
prepare runs again; the same bytes at another path are the same data; an S3 object overwritten (on the real
SeaweedFS server) is new data; a hub dataset enters at the commit its revision names, pinned once per run."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest

from tasks.address import digests
from tasks.address.data import DataIdentityError, data_identity, file_identity, pin_data
from tasks.core.config import RunConfig
from tasks.core.config_load import load_config
from tasks.data.prepare import read_samples, run_prepare, shard_name
from tasks.store.artifacts import Store


def _rows(n: int, word: str) -> str:
    return "".join(json.dumps({"messages": [{"role": "user", "content": f"question {i} about {word}"},
                                            {"role": "assistant", "content": f"answer {i}: {word}"}]}) + "\n"
                   for i in range(n))


def _cfg(path: str) -> RunConfig:
    return RunConfig.model_validate({"data": {"sources": [{"path": path}], "heldout": 2, "num_shards": 2,
                                              "max_length": 256}})


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A fresh node: its record of hashed files in the test's folder."""
    monkeypatch.setenv("DRAFTLINE_HOME", str(tmp_path / "node"))
    return tmp_path / "node"


def test_a_data_file_edited_in_place_is_prepared_again(node, tmp_path):
    """The hole: prepare's address named the file's path, so a file edited in place kept it and every stage after
    it was Cached on the old rows. Now the edited file has a new address and prepare runs again, on the new rows."""
    data = tmp_path / "chats.jsonl"
    data.write_text(_rows(12, "apples"))
    store = Store(f"file://{tmp_path}/store")
    first = run_prepare(_cfg(str(data)), store)
    assert run_prepare(_cfg(str(data)), store).attempt == first.attempt  # unchanged: Cached
    data.write_text(_rows(12, "pears!"))  # the same size, the same path
    second = run_prepare(_cfg(str(data)), store)
    assert second.digest != first.digest and second.executed_here
    art = store.open("prepare", second.digest)
    texts = [m["content"] for i in range(2) for s in read_samples(art, shard_name(i)) for m in s.messages]
    assert any("pears!" in t for t in texts) and not any("apples" in t for t in texts)


def test_the_same_bytes_at_another_path_are_the_same_data(node, tmp_path):
    """A copy of the file elsewhere (another folder, another machine's checkout) gives the same prepare address;
    another name under the same bytes is a different `source` label, so it is not the same data."""
    a = tmp_path / "here" / "chats.jsonl"
    a.parent.mkdir()
    a.write_text(_rows(8, "plums"))
    b = tmp_path / "elsewhere" / "chats.jsonl"
    b.parent.mkdir()
    shutil.copy(a, b)
    assert digests.prepare(_cfg(str(a))) == digests.prepare(_cfg(str(b)))
    assert "path" not in json.dumps(data_identity(_cfg(str(a)).data)["sources"][0])
    c = tmp_path / "here" / "other.jsonl"
    shutil.copy(a, c)
    assert digests.prepare(_cfg(str(c))) != digests.prepare(_cfg(str(a)))  # `source` column: "other"


def test_a_file_rewritten_with_its_old_mtime_is_hashed_again(node, tmp_path):
    """The node's record of hashed files is keyed by the file's stat including its change time: `touch -d` of the
    old mtime over new bytes is still new data."""
    data = tmp_path / "chats.jsonl"
    data.write_text(_rows(5, "figs"))
    st = data.stat()
    before = file_identity(str(data))
    data.write_text(_rows(5, "kiwi"))
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_identity(str(data)) != before


def test_a_missing_data_file_is_a_clear_error(node, tmp_path):
    with pytest.raises(DataIdentityError, match="not found; fix data.sources"):
        digests.prepare(_cfg(str(tmp_path / "nope.jsonl")))


def test_an_overwritten_s3_object_is_new_data(node, s3_server):
    """On the real SeaweedFS server: the object's ETag enters the address, so an object overwritten at the same
    key is another prepare address; the same bytes at another key are the same data."""
    import s3fs

    fs = s3fs.S3FileSystem()
    key = f"draftline-test/data-{uuid.uuid4().hex[:8]}/chats.jsonl"
    fs.pipe(key, _rows(6, "grapes").encode())
    one = digests.prepare(_cfg(f"s3://{key}"))
    assert digests.prepare(_cfg(f"s3://{key}")) == one
    fs.pipe(key, _rows(6, "melon!").encode())  # same size, same key
    fs.invalidate_cache()
    assert digests.prepare(_cfg(f"s3://{key}")) != one
    other = key.replace("data-", "copy-")
    fs.pipe(other, _rows(6, "melon!").encode())
    assert digests.prepare(_cfg(f"s3://{other}")) == digests.prepare(_cfg(f"s3://{key}"))


def test_a_hub_dataset_enters_at_its_commit_pinned_once_per_run(node, tmp_path, monkeypatch):
    """A hub source without a commit: the commit its branch names is resolved once (offline: the node's Hugging Face
    cache's record of it), pinned in the config and in the overrides the run's children get, and is what the
    address hashes. A new commit on the branch is a new prepare address; no record offline is a clear error."""
    from huggingface_hub import constants

    from tasks.address import data as data_mod

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    data_mod.dataset_commit.cache_clear()
    ref = tmp_path / "hub" / "datasets--org--chats" / "refs" / "main"
    cfg = load_config(None, ["data.sources=[{hub: org/chats, split: train}, {preset: chitchat}]"])
    with pytest.raises(DataIdentityError, match="no record of which commit main names"):
        digests.prepare(cfg)
    ref.parent.mkdir(parents=True)
    ref.write_text("a" * 40)
    data_mod.dataset_commit.cache_clear()
    one = digests.prepare(cfg)
    overrides = pin_data(cfg, ["vocab.draft_vocab_size=32"])
    assert cfg.data.sources[0].revision == "a" * 40
    child = load_config(None, overrides)  # what a child run rebuilds from the overrides it is sent
    assert child.data.sources[0].revision == "a" * 40 and child.data.sources[1].preset == "chitchat"
    assert digests.prepare(child) == one
    ref.write_text("b" * 40)  # the branch moved on
    data_mod.dataset_commit.cache_clear()
    assert digests.prepare(child) == one  # the pinned run reads what it pinned
    assert digests.prepare(load_config(None, ["data.sources=[{hub: org/chats, split: train}, {preset: chitchat}]"])
                           ) != one
    data_mod.dataset_commit.cache_clear()


def test_an_s3_object_enters_by_what_the_store_says_of_its_content(node, s3_server):
    """No byte of the object is read for its address: the ETag (and VersionId, in a versioned bucket) SeaweedFS
    answers to a HEAD is what enters it."""
    import s3fs

    key = f"draftline-test/data-{uuid.uuid4().hex[:8]}/chats.jsonl"
    s3fs.S3FileSystem().pipe(key, _rows(3, "limes").encode())
    ident = file_identity(f"s3://{key}")
    assert "ETag" in ident and "sha256" not in ident, ident
