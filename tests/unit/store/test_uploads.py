"""A store file on S3 goes up as a multipart upload of store.upload_part_mb parts, several at a time
(tasks/store/uploads.py), against the real SeaweedFS server."""

from __future__ import annotations

import hashlib
import os
import uuid

import pytest

from tasks.core.config import StoreConfig
from tasks.store.artifacts import Store
from tasks.store.uploads import S3MultipartFile, open_for_write

MIB = 1 << 20


def _s3_store(part_mb: int = 5, concurrency: int = 3) -> Store:
    return Store.from_config(StoreConfig(uri=f"s3://draftline-test/{uuid.uuid4().hex[:12]}",
                                         upload_part_mb=part_mb, upload_concurrency=concurrency))


@pytest.mark.parametrize("size", [3 * MIB + 17, 23 * MIB + 5])  # under one part (one PUT), and 5 parts
def test_an_artifact_file_reads_back_whole_from_its_parts(s3_server, size):
    store = _s3_store()
    data = os.urandom(size)
    with store.write("stage", "d1", "1") as w:
        with w.open("blob.bin") as fh:
            view = memoryview(data)
            for a in range(0, size, 7 * MIB + 3):  # writes that straddle part boundaries
                fh.write(view[a:a + 7 * MIB + 3])
        art = w.commit({})
    assert art.read_bytes("blob.bin") == data
    entry = {f.path: f for f in art.manifest.files}["blob.bin"]
    assert entry.bytes == size and entry.sha256 == hashlib.sha256(data).hexdigest()
    parts = store.fs.call_s3("list_objects_v2", Bucket="draftline-test", Prefix=store.root.split("/", 1)[1])
    assert any(o["Size"] == size for o in parts["Contents"])


def test_the_store_config_sets_part_size_and_concurrency(s3_server):
    store = _s3_store(part_mb=7, concurrency=5)
    with open_for_write(store.fs, store.key("x.bin")) as fh:
        assert isinstance(fh, S3MultipartFile) and (fh.part_bytes, fh.concurrency) == (7 * MIB, 5)
        fh.write(b"abc")
    assert store.fs.cat(store.key("x.bin")) == b"abc"


def test_a_failed_write_leaves_no_object_and_no_open_upload(s3_server):
    store = _s3_store()
    key = store.key("half.bin")
    with pytest.raises(RuntimeError, match="stop"):
        with open_for_write(store.fs, key) as fh:
            fh.write(os.urandom(12 * MIB))  # two parts sent
            raise RuntimeError("stop")
    assert not store.fs.exists(key)
    bucket, prefix = key.split("/", 1)
    open_uploads = store.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
    assert open_uploads == []


def test_a_part_smaller_than_s3_allows_is_refused(s3_server):
    with pytest.raises(ValueError, match="at least 5"):
        S3MultipartFile(_s3_store().fs, "draftline-test/x", 1 * MIB, 2)
