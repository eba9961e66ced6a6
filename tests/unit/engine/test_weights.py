"""The target's weights on the node once, and addresses that say what the model is (tasks/engine/weights.py).

A stand-in hub on loopback (tests/support/hub_server.py) serves the tiny test model through the routes
huggingface_hub's `snapshot_download` calls; the `draftline` processes reach it through HF_ENDPOINT,
as a node reaches the real hub. Each `draftline` is a fresh process: huggingface_hub reads HF_ENDPOINT and
HF_HUB_OFFLINE when it is imported.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hub_server import StandInHub
from tests.integration.test_train_ranks import byte_tokenizer
from train_data import make_tiny_target

from tasks.address import digests
from tasks.core.config_load import load_config
from tasks.store.artifacts import Store
from tasks.engine import weights
from tasks.engine.weights import folder_fingerprint

ROOT = Path(__file__).resolve().parents[3]
REPO = "tiny-org/tiny-chat"
TOKEN = "hf_standin_secret_0123456789"


def tiny_model(folder: Path) -> Path:
    make_tiny_target(folder, vocab=264)
    byte_tokenizer(folder)
    return folder


def write_config(root: Path, model: str, store: str, shards: int = 2) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"say {w} {i}"}, {"role": "assistant", "content": f"{w} {i} ok"}]}
            for i, w in enumerate(["red", "blue", "green", "cat", "dog", "sun"] * 4)]
    data = root / "tiny.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = root / "tiny.yaml"
    cfg.write_text(json.dumps({
        "name": "weights-test", "target": {"model": model, "max_model_len": 256},
        "data": {"sources": [{"path": str(data), "name": "tiny"}], "max_length": 64, "num_shards": shards, "heldout": 2},
        "regenerate": {"enabled": False}, "vocab": {"draft_vocab_size": 64},
        "extract": {"backend": "transformers", "layer_ids": [1, 2, 3, 4], "batch_tokens": 512},
        "train": {"max_steps": 2, "batch_tokens": 128, "warmup_steps": 1, "checkpoint_every": 2, "eval_batches": 1},
        "benchmark": {"enabled": False}, "store": {"uri": store}}))
    return cfg


def draftline(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cli.app", *args], env=env, cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(p: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


# =========================================================================== content, not path

def test_an_address_hashes_what_the_model_is_not_where_it_sits(tmp_path):
    a = tiny_model(tmp_path / "a")
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    ca = load_config(None, [f"target.model={a}"])
    cb = load_config(None, [f"target.model={b}"])
    assert digests.prepare(ca) == digests.prepare(cb)
    assert digests.train_inputs(ca, type("R", (), {"digest": "v"}), []) == \
        digests.train_inputs(cb, type("R", (), {"digest": "v"}), [])
    # another model is another address: a weight file of another size, a changed tokenizer file
    (b / "tokenizer_config.json").write_text((b / "tokenizer_config.json").read_text().replace("<pad>", "<pad2>"))
    assert digests.prepare(load_config(None, [f"target.model={b}"])) != digests.prepare(ca)
    c = tmp_path / "c"
    shutil.copytree(a, c)
    with open(c / "model.safetensors", "ab") as fh:
        fh.write(b"\0" * 64)
    assert digests.prepare(load_config(None, [f"target.model={c}"])) != digests.prepare(ca)
    # files no run reads do not count (a README, the repository's code without trust_remote_code)
    (a / "README.md").write_text("hello")
    (a / "modeling_x.py").write_text("# code")
    assert folder_fingerprint(a) == folder_fingerprint(tmp_path / "elsewhere" / ".." / "a")
    assert folder_fingerprint(a, trust_remote_code=True) != folder_fingerprint(a)


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A fresh node: draftline's cache (the record of hashed weight files) in the test's folder."""
    monkeypatch.setenv("DRAFTLINE_HOME", str(tmp_path / "node"))
    weights._folder_fingerprint.cache_clear()  # the per-process cache: the test asks the node's record
    yield tmp_path / "node"
    weights._folder_fingerprint.cache_clear()


def flip_one_byte(path: Path) -> None:
    """A fine-tune's file: the same name and size, one byte in the middle of the tensors changed, the time kept."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_one_changed_weight_byte_is_another_model(node, tmp_path):
    """A new checkpoint of the same model (same files, same sizes, other bytes) must not reuse the old one's
    hidden states: its fingerprint, and so every address, differs."""
    a = tiny_model(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert folder_fingerprint(b) == folder_fingerprint(a)
    flip_one_byte(b / "model.safetensors")
    assert (b / "model.safetensors").stat().st_size == (a / "model.safetensors").stat().st_size
    assert folder_fingerprint(b) != folder_fingerprint(a)
    assert digests.prepare(load_config(None, [f"target.model={b}"])) != \
        digests.prepare(load_config(None, [f"target.model={a}"]))


def test_a_folder_is_hashed_once_per_node_and_again_when_touched(node, tmp_path):
    """The first fingerprint of a plain folder reads its weights once; the node remembers each file's sha256 by
    (device, inode, size, mtime, ctime), so the next fingerprint (another process: the per-process cache is cleared)
    reads no weight byte; a touched file is read again; a second process at once waits and reuses."""
    import threading

    a = tiny_model(tmp_path / "a")
    (a / "model-extra.safetensors").write_bytes(os.urandom(1 << 20))
    size = sum(p.stat().st_size for p in a.glob("*.safetensors"))
    before = dict(weights.hashed)
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(weights.file_sha256s(sorted(map(str, a.glob("*.safetensors"))))
                                                              and folder_fingerprint(a))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = folder_fingerprint(a)
    assert results == [first, first]
    assert weights.hashed["files"] - before["files"] == 2 and weights.hashed["bytes"] - before["bytes"] == size
    record = json.loads((node / "fingerprints" / "sha256.json").read_text())
    assert len(record) == 2 and not any(str(tmp_path) in k for k in record)  # keyed by inode, not path

    weights._folder_fingerprint.cache_clear()
    read = dict(weights.hashed)
    assert folder_fingerprint(a) == first and weights.hashed == read  # no weight byte read

    st = (a / "model.safetensors").stat()
    os.utime(a / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: same bytes
    assert folder_fingerprint(a) == first
    assert weights.hashed["files"] - read["files"] == 1
    assert weights.hashed["bytes"] - read["bytes"] == st.st_size


def hub_cache_snapshot(root: Path, repo: str, commit: str, source: Path) -> Path:
    """A hub cache's snapshot as huggingface_hub lays it out: `snapshots/COMMIT/NAME` links to `blobs/ETAG`, where
    an LFS file's etag is the sha256 of its content and a plain git file's its 40-hex git hash."""
    import hashlib

    base = root / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / commit
    (base / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for f in source.iterdir():
        data = f.read_bytes()
        etag = hashlib.sha256(data).hexdigest() if f.suffix == ".safetensors" else hashlib.sha1(data).hexdigest()
        (base / "blobs" / etag).write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(base / "blobs" / etag, snap))
    return snap


def test_a_hub_snapshot_and_a_copy_of_the_same_bytes_share_the_fingerprint(node, tmp_path):
    """The hub snapshot's weight files link to blobs named by their sha256: its fingerprint hashes each blob once
    on this node, and equals a plain copy's (hashed) and the same bytes' under another commit."""
    a = tiny_model(tmp_path / "a")
    one = hub_cache_snapshot(tmp_path / "hub", REPO, "1" * 40, a)
    two = hub_cache_snapshot(tmp_path / "hub", REPO, "2" * 40, a)
    assert folder_fingerprint(one) == folder_fingerprint(two)
    before = dict(weights.hashed)
    weights._folder_fingerprint.cache_clear()
    assert folder_fingerprint(one) == folder_fingerprint(two)
    assert weights.hashed == before  # hashed once per node: the second fingerprint reads no weight byte
    before = dict(weights.hashed)
    copy = tmp_path / "workstation" / "model"
    shutil.copytree(one, copy)  # follows the links: plain files
    assert not (copy / "model.safetensors").is_symlink()
    assert folder_fingerprint(copy) == folder_fingerprint(one) == folder_fingerprint(a)
    assert weights.hashed["files"] > before["files"]  # the plain copies were hashed


def test_a_hub_cache_blob_with_changed_bytes_is_another_model(node, tmp_path):
    """A blob's name is the sha256 the hub published, but anyone who can write the node's cache can change its
    bytes and keep its name: the fingerprint hashes the bytes (once per node), so changed bytes are another model."""
    import hashlib

    a = tiny_model(tmp_path / "a")
    snap = hub_cache_snapshot(tmp_path / "hub", REPO, "1" * 40, a)
    first = folder_fingerprint(snap)
    blob = (snap / "model.safetensors").resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    assert blob.name != hashlib.sha256(bytes(data)).hexdigest()  # the name still claims the old bytes
    assert folder_fingerprint(snap) != first


def test_the_workstation_and_b300_presets_address_the_same_artifacts(tmp_path, monkeypatch):
    """The workstation preset layers on the B300 one (`base:`): every hashed section is shared. The model is a
    tiny folder at two paths standing in for the hub snapshot (pool) and the box's local copy; the hub datasets
    enter at the commits a node's Hugging Face cache records for their main branch (offline here)."""
    from tests.support.hub_cache import record_dataset_commits

    record_dataset_commits(monkeypatch, tmp_path / "hf")
    pool, box = tiny_model(tmp_path / "pool-snapshot"), tmp_path / "models" / "kimi-k2.5"
    shutil.copytree(pool, box)
    b300 = load_config(ROOT / "configs/kimi-k2.5-b300.yaml", [f"target.model={pool}"])
    ws = load_config(ROOT / "configs/kimi-k2.5-workstation.yaml", [f"target.model={box}"])
    assert ws.name != b300.name and ws.extract.batch_tokens != b300.extract.batch_tokens  # it does differ

    class Ref:
        def __init__(self, digest: str, shard: int = 0):
            self.digest, self.stats = digest, {"shard": shard}

    def addresses(cfg) -> dict[str, object]:  # every stage's address, each from the one before
        prep = Ref(digests.prepare(cfg))
        regen = Ref(digests.regenerate(cfg, prep))
        vocab = Ref(digests.vocab(cfg, regen))
        shards = [Ref(digests.extract_shard(cfg, cfg.extract.layer_ids, regen.digest, s), s) for s in range(3)]
        heads = [(h.label, Ref(digests.train(cfg, vocab, shards, h))) for h in cfg.train.heads]  # one per head
        return {"prepare": prep.digest, "regenerate": regen.digest, "vocab": vocab.digest,
                "extract": [s.digest for s in shards], "train": [t.digest for _, t in heads],
                "benchmark": digests.benchmark(cfg, heads, regen)}

    assert addresses(ws) == addresses(b300)


# =========================================================================== the stand-in hub

@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    folder = tiny_model(tmp_path_factory.mktemp("hub-repo") / "repo")
    server = StandInHub(REPO, folder, delay_s=1.5).start()  # slow files: two fetches at once overlap
    yield server
    server.stop()


def hub_env(hub: StandInHub, home: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0",
            "HF_HOME": str(home / "hf"), "DRAFTLINE_HOME": str(home / "draftline"), "HF_TOKEN": TOKEN, **extra}


def test_weights_fetched_once_per_node_then_never_from_the_hub_again(hub, tmp_path):
    cfg = write_config(tmp_path, REPO, f"file://{tmp_path}/store")
    env = hub_env(hub, tmp_path / "node")
    # doctor says what the node needs before anything is fetched (sizes from the hub's listing)
    code, out, err = finish(draftline(["doctor", str(cfg), "--json"], env, ROOT))
    row = next(c for c in json.loads(out)["checks"] if c["name"] == "weights")
    size = sum(f.stat().st_size for f in hub.folder.iterdir())
    assert row["status"] == "warn" and f"{size / 1e9:,.1f} GB to fetch" in row["detail"], row
    assert "draftline weights CONFIG" in row["fix"]
    assert hub.count("GET", "/resolve/") == 0
    hub.clear()
    # two processes of one node at once (two engine groups, a rank): one download, both get the snapshot
    procs = [draftline(["weights", str(cfg), "--json"], env, ROOT) for _ in range(2)]
    results = [finish(p) for p in procs]
    for code, out, err in results:
        assert code == 0, err[-3000:]
    got = [json.loads(out) for _, out, _ in results]
    assert got[0]["path"] == got[1]["path"] and got[0]["commit"] == got[1]["commit"] == hub.sha
    assert Path(got[0]["path"]).is_relative_to(tmp_path / "node" / "hf")
    assert hub.count("GET", "/model.safetensors") == 1, hub.requests  # the second process waited and reused
    # the snapshot is what the hub holds: the same fingerprint as the repository's own folder
    assert got[0]["fingerprint"] == folder_fingerprint(hub.folder)
    assert got[0]["bytes"] == sum(f.stat().st_size for f in hub.folder.iterdir() if f.suffix in (".json", ".safetensors", ".jinja"))
    # HF_TOKEN went to the hub as huggingface_hub sends it, and nowhere else
    assert {r["authorization"] for r in hub.requests} == {f"Bearer {TOKEN}"}
    assert all(r["authorization"] is None for r in hub.probes)  # the liveness probe carries no token
    assert not any(TOKEN in out + err for _, out, err in results)

    # complete: later calls are local, online (pinned or not resolved again by this command) and offline
    hub.clear()
    code, out, err = finish(draftline(["weights", str(cfg), "--json", "--set", f"target.revision={hub.sha}"], env, ROOT))
    assert code == 0 and json.loads(out)["path"] == got[0]["path"], err[-2000:]
    code, out, err = finish(draftline(["weights", str(cfg), "--json"], {**env, "HF_HUB_OFFLINE": "1"}, ROOT))
    assert code == 0 and json.loads(out)["commit"] == hub.sha, err[-2000:]
    assert hub.requests == []

    # offline on a node without the snapshot: at once, with what to do
    t0 = time.monotonic()
    code, out, err = finish(draftline(["weights", str(cfg)], hub_env(hub, tmp_path / "empty", HF_HUB_OFFLINE="1"), ROOT))
    said = " ".join((out + err).split())
    assert code != 0 and "no complete snapshot on this node, and HF_HUB_OFFLINE=1" in said, said
    assert "draftline weights CONFIG" in said and time.monotonic() - t0 < 120
    assert hub.requests == []


def test_the_disk_check_counts_the_nested_files_a_fetch_brings(tmp_path):
    """snapshot_download's patterns cross '/' (`*.safetensors` fetches `sub/x.safetensors`): the disk check and the
    bytes `draftline weights` reports count those files too, not the top level only."""
    folder = tiny_model(tmp_path / "repo")
    (folder / "sub").mkdir()
    (folder / "sub" / "more.safetensors").write_bytes(b"\0" * 300_000)  # larger than the rest of the repository
    server = StandInHub(REPO, folder).start()
    try:
        cfg = write_config(tmp_path, REPO, f"file://{tmp_path}/store")
        code, out, err = finish(draftline(["weights", str(cfg), "--json"], hub_env(server, tmp_path / "node"), ROOT))
    finally:
        server.stop()
    assert code == 0, err[-2000:]
    total = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert json.loads(out)["needed_bytes"] == total, (out, total)


def test_an_unpinned_hub_id_runs_on_the_local_snapshot_and_records_its_commit(hub, tmp_path, prefect_server):
    """The revision test: a run of an unpinned hub id resolves the commit once, records it (and the fingerprint)
    in every manifest, reads the weights from the node's snapshot in every stage, the train stage's verifier
    weights included (no file request reaches the hub), and its addresses are those of the same model in a
    plain folder."""
    store = f"file://{tmp_path}/store"
    cfg = write_config(tmp_path, REPO, store)
    env = hub_env(hub, tmp_path / "node", **prefect_server.env())
    code, out, err = finish(draftline(["weights", str(cfg)], env, ROOT))
    assert code == 0, err[-2000:]
    hub.clear()
    code, out, err = finish(draftline(["run", str(cfg), "--until", "train", "--json"], env, ROOT))
    assert code == 0, err[-4000:]
    s = json.loads(out)
    assert s["state"] == "COMPLETED" and s["stages"]["extract"]["executed"] == 2, s["stages"]
    assert s["stages"]["train"]["executed"] == 1, s["stages"]["train"]  # the verifier's weights: the snapshot's
    # the extraction check ran on both shards, shown in the summary and, as a markdown artifact, in the Prefect UI
    verified = s["stages"]["extract"]["stats"]["verified"]
    assert verified["shards"] == 2 and verified["unchecked"] == 0 and verified["positions"] > 0, verified
    assert verified["min_shard_agreement"] >= verified["threshold"], verified
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    async def check_artifact() -> list:
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["extraction-check"]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[s["flow_run_id"]])))

    shown = asyncio.run(check_artifact())
    assert len(shown) == 1 and "| 0 |" in shown[0].data and "| 1 |" in shown[0].data, shown
    assert [r["path"] for r in hub.requests] == [f"/api/models/{REPO}/revision/main"], hub.requests  # once per run

    manifests = [m for m in Store(store).list() if m.stage != "checkpoint"]
    assert {m.stage for m in manifests} == {"prepare", "vocab", "extract", "extract-stage", "train"}
    fp = folder_fingerprint(hub.folder)
    for m in manifests:
        assert m.run["target"] == {"model": REPO, "commit": hub.sha, "fingerprint": fp}, (m.stage, m.run)
    assert next(m for m in manifests if m.stage == "train").inputs["target"] == f"sha256:{fp}"
    blob = "".join(json.dumps(m.model_dump()) for m in manifests) + out + err
    assert TOKEN not in blob and "Bearer" not in blob
    # the same model as a plain folder: the same addresses
    local = load_config(cfg, [f"target.model={hub.folder}"])
    prepared = next(m for m in manifests if m.stage == "prepare")
    assert prepared.digest == digests.prepare(local)


# =========================================================================== the move test

@pytest.mark.s3
def test_a_run_resumes_after_the_model_folder_moves_and_on_another_prefect_home(s3_server, prefect_server, tmp_path):
    """The promise of the README: start on one machine, resume elsewhere, pay only for what never finished.
    The tiny target in folder A: prepare, vocab and 2 of 3 extraction shards (one fails by the fault mechanism)
    on the SeaweedFS store. The folder moves to B (another machine's path) and the run starts again from a
    second Prefect home with an empty database, as a pool node would: every finished stage and shard is
    reused, only the failed shard runs."""
    import uuid

    from prefect_server import PrefectServer
    from warm import finish as finish_forked
    from warm import start_draftline

    store = f"s3://draftline-test/move-{uuid.uuid4().hex[:8]}"
    a = tiny_model(tmp_path / "box" / "models" / "tiny")
    cfg = write_config(tmp_path, str(a), store, shards=3)

    def run(name: str, model: Path, env: dict[str, str]) -> dict:
        p = start_draftline(["run", str(cfg), "--until", "extract", "--json", "--set", f"target.model={model}"],
                            tmp_path, name, env=env)
        code, out, err = finish_forked(p, tmp_path, name, timeout=600)
        try:
            return {**json.loads(out), "code": code}
        except ValueError:
            raise AssertionError(f"{name}: exit {code}\n{out[-2000:]}\n{err[-4000:]}") from None

    faults = {"DRAFTLINE_FAULT_EXTRACT_SHARDS": "1", "DRAFTLINE_FAULT_DIR": str(tmp_path / "faults")}
    first = run("box", a, {**os.environ, **prefect_server.env(), **faults})
    assert first["code"] == 1 and first["state"] == "FAILED"
    st = first["stages"]
    assert (st["prepare"]["executed"], st["vocab"]["executed"]) == (1, 1), st
    assert (st["extract"]["executed"], st["extract"]["failed"]) == (2, 1), st["extract"]
    before = {(m.stage, m.digest): m.attempt for m in Store(store).list()}
    assert len(before) == 4  # prepare, vocab, 2 shards

    b = tmp_path / "pool-node" / "weights" / "tiny"
    b.parent.mkdir(parents=True)
    shutil.move(str(a), str(b))
    assert not a.exists()
    other = PrefectServer(tmp_path / "prefect-home-b").start()  # another machine: an empty Prefect database
    try:
        second = run("pool", b, {**os.environ, **other.env(), **faults})
    finally:
        other.stop()
    assert second["code"] == 0 and second["state"] == "COMPLETED", second
    st = second["stages"]
    assert (st["prepare"]["executed"], st["prepare"]["cached"]) == (0, 1), st["prepare"]
    assert (st["vocab"]["executed"], st["vocab"]["cached"]) == (0, 1), st["vocab"]
    assert (st["extract"]["executed"], st["extract"]["cached"], st["extract"]["failed"]) == (1, 2, 0), st["extract"]
    after = {(m.stage, m.digest): m.attempt for m in Store(store).list()}
    assert {k: after[k] for k in before} == before  # the finished artifacts themselves, not recomputed copies
    assert len(after) == 6  # + the failed shard, + the extract stage's artifact naming the 3 shards
    assert sum(stage == "extract-stage" for stage, _ in after) == 1


def test_a_base_config_is_layered_under_the_file_and_travels_inlined(tmp_path, monkeypatch):
    from flows.flow_runs import config_parameters
    from tasks.core.errors import ConfigError

    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "base.yaml").write_text("name: base\ntrain: {max_steps: 7, lr: 0.01}\nvocab: {draft_vocab_size: 99}\n")
    mine = tmp_path / "mine.yaml"
    mine.write_text("base: presets/base.yaml\nname: mine\ntrain: {max_steps: 9}\n")
    monkeypatch.setenv("DRAFTLINE_STORE_URI", "")
    cfg = load_config(mine, ["vocab.draft_vocab_size=50"])  # file over base, --set over both
    assert (cfg.name, cfg.train.max_steps, cfg.train.lr, cfg.vocab.draft_vocab_size) == ("mine", 9, 0.01, 50)
    # a config outside the checkout travels as its content: with its base merged in (the worker lacks both)
    params, _ = config_parameters(mine, [], None)
    assert params["config_path"] is None
    assert load_config(None, params["overrides"]).model_dump() == load_config(mine).model_dump()
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    mine.write_text("base: nowhere.yaml\n")
    for path, said in ((mine, "nowhere.yaml not found (the `base:` of"), (tmp_path / "loop.yaml", "include each other")):
        with pytest.raises(ConfigError, match=None) as exc:
            load_config(path)
        assert said in str(exc.value), exc.value


def test_a_download_killed_halfway_keeps_the_finished_files(hub, tmp_path):
    """The node's process dies mid-download (a preemption, a Ctrl-C): the next fetch asks the hub only for the
    files that were not finished (huggingface_hub 2.4 restarts a file cut mid-way, from a process-unique temp
    file it never resumes: that partial file is removed), and the snapshot comes out whole."""
    import signal

    cfg = write_config(tmp_path, REPO, f"file://{tmp_path}/store")
    env = hub_env(hub, tmp_path / "node")
    hub.clear()
    hub.stall("model.safetensors")
    p = draftline(["weights", str(cfg), "--json"], env, ROOT)
    deadline = time.monotonic() + 300
    while not hub.count("GET", "/model.safetensors") and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(4)  # the other files finish; half of the weights arrive
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=60)
    hub.release()
    blobs = next((tmp_path / "node" / "hf").rglob("blobs"))
    assert len(list(blobs.glob("*.incomplete"))) == 1
    finished = {r["path"].rsplit("/", 1)[-1] for r in hub.requests if r["method"] == "GET" and "/resolve/" in r["path"]}
    assert "config.json" in finished
    assert not list((tmp_path / "node" / "draftline").rglob("*.json")), "a marker before the snapshot was complete"

    hub.clear()
    code, out, err = finish(draftline(["weights", str(cfg), "--json"], env, ROOT))
    assert code == 0, err[-3000:]
    again = [r["path"].rsplit("/", 1)[-1] for r in hub.requests if r["method"] == "GET" and "/resolve/" in r["path"]]
    assert again == ["model.safetensors"], hub.requests  # the finished files were not fetched again
    assert not list(blobs.glob("*.incomplete"))
    snap = Path(json.loads(out)["path"])
    assert json.loads(out)["fingerprint"] == folder_fingerprint(hub.folder)
    assert (snap / "model.safetensors").read_bytes() == (hub.folder / "model.safetensors").read_bytes()


def test_a_run_pins_an_unpinned_hub_id_for_its_tasks_and_children(hub, tmp_path):
    """pin_run, what the flow (and each child run) calls at its start: the commit goes into the cfg the tasks
    get and into the overrides the run's children get (tasks/engine/weights.py; flows/nodes.py child_config sends
    the run's overrides), and a child with those overrides does not ask the hub again."""
    cfg = write_config(tmp_path, REPO, f"file://{tmp_path}/store")
    code = ("import json, os; from tasks.core.config_load import load_config; from tasks.engine.weights import pin_run; "
            f"cfg = load_config({str(cfg)!r}, ['vocab.draft_vocab_size=32']); o = pin_run(cfg, ['vocab.draft_vocab_size=32']); "
            "print(json.dumps({'overrides': o, 'revision': cfg.target.revision, "
            "'provenance': json.loads(os.environ['DRAFTLINE_TARGET_PROVENANCE'])}))")
    env = hub_env(hub, tmp_path / "node")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["overrides"] == ["vocab.draft_vocab_size=32", f"target.revision={hub.sha}"]
    assert got["revision"] == hub.sha
    assert got["provenance"] == {"model": REPO, "commit": hub.sha, "fingerprint": folder_fingerprint(hub.folder)}
    # a child run on this node, with the parent's overrides: pinned already, nothing resolved
    hub.clear()
    child = code.replace("['vocab.draft_vocab_size=32']", repr(got["overrides"]))
    out = subprocess.run([sys.executable, "-c", child], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and json.loads(out.stdout.strip().splitlines()[-1])["revision"] == hub.sha
    assert not any("/revision/" in r["path"] for r in hub.requests), hub.requests
