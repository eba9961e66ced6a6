"""Faults tried for real: what survives, what is lost, what a retry does.

- the extraction engine SIGKILLed at 10 seeded random points across shards;
- the S3 server SIGKILLed in the middle of a multipart upload (back soon / gone for long);
- a committed part corrupted on the store (bytes flipped);
- two runs of one config at the same time (the CLI with Prefect's lock; two stage processes without it);
- training SIGKILLed inside a checkpoint write (half a file written; every file but the manifest).

Engines and workers are real processes killed by real signals, forked from a warm server
(tests/support/warm.py) so that ten restarts cost seconds, not minutes of imports. The target is a
4-layer random Llama (hidden 64, vocab 256), extracted with the transformers backend.
docs/RELIABILITY.md lists each fault with what happens and what is lost.
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import threading
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tasks.core.config import RunConfig
from tasks.core.digest import VERSIONS, stage_digest
from tasks.engine.process import EngineError
from tasks.engine.settings import engine_for_group
from tasks.extract.stage import extract_shard, plan_extract
from tasks.formats.parts import load_part
from tasks.store.artifacts import MANIFEST, ArtifactRef, Store
from tasks.engine.target import load_hf_config
from tasks.address import digests
from tasks.train.stage import run_train
from tasks.train import TrainError
from tasks.train.checkpoints import checkpoint_digest
from train_data import extract_stage, make_tiny_target, write_vocab
from warm import WarmEngine, finish, fork_call, start_draftline

ROOT = Path(__file__).resolve().parents[2]
LAYER_IDS = [1, 2, 3, 4]
VOCAB = 256


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def config(target: str, **train) -> RunConfig:
    return RunConfig.model_validate({
        "target": {"model": target, "max_model_len": 512},
        "extract": {"backend": "transformers", "layer_ids": LAYER_IDS, "batch_tokens": 96, "part_tokens": 160},
        "train": {"max_steps": 8, "batch_tokens": 64, "warmup_steps": 1, "lr": 3e-3, "checkpoint_every": 3,
                  "eval_batches": 1, "prefetch": 2, **train},
    })


def prepared(store: Store, name: str, num_shards: int, per_shard: int, seed: int = 0) -> ArtifactRef:
    """A prepare artifact (docs/ARTIFACTS.md) of random token ids for the tiny target."""
    rng = random.Random(seed)
    digest = stage_digest("prepare", {"test": name}, {})
    samples = tokens = 0
    with store.write("prepare", digest, VERSIONS["prepare"]) as w:
        for s in range(num_shards):
            ids = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(16, 48))] for _ in range(per_shard)]
            masks = [[0] * 4 + [1] * (len(x) - 4) for x in ids]
            table = pa.table({
                "sample_id": pa.array([f"{name}-{s}-{j}" for j in range(per_shard)], pa.string()),
                "source": pa.array(["test"] * per_shard, pa.string()),
                "messages": pa.array(["[]"] * per_shard, pa.string()),
                "input_ids": pa.array(ids, pa.list_(pa.int32())),
                "loss_mask": pa.array(masks, pa.list_(pa.int8())),
            })
            buf = io.BytesIO()
            pq.write_table(table, buf)
            w.write_bytes(f"shard-{s:05d}.parquet", buf.getvalue())
            samples += per_shard
            tokens += sum(map(len, ids))
        ref = w.commit({"num_shards": num_shards, "samples": samples, "tokens": tokens}).ref()
    return ref


def shard_rows(store: Store, data: ArtifactRef, shard: int) -> dict[str, list]:
    art = store.open(data.stage, data.digest)
    return pq.read_table(io.BytesIO(art.read_bytes(f"shard-{shard:05d}.parquet"))).to_pydict()


def all_samples(store: Store, data: ArtifactRef) -> list[tuple[list[int], list[int]]]:
    out = []
    for s in range(data.stats["num_shards"]):
        rows = shard_rows(store, data, s)
        out += list(zip(rows["input_ids"], rows["loss_mask"]))
    return out


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return make_tiny_target(tmp_path_factory.mktemp("fault-target") / "target")


@pytest.fixture(scope="module")
def engine(target):
    base = engine_for_group(config(target), target, [])
    eng = WarmEngine(base.kind, base.model, base.llm_kwargs, env=base.env, name="fault-extract")
    eng.start(timeout_s=300)
    yield eng
    eng.close()


def extracted(root: Path, target: str, engine, shards: int = 2, per_shard: int = 8):
    """A store holding prepared data, its extraction shards and a vocab: what training reads."""
    store = Store(f"file://{root}/store")
    cfg = config(target)
    data = prepared(store, root.name, shards, per_shard)
    plans = plan_extract(cfg, data, load_hf_config(cfg.target))
    refs = [extract_shard(cfg, store, p, engine) for p in plans]
    vref = write_vocab(store, all_samples(store, data), VOCAB, 64)
    return store, cfg, data, plans, refs, vref


def attempt_folders(store: Store, stage: str, digest: str) -> list[str]:
    return sorted(p.name for p in (Path(store.root) / stage / digest).iterdir() if p.is_dir())


# ============================================================================ extraction engine kill -9 x10


def test_engine_killed_at_10_random_points_every_shard_complete_once(tmp_path, target, engine):
    """10 seeded kill points over the stream of engine requests: (request number, before or after
    it). The engine is SIGKILLed while the pipeline is mid-shard (the previous batch being stored, a
    part being written, the next request about to go out), or right after a request answered (when
    that was the shard's last one, the shard commits and the next one finds the engine dead). A
    failed shard is retried on a fresh engine, as EnginePool does in the flow. Kills from inside
    a request are in tests/unit/engine/test_engine.py and tests/unit/extract/test_extract.py (vLLM)."""
    store = Store(f"file://{tmp_path}/store")
    cfg = config(target)
    data = prepared(store, "kill10", num_shards=8, per_shard=8, seed=3)
    plans = plan_extract(cfg, data, load_hf_config(cfg.target))
    rng = random.Random(10)
    at, points = 0, {}
    for _ in range(10):
        at += rng.randrange(2, 7)  # (the request after a kill fails at once: no point there)
        points[at] = rng.choice(["before", "after"])
    fired: list[tuple[int, str]] = []
    requests = [0]
    real = engine.extract

    def kill(when: str) -> None:
        os.kill(engine.pid, signal.SIGKILL)
        engine._proc.wait(10)  # dead for sure (reaped) before anything else looks at it
        fired.append((requests[0], when))

    def extract(prompts, ids, **kw):
        requests[0] += 1
        when = points.get(requests[0])
        if when == "before":
            kill(when)
        out = real(prompts, ids, **kw)
        if when == "after":
            kill(when)
        return out

    log = []
    for plan in plans:
        while True:
            if not engine.alive:
                dead_log = engine.kept_log_path()
                engine.start()  # EnginePool: a dead engine is replaced before the next shard borrows it
                Path(dead_log).unlink(missing_ok=True)  # the dead engine's log, kept for users
            engine.extract = extract  # type: ignore[method-assign]
            try:
                extract_shard(cfg, store, plan, engine)
                ok = True
            except EngineError as exc:
                assert "SIGKILL" in str(exc), exc
                ok = False
            finally:
                del engine.extract
            log.append((plan.shard, requests[0], ok))
            if ok:
                break
    if not engine.alive:  # the module's engine serves the next tests
        dead_log = engine.kept_log_path()
        engine.start()
        Path(dead_log).unlink(missing_ok=True)

    assert len(fired) == 10, (points, log)
    failed = [shard for shard, _r, ok in log if not ok]
    assert len(set(failed)) >= 3 and len(failed) >= 7, log  # most kills cost an attempt, across shards
    # Every shard: committed once, verified byte for byte, its samples exactly once and right.
    for plan in plans:
        art = store.open("extract", plan.digest, checksums=True)
        rows = shard_rows(store, data, plan.shard)
        parts = [load_part(p) for p in _local_parts(art)]
        assert [sid for p in parts for sid in p["sample_ids"]] == rows["sample_id"]  # none lost, none twice
        assert torch.cat([p["input_ids"] for p in parts]).tolist() == sum(rows["input_ids"], [])
        assert torch.cat([p["loss_mask"] for p in parts]).tolist() == sum(rows["loss_mask"], [])
        direct = engine.extract(rows["input_ids"], LAYER_IDS)
        got = torch.cat([p["hidden_states"] for p in parts])
        torch.testing.assert_close(got.float(), torch.cat(direct).float(), atol=1e-2, rtol=1e-2)
        folder = Path(store.root) / "extract" / plan.digest
        assert sorted(p.name for p in folder.iterdir() if p.is_file()) == [MANIFEST]  # no temp, no quarantine
        assert attempt_folders(store, "extract", plan.digest) == [art.manifest.attempt]  # killed attempts removed
    assert store.garbage(min_age_s=0) == []
    assert len(store.list("extract")) == len(plans)


def _local_parts(art) -> list[str]:
    out = []
    for name in sorted(art.files("part-")):
        with art.local_copy(name) as path:
            out.append(path)
    return out


# ============================================================================ corrupted part


def test_corrupted_part_is_named_never_trained_on_and_reextracted(tmp_path, target, engine, monkeypatch):
    """At step 2 a committed part that training has not read yet gets bytes flipped on the store (the
    file still parses: only its sha256 can tell). Training stops when it reaches that part, naming it;
    the shard is un-committed; a retry re-extracts that shard only and training resumes from its last
    checkpoint. The flipped bytes never reach a batch."""
    store, _cfg, data, plans, refs, vref = extracted(tmp_path, target, engine)
    cfg = config(target, max_steps=14, prefetch=0)  # > 1 epoch: every part is read; prefetch 0: no read-ahead
    loaded: list[str] = []
    import tasks.formats.parts

    real_load = tasks.formats.parts.load_part

    def recording(path, **kw):
        loaded.append(str(path))
        return real_load(path, **kw)

    monkeypatch.setattr(tasks.formats.parts, "load_part", recording)
    bad: dict = {}

    def corrupt_an_unread_part(rec: dict) -> None:
        if rec["kind"] != "train" or rec["step"] != 2:
            return
        for ref in refs:
            art = store.open("extract", ref.digest)
            for name in sorted(art.files("part-")):
                key = art.key(name)
                if key not in loaded:
                    raw = bytearray(Path(key).read_bytes())
                    raw[len(raw) // 2] ^= 0xFF  # inside hidden_states
                    Path(key).write_bytes(bytes(raw))
                    bad.update(ref=ref, name=name, key=key)
                    return

    events: list[dict] = []
    with pytest.raises(TrainError) as exc:
        run_train(cfg, store, vref, extract_stage(store, refs), on_metrics=lambda r: (events.append(r), corrupt_an_unread_part(r)))
    assert bad, "every part was read by step 2"
    msg = str(exc.value)
    assert f"{bad['name']} fails its size/sha256 check" in msg and bad["ref"].digest in msg, msg
    assert "draftline retry" in msg
    trained = [e["step"] for e in events if e["kind"] == "train"]
    assert len(trained) >= 2 and bad["key"] not in loaded  # steps ran on healthy parts; never on this one
    assert store.list("train") == []
    checkpoints = sorted(m.stats["step"] for m in store.list("checkpoint"))
    # Un-committed (the evidence kept aside), so the extract stage runs again for that shard only.
    folder = Path(store.root) / "extract" / bad["ref"].digest
    assert store.find("extract", bad["ref"].digest) is None
    assert any(p.name.startswith("manifest.corrupt-") for p in folder.iterdir())
    again = [extract_shard(cfg, store, p, engine) for p in plans]
    redone = [r for r, old in zip(again, refs) if r.attempt != old.attempt]
    assert [r.digest for r in redone] == [bad["ref"].digest]  # the healthy shard is reused
    loaded.clear()
    events.clear()
    ref = run_train(cfg, store, vref, extract_stage(store, again), on_metrics=events.append)
    start = next(e for e in events if e["kind"] == "start")
    assert start["resumed_from"] == (checkpoints[-1] if checkpoints else None)
    assert store.open("train", ref.digest).stats["steps"] == 14
    assert bad["key"] not in loaded and any(redone[0].attempt in p for p in loaded)


# ============================================================================ training killed in a checkpoint write


def _train_and_die(args: dict) -> None:
    """Child process: train; SIGKILL itself inside the write of checkpoint `die_at`."""
    import tasks.store.writer as ts

    tag = f"-s{args['die_at']:08d}"
    if args["where"] == "mid-file":
        real_put = ts.ArtifactWriter.put_file

        def put_file(self, name, local_path):
            if self.stage == "checkpoint" and self.digest.endswith(tag) and name == "optimizer.safetensors":
                data = Path(local_path).read_bytes()
                with self.open(name) as fh:
                    fh.write(data[: len(data) // 2])  # half of the optimizer state is on the store...
                    os.kill(os.getpid(), signal.SIGKILL)  # ...when the process dies
            return real_put(self, name, local_path)

        ts.ArtifactWriter.put_file = put_file
    else:  # every file and the manifest's temp copy are written; the rename that commits is not done
        real_replace = os.replace

        def replace(src, dst, *a, **k):
            if str(dst).endswith("/" + MANIFEST) and tag in str(dst):
                os.kill(os.getpid(), signal.SIGKILL)
            return real_replace(src, dst, *a, **k)

        os.replace = replace
    run_train(RunConfig.model_validate(args["cfg"]), Store(args["store"]), ArtifactRef.model_validate(args["vocab"]),
              ArtifactRef.model_validate(args["extract"]))


def test_training_killed_inside_a_checkpoint_write_resumes_from_the_last_committed_one(tmp_path, target, engine):
    store, cfg, data, plans, refs, vref = extracted(tmp_path, target, engine)
    digest = digests.train(cfg, vref, refs)
    s3, s6 = checkpoint_digest(digest, 3), checkpoint_digest(digest, 6)
    args = {"cfg": cfg.model_dump(mode="json"), "store": store.uri, "die_at": 6,
            "vocab": vref.model_dump(mode="json"), "extract": extract_stage(store, refs).model_dump(mode="json")}
    tmp = tmp_path / "tmp"  # the children's temp folder: a killed trainer leaves its draftline-ckpt-* there
    tmp.mkdir()
    for where in ("mid-file", "before-manifest"):
        child = fork_call(_train_and_die, {**args, "where": where}, env={**os.environ, "TMPDIR": str(tmp)},
                          log=str(tmp_path / f"train-{where}.log"))
        child.join(300)
        assert child.exitcode == -signal.SIGKILL, (where, (tmp_path / f"train-{where}.log").read_text()[-3000:])
        assert [m.digest for m in store.list("checkpoint")] == [s3], where  # step 6 never became visible
        folder = Path(store.root) / "checkpoint" / s6
        files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
        assert MANIFEST not in files, where
        if where == "mid-file":
            (attempt,) = attempt_folders(store, "checkpoint", s6)
            opt = folder / attempt / "optimizer.safetensors"
            assert (folder / attempt / "model.safetensors").is_file() and opt.is_file() and opt.stat().st_size > 0
        else:
            assert any(f.startswith(MANIFEST + ".tmp-") for f in files), files
        assert store.find("train", digest) is None
    assert len(list(tmp.glob("draftline-ckpt-*"))) == 2  # not the store's: gc does not see these
    leftovers = store.garbage(min_age_s=0)
    assert len([k for k in leftovers if f"/checkpoint/{s6}/draftline-attempt-" in k]) == 2  # the two killed attempts
    assert any(".tmp-" in k for k in leftovers)  # the manifest copy that was never renamed

    events: list[dict] = []
    ref = run_train(cfg, store, vref, extract_stage(store, refs), on_metrics=events.append)
    start = next(e for e in events if e["kind"] == "start")
    assert start["resumed_from"] == 3
    assert [e["step"] for e in events if e["kind"] == "train"] == [4, 5, 6, 7, 8]
    assert store.open("train", ref.digest).stats["resumed_from_step"] == 3
    store.gc(min_age_s=0)
    assert store.garbage(min_age_s=0) == []
    for m in store.list("checkpoint"):
        store.open("checkpoint", m.digest, checksums=True)  # what is left after gc is whole
    assert sorted(m.stats["step"] for m in store.list("checkpoint")) == [6, 8]


# ============================================================================ S3 server gone mid-upload


@pytest.fixture
def own_s3(tmp_path, monkeypatch):
    """A SeaweedFS of this test's own (it is killed and restarted), with the session's env shape."""
    from s3server import S3Server

    server = S3Server(tmp_path / "seaweedfs").start()
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    server.make_bucket("outage")
    yield server
    server.stop(kill=True)


def _upload_across_an_outage(store: Store, server, digest: str, payload: bytes, back_after: float | None):
    """Write a 3-part multipart upload; SIGKILL the server after part 1 (restart it after `back_after` s)."""
    timer = threading.Timer(back_after or 0, server.start)
    with store.write("extract", digest, "v1") as w:
        with w.open("part-00000.safetensors") as fh:
            fh.write(payload[: 6 << 20])  # more than the 5 MiB block: part 1 is uploaded now
            server.stop(kill=True)
            if back_after is not None:
                timer.start()
            fh.write(payload[6 << 20:])  # part 2 goes to a dead server
        art = w.commit({"bytes": len(payload)})
    timer.join()
    return art


@pytest.mark.s3
def test_s3_server_killed_mid_upload(own_s3, monkeypatch):
    from tasks.core.config import StoreConfig
    from tasks.store.location import resolve_credentials

    payload = os.urandom(12 << 20)
    cfg = StoreConfig(uri=f"s3://outage/{uuid.uuid4().hex[:8]}")

    def store() -> Store:  # 5 MiB parts (s3fs' default is 50 MiB) so the upload is a multipart one
        return Store(cfg.uri, {**resolve_credentials(cfg), "default_block_size": 5 << 20})

    # Back within the retry window: the store's retries (botocore standard mode) carry the upload through.
    t0 = time.monotonic()
    art = _upload_across_an_outage(store(), own_s3, "back-soon", payload, back_after=1.0)
    assert time.monotonic() - t0 > 1.0
    assert store().open("extract", "back-soon", checksums=True).read_bytes("part-00000.safetensors") == payload
    assert art.manifest.attempt

    # Gone for longer than the retries (cut short here with AWS_MAX_ATTEMPTS=2): the stage fails,
    # nothing is visible; once the server is back, the retried write completes and verifies.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    with pytest.raises(Exception, match="Could not connect to the endpoint URL"):
        _upload_across_an_outage(store(), own_s3, "gone-long", payload, back_after=None)
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")  # the default retries again: a just-restarted server may answer 500 at first
    own_s3.start()
    s = store()
    assert s.manifest("extract", "gone-long") is None and s.find("extract", "gone-long") is None
    assert [m.digest for m in s.list("extract")] == ["back-soon"]
    with s.write("extract", "gone-long", "v1") as w:
        w.write_bytes("part-00000.safetensors", payload)
        w.commit({"bytes": len(payload)})
    assert store().open("extract", "gone-long", checksums=True).read_bytes("part-00000.safetensors") == payload
    s.gc(min_age_s=0)
    assert s.garbage(min_age_s=0) == []
    assert sorted(m.digest for m in store().list("extract")) == ["back-soon", "gone-long"]


# ============================================================================ two runs of one config at once


def _prepare_child(cfg_json: dict, out: str) -> None:
    from tasks.data.prepare import run_prepare

    cfg = RunConfig.model_validate(cfg_json)
    ref = run_prepare(cfg, Store.from_config(cfg.store))
    Path(out).write_text(ref.model_dump_json())


@pytest.mark.slow
def test_two_runs_of_one_config_at_once(prefect_server, tmp_path):
    """Two `draftline run` processes of the same config against one store: the address's lease lock (on a
    local store; tasks/store/leases.py) makes the second wait, find the first's manifest and reuse it. Without a shared lock (two
    machines), both compute and both commit: the manifest that lands last names a complete set of
    files, and the two copies are identical."""
    from tasks.core.config_load import load_config

    store_uri = f"file://{tmp_path}/store"
    args = ["run", "tests/configs/deploy-small.yaml", "--until", "prepare", "--json", "--set", f"store.uri={store_uri}"]
    runs = [start_draftline(args, tmp_path, f"run-{i}") for i in range(2)]
    summaries = []
    for i, p in enumerate(runs):
        code, out, err = finish(p, tmp_path, f"run-{i}")
        assert code == 0, err[-3000:]
        summaries.append(json.loads(out))
    assert sorted(s["stages"]["prepare"]["status"] for s in summaries) == ["cached", "ran"]
    assert len({s["stages"]["prepare"]["artifact"] for s in summaries}) == 1
    store = Store(store_uri)
    (m,) = store.list("prepare")
    store.open("prepare", m.digest, checksums=True)
    assert attempt_folders(store, "prepare", m.digest) == [m.attempt]  # the second never wrote

    # No lock: the stage function in two processes at once.
    cfg = load_config(ROOT / "tests/configs/deploy-small.yaml", [f"store.uri=file://{tmp_path}/nolock", "data.seed=7"])
    kids = [fork_call(_prepare_child, cfg.model_dump(mode="json"), str(tmp_path / f"ref-{i}.json"),
                      log=str(tmp_path / f"prep-{i}.log")) for i in range(2)]
    for i, p in enumerate(kids):
        p.join(600)
        assert p.exitcode == 0, (tmp_path / f"prep-{i}.log").read_text()[-3000:]
    refs = [ArtifactRef.model_validate_json((tmp_path / f"ref-{i}.json").read_text()) for i in range(2)]
    assert refs[0].digest == refs[1].digest
    nolock = Store(f"file://{tmp_path}/nolock")
    art = nolock.open("prepare", refs[0].digest, checksums=True)
    copies = attempt_folders(nolock, "prepare", refs[0].digest)
    assert art.manifest.attempt in copies and 1 <= len(copies) <= 2
    for attempt in copies:  # each writer's files are whole and identical to the committed ones
        for f in art.manifest.files:
            assert (Path(nolock.root) / "prepare" / refs[0].digest / attempt / f.path).read_bytes() == art.read_bytes(f.path)
    nolock.gc(min_age_s=0)
    assert attempt_folders(nolock, "prepare", refs[0].digest) == [art.manifest.attempt]


def test_an_injected_shard_fault_fails_the_first_attempt_only(tmp_path, monkeypatch):
    """DRAFTLINE_FAULT_EXTRACT_SHARDS (the retry drills of docs/DEPLOY.md): a listed shard raises on its first
    attempt and goes through on the next; an unlisted shard never raises."""
    from tasks.core.errors import DraftlineError
    from tasks.core.faults import InjectedFault, fail_point

    monkeypatch.setenv("DRAFTLINE_FAULT_EXTRACT_SHARDS", "1,3")
    monkeypatch.setenv("DRAFTLINE_FAULT_DIR", str(tmp_path))
    fail_point("extract", 0, "d0")
    with pytest.raises(InjectedFault, match=r"extraction shard 1 \(DRAFTLINE_FAULT_EXTRACT_SHARDS=1,3\)") as exc:
        fail_point("extract", 1, "d1")
    assert isinstance(exc.value, RuntimeError) and isinstance(exc.value, DraftlineError)
    fail_point("extract", 1, "d1")  # the retry
    assert (tmp_path / "draftline-fault-extract-d1").exists()
