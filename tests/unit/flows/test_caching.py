"""Caching keyed by artifact digests, with Prefect records on the store.

Each run is a fresh process with a FRESH Prefect home (its own ephemeral
server and empty database): the only shared state is the store, as between
a laptop and a rented node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from prefect_server import PrefectServer

from tasks.core.digest import stage_digest
from tasks.core.config import RunConfig
from tasks.address import digests

TOY = Path(__file__).resolve().parents[2] / "support" / "toy_flow.py"


def run_toy(store_uri: str, marker: Path, server, logs: list[str] | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.getcwd(), **server.env())
    out = subprocess.run([sys.executable, str(TOY), store_uri, str(marker)], env=env, capture_output=True,
                         text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    if logs is not None:
        logs.append(out.stdout + out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bodies(marker: Path) -> list[str]:
    return marker.read_text().split() if marker.exists() else []


@pytest.mark.s3
def test_fresh_prefect_home_against_same_s3_store_runs_no_stage_body(s3_server, prefect_server, tmp_path):
    """Machine A (the session's Prefect server) runs; machine B (a second server with a fresh
    home and empty database) and then A again share nothing but the S3 store."""
    uri = f"s3://draftline-test/cache-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "bodies.txt"
    first = run_toy(uri, marker, prefect_server)
    assert bodies(marker) == ["prepare", "vocab"]
    assert first == {"prepare": "Completed", "vocab": "Completed"}

    other = PrefectServer(tmp_path / "home-b").start()  # another "machine": empty Prefect DB
    try:
        second = run_toy(uri, marker, other)
    finally:
        other.stop()
    assert bodies(marker) == ["prepare", "vocab"]  # nothing recomputed
    assert second == {"prepare": "Cached", "vocab": "Cached"}  # hits from records on the store

    # The store is the truth: remove the committed prepare artifact; its Prefect record
    # still exists, but the stage runs again (and vocab, whose input is unchanged, does not).
    from tasks.store.artifacts import Store

    Store(uri).delete("prepare", stage_digest("prepare", {"x": 1}))
    third = run_toy(uri, marker, prefect_server)
    assert bodies(marker) == ["prepare", "vocab", "prepare"]
    assert third["prepare"] == "Completed" and third["vocab"] == "Cached"


def test_digest_ignores_scheduling_keys_and_tracks_meaningful_ones():
    a = RunConfig()
    b = RunConfig.model_validate({"train": {"device": "cpu", "prefetch": 7, "checkpoint_every": 3}})
    c = RunConfig.model_validate({"train": {"lr": 1e-3}})

    class Ref:
        def __init__(self, d, shard=0):
            self.digest, self.stats = d, {"shard": shard}

    v, shards = Ref("v"), [Ref("s0", 0), Ref("s1", 1)]
    assert digests.train(a, v, shards) == digests.train(b, v, shards)
    assert digests.train(a, v, shards) != digests.train(c, v, shards)
    assert digests.train(a, v, shards) != digests.train(a, v, shards[:1])
    assert digests.train(a, v, shards) == digests.train(a, v, shards[::-1])  # shard order, not completion order
    assert digests.prepare(a) != digests.prepare(RunConfig.model_validate({"data": {"seed": 1}}))
    # engine settings (where and how fast, not the bytes) enter no address
    e = RunConfig.model_validate({"extract": {"enforce_eager": False, "kv_cache_gib": 64}, "engines": {
        "engine_args": {"gpu_memory_utilization": 0.8}, "regenerate": {"enforce_eager": False},
        "extract": {"engine_args": {"max_num_batched_tokens": 32768}}, "benchmark": {"enforce_eager": True}}})
    prep = Ref("p")
    prep.stage = "prepare"
    for stage in (digests.prepare, lambda x: digests.regenerate(x, prep), lambda x: digests.vocab(x, prep),
                  lambda x: digests.extract_shard(x, [2, 15, 27, 30], "d", 0), lambda x: digests.train(x, v, shards),
                  lambda x: digests.benchmark(x, v, prep)):
        assert stage(a) == stage(e)
    # 3 and 3.0 in YAML are the same config
    assert stage_digest("vocab", {"k": 3}) == stage_digest("vocab", {"k": 3.0})
    assert stage_digest("vocab", {"k": 3}, version="vocab-v2") != stage_digest("vocab", {"k": 3})


def test_stored_artifacts_keep_their_addresses():
    """An address that changes silently recomputes finished work (a day of extraction, a trained draft).
    These are the demo's addresses as stored by earlier versions (with stand-in input digests); a change
    here must come with a VERSIONS bump and a note, never by accident (new scheduling keys, refactors)."""
    from tasks.core.config import load_config

    class Ref:
        def __init__(self, d, shard=0):
            self.digest, self.stats = d, {"shard": shard}

    cfg = load_config("tests/configs/demo-as-stored.yaml", [])
    assert digests.prepare(cfg) == "d01e4891541bc92bcc76ee8ae26ffa17"
    assert digests.train(cfg, Ref("v"), [Ref("s0", 0), Ref("s1", 1)]) == "42f9970dbdfd1da80f3c78ebf0369d62"
    assert digests.benchmark(cfg, Ref("t"), Ref("d")) == "c42c11aa7cba798732d96fd73bf08fd7"


def test_a_folder_targets_address_is_pinned_to_its_bytes(tmp_path, monkeypatch):
    """A folder (or hub) target's addresses hash its fingerprint (tasks/engine/weights.py): the content of its small
    files and the sha256 of every weight file. Pinned like the demo's: these moved ONCE, deliberately, when the
    weights entered by content (VERSIONS["target"] target-v2, issue 33); a change here needs another bump."""
    from tasks.core.config import load_config
    from tasks.engine.weights import folder_fingerprint

    monkeypatch.setenv("DRAFTLINE_HOME", str(tmp_path / "node"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 4}\n')
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 16)
    assert folder_fingerprint(model) == "d749a278c254110d9ba41e97f3b96c6a5dca823d61c7494c5c73bb57be35494a"
    cfg = load_config("tests/configs/demo-as-stored.yaml", [f"target.model={model}"])
    assert digests.prepare(cfg) == "f10cd33b709691560c8bf0525fb7b129"


class _Plant:
    """A pickle payload that, when unpickled, creates a file: what a writer to the store would plant."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_planted_cache_records_are_refused_never_decoded(prefect_server, tmp_path):
    """Anyone who can write to the store can rewrite Prefect's records under `_prefect/`. Prefect decodes
    a record with the serializer the record names (pickle) and its JSON decoder builds any class a record
    names: a planted record must be refused (the stage runs again, its artifact found on the store) and
    never executed."""
    import pickle

    root = tmp_path / "store"
    uri = f"file://{root}"
    marker = tmp_path / "bodies.txt"
    assert run_toy(uri, marker, prefect_server) == {"prepare": "Completed", "vocab": "Completed"}
    keys = root / "_prefect" / "cache-keys"
    meta_path = keys / f"prepare-{stage_digest('prepare', {'x': 1})}"
    meta = json.loads(meta_path.read_text())
    result_path = Path(meta["storage_key"])
    if not result_path.is_absolute():
        result_path = root / "_prefect" / "results" / result_path

    pwned = tmp_path / "pwned"
    # 1. the record names pickle and its result is a pickle that would create a file
    meta["serializer"] = {"type": "pickle", "picklelib": "cloudpickle", "picklelib_version": None}
    meta_path.write_text(json.dumps(meta))
    import base64
    result_path.write_bytes(base64.b64encode(pickle.dumps(_Plant(pwned))))
    logs: list[str] = []
    out = run_toy(uri, marker, prefect_server, logs)
    assert not pwned.exists()
    assert out == {"prepare": "Completed", "vocab": "Cached"}  # refused: the stage ran again
    assert "refused Prefect cache record cache-keys/prepare-" in logs[-1] and "'pickle'" in logs[-1]
    assert bodies(marker) == ["prepare", "vocab"]  # ... and found its artifact on the store

    # 2. a JSON record naming a class the decoder would import and build
    meta = json.loads(meta_path.read_text())
    assert meta["serializer"]["type"] == "json"  # the refused record was replaced by a good one
    result_path = Path(meta["storage_key"])
    if not result_path.is_absolute():
        result_path = root / "_prefect" / "results" / result_path
    result_path.write_text(json.dumps({"__class__": "pathlib.Path", "data": str(pwned)}))
    out = run_toy(uri, marker, prefect_server, logs)
    assert out == {"prepare": "Completed", "vocab": "Cached"}
    assert "it names class 'pathlib.Path'" in logs[-1]
    # 3. a JSON serializer whose decoder is any importable function
    meta = json.loads(meta_path.read_text())
    meta["serializer"]["object_decoder"] = "os.system"
    meta_path.write_text(json.dumps(meta))
    out = run_toy(uri, marker, prefect_server, logs)
    assert out == {"prepare": "Completed", "vocab": "Cached"}
    assert "names serializer 'json' with settings draftline never writes" in logs[-1]
    assert not pwned.exists() and bodies(marker) == ["prepare", "vocab"]
