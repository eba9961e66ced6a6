"""Finished work is what the store's manifests say (flows/caching.py): a task whose artifact is committed
ends Cached, in the flow and in the Prefect API (what the UI shows), with the artifact's ref as its result.

Each run is a fresh process; the second "machine" has a FRESH Prefect home (its own server and empty
database): the only shared state is the store, as between a laptop and a rented node.
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


def run_toy(store_uri: str, marker: Path, server, logs: list[str] | None = None) -> dict[str, str]:
    """{stage: its task run's final state name} of one run of tests/support/toy_flow.py."""
    env = dict(os.environ, PYTHONPATH=os.getcwd(), **server.env())
    out = subprocess.run([sys.executable, str(TOY), store_uri, str(marker)], env=env, capture_output=True,
                         text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    if logs is not None:
        logs.append(out.stdout + out.stderr)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    states = {stage: got[stage] for stage in ("prepare", "vocab")}
    assert got["api"] == states, got  # the Prefect API (the UI) shows what the flow saw
    for stage, ref in got["refs"].items():  # the flow got the artifact's ref as the task's result, cached or not
        assert ref["uri"].endswith(f"/{stage}/{ref['digest']}") and ref["stats"]["bytes"] > 0, ref
    return states


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
    assert second == {"prepare": "Cached", "vocab": "Cached"}  # found on the store, shown as Cached

    # The store is the truth: remove the committed prepare artifact; the stage runs again (and vocab,
    # whose input is unchanged, does not).
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
    from tasks.core.config_load import load_config

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
    from tasks.core.config_load import load_config
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


def test_a_planted_prefect_record_is_inert_and_an_older_store_is_reused_whole(prefect_server, tmp_path):
    """Versions that cached through Prefect kept its records under `STORE/_prefect/`, and anyone who can write
    to the store can write there. Prefect would decode a record with the serializer the record names (pickle)
    and its JSON decoder builds any class a record names. Nothing reads those records now: a store holding
    them (planted or left by an older version) is reused whole, by its manifests; nothing in them is decoded
    or run, and they are left as they were."""
    import base64
    import pickle

    root = tmp_path / "store"
    uri = f"file://{root}"
    marker = tmp_path / "bodies.txt"
    assert run_toy(uri, marker, prefect_server) == {"prepare": "Completed", "vocab": "Completed"}
    assert not (root / "_prefect").exists()  # Prefect writes nothing on the store

    # What an older version wrote for prepare, rewritten by an attacker: a record naming pickle whose result is
    # a pickle that would create a file; and for vocab a JSON result naming a class the decoder would build.
    pwned = tmp_path / "pwned"
    keys, results = root / "_prefect" / "cache-keys", root / "_prefect" / "results"
    keys.mkdir(parents=True)
    results.mkdir(parents=True)
    planted = {
        keys / f"prepare-{stage_digest('prepare', {'x': 1})}": json.dumps({
            "storage_key": "r-prepare", "expiration": None,
            "serializer": {"type": "pickle", "picklelib": "cloudpickle", "picklelib_version": None}}).encode(),
        results / "r-prepare": base64.b64encode(pickle.dumps(_Plant(pwned))),
        results / "r-vocab": json.dumps({"__class__": "pathlib.Path", "data": str(pwned)}).encode(),
        keys / "vocab-any": json.dumps({"storage_key": "r-vocab", "serializer": {
            "type": "json", "object_decoder": "os.system"}}).encode(),
    }
    for path, content in planted.items():
        path.write_bytes(content)
    logs: list[str] = []
    assert run_toy(uri, marker, prefect_server, logs) == {"prepare": "Cached", "vocab": "Cached"}
    assert not pwned.exists() and bodies(marker) == ["prepare", "vocab"]  # nothing decoded, nothing recomputed
    assert "pickle" not in logs[-1] and "Traceback" not in logs[-1]
    assert {p: p.read_bytes() for p in planted} == planted  # read by nobody, left as they were


def test_the_flow_computes_each_address_once_and_the_stage_commits_there(prefect_server, tmp_path, monkeypatch):
    """The same address, computed once: the flow's task computes a stage's address (its STAGE_DEF's `address`)
    and hands it to the stage, which finds or commits its artifact there without computing it again; a stage
    called on its own (a command, a script) computes the same address with that same function."""
    import inspect
    from collections import Counter

    from flows import pipeline
    from flows.caching import as_ref
    from tasks.data.prepare import run_prepare
    from tasks.data.vocab import run_vocab
    from tasks.store.stages import ShardedStage
    from train_data import tiny_chat_run

    for st in pipeline.STAGE_DEFS:  # every stage takes the flow's digest, by keyword
        entry = st.assemble if isinstance(st, ShardedStage) else st.run
        assert inspect.signature(entry).parameters["digest"].kind is inspect.Parameter.KEYWORD_ONLY, st.name

    store, cfg = tiny_chat_run(tmp_path)
    calls: Counter = Counter()
    for name in ("prepare", "vocab"):
        real = getattr(digests, name)
        monkeypatch.setattr(digests, name, lambda *a, _real=real, _name=name: calls.update([_name]) or _real(*a))

    made: dict = {}
    for st in (pipeline.BY_NAME["prepare"], pipeline.BY_NAME["vocab"]):  # as the flow's `_run_stage` runs them, without the record
        inputs = [made[n] for n in st.inputs]
        digest = st.address(cfg, store, *inputs)
        made[st.name] = as_ref(pipeline.stage_task.fn(st.name, cfg, digest, inputs))
        made["data"] = made["prepare"]
        assert made[st.name].executed_here and made[st.name].digest == digest
        assert store.find(st.name, digest) is not None
    assert calls == {"prepare": 1, "vocab": 1}  # once per stage: the stages took the flow's digest

    # On its own, each stage computes the same address by the same function (and finds the artifact there).
    alone = {"prepare": run_prepare(cfg, store), "vocab": run_vocab(cfg, store, made["prepare"])}
    assert {k: (r.digest, r.attempt) for k, r in alone.items()} == {k: (made[k].digest, made[k].attempt) for k in alone}
    assert calls == {"prepare": 2, "vocab": 2}
