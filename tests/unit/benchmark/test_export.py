"""From a trained draft to a served one, the fast parts: the one `vllm serve` line, `draftline export`'s folder,
a published draft as a warm start (train.init_from: checked, remapped, addressed by content) and as an other
draft in the benchmark (benchmark.drafts: addressed by content).

The whole chain through `draftline run`, `draftline export` and `vllm serve` (the CPU build) is in
tests/e2e/test_e2e.py; these run on the 4-layer random target of tests/unit/train/test_train.py.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tasks.address import digests
from tasks.core.config import RunConfig
from tasks.core.config_load import load_config
from tasks.formats.drafts import DraftError, check_compatible, content_digest, remap_rows
from tasks.benchmark.serve import best_k, export_draft, run_serve, serve_command
from tasks.store.artifacts import Store
from tasks.train.stage import run_train
from tasks.train import TrainError
from tests.unit.train.test_heads import LAYER_IDS, tiny  # noqa: F401 - the tiny target's fixture, shared
from train_data import extract_stage, make_tiny_target, write_vocab


class Ref:
    def __init__(self, d, shard=0):
        self.digest, self.stats = d, {"shard": shard}


# ============================================================================ the serve line

def test_the_serve_line_is_one_shell_line_that_parses_back():
    serve = {"target": "/models/my target", "method": "eagle3", "k": 3,
             "engine": {"dtype": "bfloat16", "max_model_len": 2048, "enforce_eager": True, "seed": 0}}
    line = serve_command(serve, "/drafts/it's here")
    argv = shlex.split(line)
    assert argv[:3] == ["vllm", "serve", "/models/my target"]
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "eagle3", "model": "/drafts/it's here", "num_speculative_tokens": 3}
    assert argv[5:] == ["--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager", "--seed", "0",
                        "--host", "127.0.0.1"]


def parse_serve_line(line: str):
    """The line as `vllm serve` reads it: vLLM's own parser (the installed CPU build's EngineArgs flags on its
    FlexibleArgumentParser; the positional target is `--model`). Returns (the parsed EngineArgs fields, the
    frontend's flags). EngineArgs itself is not built: for a hub id it would fetch the model."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = shlex.split(line)
    assert argv[:2] == ["vllm", "serve"]
    args, frontend = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_known_args(
        ["--model", argv[2], *argv[3:]])
    return args, frontend


def assert_serves_the_benchmark_engine(line: str, ran: dict, target: str, draft: str) -> None:
    """Field by field: every argument the benchmark engine ran with, as `vllm serve` parses the printed line."""
    parsed, frontend = parse_serve_line(line)
    assert parsed.model == target
    for key, value in ran.items():
        if key == "speculative_config":  # the draft the line names: the exported copy, not the benchmark's
            value = {**value, "model": draft}
        assert getattr(parsed, key) == value, (key, getattr(parsed, key), value)
    assert frontend[-2:] == ["--host", "127.0.0.1"]  # this machine only, unless asked


def test_the_serve_line_is_the_engine_the_benchmark_ran(tmp_path):
    """A hub target (a Kimi-K2.5-shaped config: MLA, a vision tower) at tensor parallel 8 with engine_args: the
    line names the hub id and its commit (never the node's snapshot folder), and vLLM's parser gives back every
    argument of the benchmark's engine at the chosen k."""
    from transformers import DeepseekV3Config
    from transformers.models.kimi_k25 import Kimi_K25Config

    from tasks.benchmark.serve import serve_settings
    from tasks.engine.settings import benchmark_kwargs

    snapshot = tmp_path / "hub-cache" / "snapshots" / ("c" * 40)  # where the benchmark's engine read it from
    Kimi_K25Config(text_config=DeepseekV3Config(kv_lora_rank=512, num_hidden_layers=4),
                   vision_config={}).save_pretrained(snapshot)
    commit = "c" * 40
    cfg = RunConfig.model_validate({
        "target": {"model": "moonshotai/Kimi-K2.5", "revision": commit, "dtype": "bfloat16", "max_model_len": 4096},
        "extract": {"tensor_parallel_size": 8},
        "engines": {"engine_args": {"max_num_seqs": 32, "enable_prefix_caching": False},
                    "benchmark": {"engine_args": {"max_num_batched_tokens": 8192}}}})
    ran = benchmark_kwargs(cfg, {"method": "eagle3", "model": "/tmp/benchmark-copy", "num_speculative_tokens": 3},
                        str(snapshot))
    assert ran["language_model_only"] and ran["tensor_parallel_size"] == 8 and ran["revision"] == commit
    serve = serve_settings(cfg, k=3, engine=ran)
    line = serve_command(serve, "/drafts/kimi")
    assert str(snapshot) not in line and "/tmp/benchmark-copy" not in line
    assert_serves_the_benchmark_engine(line, ran, "moonshotai/Kimi-K2.5", "/drafts/kimi")
    # another host only when asked (export --host, engines.serve_host)
    assert parse_serve_line(serve_command(serve, "/d", host="0.0.0.0"))[1][-2:] == ["--host", "0.0.0.0"]
    wide = serve_settings(cfg.model_copy(update={"engines": cfg.engines.model_copy(update={"serve_host": "10.0.0.5"})}),
                          k=3, engine=ran)
    assert shlex.split(serve_command(wide, "/d"))[-2:] == ["--host", "10.0.0.5"]


def test_one_store_is_one_uri_however_it_is_written(tmp_path, monkeypatch):
    """`make demo` writes to configs/demo.yaml's `file://.draftline/store`; `draftline export last` compares the run's
    store with its own as one URI (the message of issue 35: "wrote to file://.draftline/store, not file:///...")."""
    from tasks.core.config import canonical_uri

    monkeypatch.chdir(tmp_path)
    absolute = f"file://{tmp_path.resolve()}/.draftline/store"
    for written in ("file://.draftline/store", ".draftline/store", "file://./.draftline/store/", absolute,
                    absolute + "/", f"file://{tmp_path}/x/../.draftline/store"):
        assert canonical_uri(written) == absolute == Store(written).uri, written
    assert canonical_uri("s3://bucket/runs/") == canonical_uri("s3://bucket/runs") == "s3://bucket/runs"
    assert canonical_uri("file://other/store") != absolute


def test_best_k_is_the_best_measured_speedup():
    def fig(sp, al):
        return {"by_batch_size": {"1": {"speedup": sp, "mean_acceptance_length": al}}}

    rep = {"benchmark": {"a": {"1": fig(1.2, 1.5), "3": fig(1.4, 2.1)}, "b": {"1": fig(1.1, 1.4), "3": fig(1.3, 2.0)}}}
    assert best_k(rep) == 3
    rep["benchmark"]["a"]["3"] = fig(0.9, 2.1)  # more accepted tokens, but slower: k=1 serves better
    assert best_k(rep) == 1
    assert best_k({"benchmark": {}}) is None


# ============================================================================ addresses

def fake_draft(folder, payload: bytes = b"weights") -> str:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"speculators_model_type": "eagle3"}')
    (folder / "model.safetensors").write_bytes(payload)
    return str(folder)


def test_a_warm_start_and_other_drafts_enter_addresses_by_content_and_null_changes_nothing(tmp_path):
    v, shards, data = Ref("v"), [Ref("s0", 0), Ref("s1", 1)], Ref("d")
    plain = digests.train(RunConfig(), v, shards)
    assert digests.train(load_config(None, ["train.init_from=null"]), v, shards) == plain
    a = fake_draft(tmp_path / "a")
    b = str(shutil.copytree(a, tmp_path / "elsewhere" / "b"))  # the same files under another path
    c = fake_draft(tmp_path / "c", b"other weights")
    warm = {p: digests.train(load_config(None, [f"train.init_from={p}"]), v, shards) for p in (a, b, c)}
    assert warm[a] == warm[b] != plain and warm[c] not in (plain, warm[a])
    # benchmark.drafts: empty keeps the address; a draft's content (and name) enter it, not its path
    base = digests.benchmark(RunConfig(), Ref("t"), data)
    assert digests.benchmark(load_config(None, ["benchmark.drafts=[]"]), Ref("t"), data) == base
    with_a = digests.benchmark(load_config(None, [f"benchmark.drafts=[{{name: x, model: {a}}}]"]), Ref("t"), data)
    with_b = digests.benchmark(load_config(None, [f"benchmark.drafts=[{{name: x, model: {b}}}]"]), Ref("t"), data)
    with_c = digests.benchmark(load_config(None, [f"benchmark.drafts=[{{name: x, model: {c}}}]"]), Ref("t"), data)
    assert with_a == with_b and len({base, with_a, with_c}) == 3
    assert content_digest(a) == content_digest(b)


def test_a_draft_that_is_not_there_is_a_clear_error(tmp_path):
    with pytest.raises(DraftError, match="no such folder"):
        content_digest(str(tmp_path / "nothing"))
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(DraftError, match="has no model.safetensors"):
        content_digest(str(tmp_path / "half"))


# ============================================================================ compatibility and remapping

CONF = {"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "transformer_layer_config": {"hidden_size": 64, "vocab_size": 256, "num_hidden_layers": 1}}


def test_an_incompatible_draft_is_refused_with_the_reason_and_the_fix():
    ok = dict(hidden=64, vocab=256, layer_ids=[1, 2, 3, 4], num_layers=1, kind="eagle3")
    check_compatible(CONF, "d", **ok)
    cases = [({"hidden": 128}, "hidden size is 64, the target's 128: it was trained for another target"),
             ({"vocab": 300}, "maps a 256-token target vocabulary, the target has 300"),
             ({"num_layers": 2}, "1 decoder layer(s), this run trains 2: set train.num_layers: 1"),
             ({"layer_ids": [1, 3, 5, 6]}, "reads target layers [1, 2, 3], this run feeds [1, 3, 5]: its fc weights "
                                           "belong to those layers; set extract.layer_ids: [1, 2, 3, 6]"),
             ({"kind": "dflash"}, "this head (dflash) cannot start from a draft: a warm start seeds eagle3, "
                                  "eagle3.1, eagle3-mla heads only"),
             ({"kind": "eagle3.1"}, "the draft's kind is eagle3, this head (eagle3.1) is another: a warm start "
                                    "needs a draft of the head's own kind (set the head's kind: eagle3, or give an "
                                    "eagle3.1 draft)"),
             ({"kind": "eagle3-mla"}, "the draft's kind is eagle3, this head (eagle3-mla) is another")]
    for change, why in cases:
        with pytest.raises(DraftError) as exc:
            check_compatible(CONF, "pub/draft", **{**ok, **change})
        assert "train.init_from 'pub/draft' cannot seed this draft" in str(exc.value) and why in str(exc.value), \
            str(exc.value)


def test_rows_of_tokens_in_both_vocabularies_are_found():
    old_tokens, new_tokens = np.array([0, 3, 5, 9]), np.array([3, 4, 9])
    old_d2t = torch.tensor(old_tokens - np.arange(4))
    new_d2t = torch.tensor(new_tokens - np.arange(3))
    rows, tokens = remap_rows(old_d2t, None, new_d2t, 10)
    assert tokens.tolist() == [3, 4, 9] and rows.tolist() == [1, -1, 3]
    rows, _ = remap_rows(None, None, new_d2t, 10)  # a draft over the whole vocabulary: row = token
    assert rows.tolist() == [3, 4, 9]


# ============================================================================ warm start, for real (tiny target)

@pytest.fixture(scope="module")
def exp(tiny):
    """tests/unit/train/test_heads.py's 4-layer target and its stored hidden states, a draft trained on them and exported."""
    cfg = train_cfg(tiny.path)
    trained = run_train(cfg, tiny.store, tiny.vref, extract_stage(tiny.store, tiny.refs))
    dest = Path(tiny.store.uri.removeprefix("file://")).parent / "exported"
    out = export_draft(tiny.store, trained.digest, str(dest), run_serve(cfg, tiny.store, trained))
    return SimpleNamespace(**vars(tiny), trained=trained, dest=dest, out=out, cfg=cfg)


def train_cfg(path: str, **train) -> RunConfig:
    section = {"max_steps": 30, "batch_tokens": 128, "warmup_steps": 1, "lr": 3e-3, "eval_batches": 1,
               "min_lr_ratio": 1.0, **train}
    return RunConfig.model_validate({"target": {"model": path}, "extract": {"layer_ids": LAYER_IDS},
                                     "train": section})


def test_export_writes_the_draft_its_maps_and_a_readme_with_the_serve_line(exp):
    art = exp.store.open("train", exp.trained.digest)
    for name in ("config.json", "model.safetensors"):
        assert (exp.dest / "draft" / name).read_bytes() == art.read_bytes(f"draft/{name}")
    d2t = json.loads((exp.dest / "vocab/d2t.json").read_text())
    t2d = json.loads((exp.dest / "vocab/t2d.json").read_text())
    w = load_file(str(exp.dest / "draft/model.safetensors"))
    assert d2t == w["d2t"].tolist() and t2d == w["t2d"].nonzero().flatten().tolist() and len(t2d) == 128
    line = exp.out["serve"]["command"]
    assert shlex.split(line)[:3] == ["vllm", "serve", exp.path]
    assert json.loads(shlex.split(line)[4])["model"] == str(exp.dest / "draft")
    assert line in (exp.dest / "README.md").read_text()
    serve = json.loads((exp.dest / "serve.json").read_text())
    assert serve["k"] == 3 and serve["measured"] is False  # not benchmarked: the trained positions
    assert sorted(exp.out["files"]) == ["README.md", "draft/config.json", "draft/model.safetensors", "serve.json",
                                         "vocab/d2t.json", "vocab/t2d.json"]


def _drifted(exp) -> object:
    """A train artifact like exp's whose draft maps one draft id to the next target token (its d2t drifted)."""
    from safetensors.torch import save

    from tasks.core.digest import VERSIONS, stage_digest

    digest = stage_digest("train", {"drifted": 1})
    if (found := exp.store.find("train", digest)) is not None:
        return found.ref()
    art = exp.store.open("train", exp.trained.digest)
    w = load_file(str(exp.dest / "draft/model.safetensors"))
    w["d2t"] = w["d2t"].clone()
    w["d2t"][0] += 1
    with exp.store.write("train", digest, VERSIONS["train"],
                         inputs=dict(art.manifest.inputs)) as wr:
        wr.write_bytes("draft/config.json", art.read_bytes("draft/config.json"))
        wr.write_bytes("draft/model.safetensors", save(w))
        return wr.commit(dict(art.stats)).ref()


def test_check_gives_one_verdict_on_a_draft_and_fails_a_drifted_one(exp):
    """`draftline check`: the evidence the store holds for a draft (its shards' self-check, its maps, coverage,
    lengths, training and benchmark), and exit 1 with the cause when a check fails."""
    from typer.testing import CliRunner

    from cli.app import app

    def check(digest: str):
        r = CliRunner().invoke(app, ["check", digest, "--store", exp.store.uri, "--json"])
        return r.exit_code, {c["check"]: c for c in json.loads(r.stdout)["checks"]}

    code, rows = check(exp.trained.digest)
    assert code == 0, rows
    assert list(rows) == ["states", "maps", "coverage", "lengths", "trained", "measured"]
    # this fixture's shards are written by tests/support/train_data.py, not through the extract stage: unchecked (the
    # checked case is in tests/unit/extract/test_extract.py)
    assert rows["states"]["status"] == "warn" and "stored unchecked" in rows["states"]["evidence"]
    assert rows["maps"]["status"] == "ok" and "byte for byte" in rows["maps"]["evidence"]
    assert rows["trained"]["status"] == "ok" and rows["measured"]["status"] == "missing"  # never benchmarked
    code, rows = check(_drifted(exp).digest)
    assert code == 1 and rows["maps"]["status"] == "fail"
    assert "the draft's d2t differs from the one its training read" in rows["maps"]["evidence"]
    # as a user runs it (a fresh process): the same verdict on the maps, without importing torch (seconds)
    argv = ["draftline", "check", exp.trained.digest, "--store", exp.store.uri, "--json"]
    code = (f"import sys; sys.argv = {argv!r}\nfrom cli.app import app\ntry:\n    app()\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'prefect')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stderr[-2000:]
    rows = {c["check"]: c for c in json.loads(out.stdout[:out.stdout.rindex("\n[")])["checks"]}
    assert rows["maps"]["status"] == "ok" and "byte for byte" in rows["maps"]["evidence"]


def test_check_says_when_there_is_no_map_to_compare_and_names_a_draft_without_weights(exp):
    """A draft over the whole target vocabulary (no d2t/t2d in its weights) has no map to compare with training's:
    `check` says so rather than "equal". A train artifact without draft/model.safetensors is a failed check naming
    the file, never a traceback."""
    from safetensors.torch import save
    from typer.testing import CliRunner

    from cli.app import app

    def check(digest: str):
        r = CliRunner().invoke(app, ["check", digest, "--store", exp.store.uri, "--json"])
        assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
        return r.exit_code, {c["check"]: c for c in json.loads(r.stdout)["checks"]}

    w = load_file(str(exp.dest / "draft/model.safetensors"))
    whole = _with_draft_files(exp, "whole-vocab", {"draft/model.safetensors": save(
        {k: v for k, v in w.items() if k not in ("d2t", "t2d")})})
    code, rows = check(whole)
    assert code == 0 and rows["maps"]["status"] == "ok", rows["maps"]
    assert "no map to compare: the draft holds no d2t/t2d" in rows["maps"]["evidence"]
    assert "byte for byte" not in rows["maps"]["evidence"]

    empty = _with_draft_files(exp, "no-weights", {"draft/model.safetensors": None})
    code, rows = check(empty)
    assert code == 1 and rows["maps"]["status"] == "fail", rows["maps"]
    assert f"train/{empty} holds no draft/model.safetensors" in rows["maps"]["evidence"]
    assert rows["maps"]["fix"] == "re-run the train stage"


def test_check_lengths_sets_the_training_length_distribution_against_the_contexts_served(tmp_path):
    """`draftline check`'s lengths row: the prepared data's samples per context-length bucket and its longest
    sample against each eval's longest prompt + benchmark.max_tokens; the fix when training falls short."""
    from tasks.benchmark.evidence import lengths
    from tasks.store.artifacts import Store

    store = Store(f"file://{tmp_path}/store")
    with store.write("prepare", "p" * 32, "v", {}) as w:
        w.write_bytes("x", b"x")
        w.commit({"samples": 4, "tokens": 1200, "length_buckets": {"<512": 3, "512-2K": 1}, "longest": 700,
                  "max_length": 2048})
    report = {"settings": {"max_tokens": 64},
              "evals": {"mtbench": {"prompt_tokens_max": 100}, "long": {"prompt_tokens_max": 4000}}}
    f = lengths(store, "p" * 32, report)
    assert f.status == "warn", f
    assert "the longest 700 (<512: 3, 512-2K: 1)" in f.evidence and "served up to 4,064 (long" in f.evidence
    assert "eval long's contexts reach 4,064 tokens" in f.evidence and "no training sample in 2K-8K" in f.evidence
    assert "mtbench" not in f.evidence.split("served up to")[1] and "raise data.max_length" in f.fix
    report["evals"].pop("long")
    assert lengths(store, "p" * 32, report).status == "ok"
    assert lengths(store, "p" * 32, None).evidence.endswith("no benchmark yet to compare with")


def test_check_coverage_adds_each_benchmark_evals_share_of_the_targets_output(tmp_path):
    from tasks.benchmark.evidence import coverage
    from tasks.store.artifacts import Store

    store = Store(f"file://{tmp_path}/store")
    with store.write("vocab", "v" * 32, "v", {}) as w:
        w.write_bytes("x", b"x")
        w.commit({"coverage": 0.97, "heldout_coverage": 0.95, "draft_vocab_size": 8192})
    report = {"evals": {"mtbench": {"draft_vocab_coverage": 0.875}, "heldout": {"draft_vocab_coverage": 0.9612}}}
    f = coverage(store, "v" * 32, report)
    assert f.status == "ok" and f.evidence.endswith("of the target's output on each benchmark eval: mtbench 87.5%, "
                                                    "heldout 96.1%"), f
    assert "benchmark eval" not in coverage(store, "v" * 32, None).evidence


def test_the_exported_maps_are_trainings_byte_for_byte_and_a_drifted_draft_is_refused(exp, tmp_path):
    """The draft vLLM will serve proposes ids through its d2t/t2d: they must be the vocab artifact's that
    training read, byte for byte. A train artifact whose draft carries other maps is not exported."""
    from tasks.benchmark.serve import ExportError
    from tasks.formats.vocab_maps import read_maps

    maps = read_maps(exp.store, exp.vref)
    w = load_file(str(exp.dest / "draft/model.safetensors"))
    for name in ("d2t", "t2d"):
        assert w[name].dtype == maps[name].dtype and w[name].numpy().tobytes() == maps[name].numpy().tobytes()

    drifted = _drifted(exp)
    with pytest.raises(ExportError, match="the draft's d2t differs from the one its training read"):
        export_draft(exp.store, drifted.digest, str(tmp_path / "out"), run_serve(exp.cfg, exp.store, exp.trained))
    assert not (tmp_path / "out").exists()


def _forged(exp, path: str) -> str:
    """A copy of the trained draft's manifest under a new digest that names `path` (as a store's writer could)."""
    art = exp.store.open("train", exp.trained.digest)
    m = json.loads(art.manifest.model_dump_json())
    digest = "f" * 8 + exp.trained.digest[8:]
    m["digest"], m["files"][0]["path"] = digest, path
    folder = Path(exp.store.root) / "train" / digest
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps(m))
    return digest


@pytest.mark.parametrize("path", ["draft/../../../../escaped", "/tmp/draftline-escaped", "draft//x", "."])
def test_a_manifest_naming_a_path_out_of_its_folder_is_refused_and_nothing_is_written(exp, tmp_path, path):
    from tasks.store.artifacts import ArtifactCorrupt

    digest = _forged(exp, path)
    dest = tmp_path / "out"
    with pytest.raises(ArtifactCorrupt, match="leaves the artifact's folder"):
        export_draft(exp.store, digest, str(dest), run_serve(exp.cfg, exp.store, exp.trained))
    assert not dest.exists() and not Path("/tmp/draftline-escaped").exists()
    assert not list(Path(exp.store.root).parent.glob("escaped")) and exp.store.find("train", digest) is None
    assert digest not in {m.digest for m in exp.store.list("train")}  # listed as nothing, never crashes ls


def test_export_refuses_to_replace_a_users_files_unless_forced_and_never_follows_a_planted_link(exp, tmp_path):
    serve = run_serve(exp.cfg, exp.store, exp.trained)
    dest = tmp_path / "repo"
    dest.mkdir()
    (dest / "README.md").write_text("my project")
    with pytest.raises(ValueError, match=r"already holds README.md.*--force"):
        export_draft(exp.store, exp.trained.digest, str(dest), serve)
    assert (dest / "README.md").read_text() == "my project" and not (dest / "draft").exists()
    export_draft(exp.store, exp.trained.digest, str(dest), serve, force=True)
    assert "vllm serve" in (dest / "README.md").read_text()
    export_draft(exp.store, exp.trained.digest, str(dest), serve)  # its own earlier export: replaced freely
    (dest / "serve.json").write_text("{}")  # changed since: no longer what the export wrote
    with pytest.raises(ValueError, match=r"already holds serve.json"):
        export_draft(exp.store, exp.trained.digest, str(dest), serve)
    # a planted `*.part` link beside a file the export writes: refused, the link's target untouched
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    fresh = tmp_path / "fresh"
    (fresh / "vocab").mkdir(parents=True)
    (fresh / "vocab" / "d2t.json.part").symlink_to(victim)
    with pytest.raises(ValueError, match="is a symlink"):
        export_draft(exp.store, exp.trained.digest, str(fresh), serve)
    assert victim.read_text() == "precious" and not (fresh / "README.md").exists()


def _with_draft_files(exp, tag: str, files: dict[str, bytes | None]) -> str:
    """A train artifact like exp's with draft files replaced, added or (None) left out (as a writer to the store
    could commit)."""
    from tasks.core.digest import VERSIONS, stage_digest

    digest = stage_digest("train", {"planted": tag})
    art = exp.store.open("train", exp.trained.digest)
    with exp.store.write("train", digest, VERSIONS["train"], inputs=dict(art.manifest.inputs)) as wr:
        for name in art.files():
            if name not in files:
                wr.write_bytes(name, art.read_bytes(name))
        for name, data in files.items():
            if data is not None:
                wr.write_bytes(name, data)
        wr.commit(dict(art.stats))
    return digest


@pytest.mark.parametrize("plant,why", [
    ({"auto_map": {"AutoConfig": "evil.EvilConfig"}}, "has an auto_map"),
    ({"model_type": "evil_arch"}, "model_type 'evil_arch', not a draft type"),
    ({"architectures": ["EvilForCausalLM"]}, "names architectures ['EvilForCausalLM']"),
    ({"transformer_layer_config": {"model_type": "evil_layer"}}, "transformer_layer_config of model_type 'evil_layer'"),
])
def test_a_draft_config_that_names_code_is_refused_by_check_and_export(exp, tmp_path, plant, why):
    """Drafts are data, never code: a draft config.json with an auto_map, or a model type or architecture that is not
    a draft's, would have vLLM (with the target's trust_remote_code) import a module from the draft's folder. The
    benchmark's check and `draftline export` refuse it, naming why."""
    from transformers import AutoConfig

    from tasks.benchmark.serve import ExportError
    from tasks.benchmark.stage import BenchmarkError, check_draft, draft_folder

    conf = json.loads(exp.store.open("train", exp.trained.digest).read_bytes("draft/config.json"))
    conf.update(plant)
    digest = _with_draft_files(exp, why, {"draft/config.json": json.dumps(conf).encode(),
                                          "draft/evil.py": b"open('/tmp/pwned', 'w')\n"})
    import re

    with pytest.raises(ExportError, match=f"{re.escape(why)}.*refused"):
        export_draft(exp.store, digest, str(tmp_path / "out"), run_serve(exp.cfg, exp.store, exp.trained))
    assert not (tmp_path / "out").exists()
    with draft_folder(exp.store.open("train", digest)) as folder, pytest.raises(BenchmarkError, match=re.escape(why)):
        check_draft(folder, AutoConfig.from_pretrained(exp.path))


def test_an_unlisted_or_listed_py_never_reaches_vllms_folder_or_the_export(exp, tmp_path):
    """vLLM and the export get a fresh folder of the draft's data files: a module a store writer put in the
    attempt's draft folder (unlisted), or listed in the manifest, is in neither; the serve line's
    --trust-remote-code (the target's) says it is not the draft's."""
    from tasks.benchmark.stage import draft_folder

    digest = _with_draft_files(exp, "py", {"draft/listed.py": b"raise SystemExit('pwned')\n"})
    art = exp.store.open("train", digest)
    own = Path(art.key("draft/config.json")).parent
    (own / "unlisted.py").write_text("raise SystemExit('pwned')\n")
    with draft_folder(art) as folder:
        assert Path(folder) != own and sorted(p.name for p in Path(folder).iterdir()) == \
            ["config.json", "model.safetensors"]
    serve = run_serve(exp.cfg, exp.store, exp.trained)
    serve = {**serve, "engine": {**serve["engine"], "trust_remote_code": True}}
    out = export_draft(exp.store, digest, str(tmp_path / "out"), serve)
    assert not list((tmp_path / "out").rglob("*.py")) and "draft/listed.py" not in out["files"]
    assert any("--trust-remote-code is the target's" in line for line in out["serve"]["lines"])


def test_a_runs_serve_line_names_a_fresh_export_never_the_stores_attempt_folder(exp):
    """On a file:// store too, the line a run prints serves the folder `draftline export` writes (the draft's listed
    files only), not the attempt's own folder, where a store writer could put anything beside them."""
    import os

    serve = run_serve(exp.cfg, exp.store, exp.trained)
    own = os.path.dirname(exp.store.open("train", exp.trained.digest).key("draft/config.json"))
    assert not any(own in line for line in serve["lines"])
    folder = f"./draft-{exp.trained.digest[:8]}"
    assert shlex.split(serve["lines"][0].split("#")[0]) == ["draftline", "export", exp.trained.digest, folder]
    assert json.loads(shlex.split(serve["command"])[4])["model"] == os.path.abspath(folder) == serve["draft"]


def test_the_export_record_is_never_written_through_a_planted_link(exp, tmp_path):
    """`DEST/.draftline-export.json` planted as a link to another file: the export refuses before writing anything,
    and the link's target is untouched."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / ".draftline-export.json").symlink_to(victim)
    with pytest.raises(ValueError, match="is a symlink"):
        export_draft(exp.store, exp.trained.digest, str(dest), run_serve(exp.cfg, exp.store, exp.trained))
    assert victim.read_text() == "precious" and not (dest / "README.md").exists()


def test_warm_start_from_an_export_starts_at_its_loss(exp):
    events: list[dict] = []
    warm = run_train(train_cfg(exp.path, max_steps=2, init_from=str(exp.dest / "draft")), exp.store, exp.vref,
                     extract_stage(exp.store, exp.refs), on_metrics=events.append)
    assert warm.digest != exp.trained.digest
    init = warm.stats["init_from"]
    assert init["vocab"] == "same" and init["draft_vocab_rows_copied"] == 128
    assert init["digest"] == content_digest(str(exp.dest / "draft"))
    fresh = exp.store.open("train", exp.trained.digest).read_json("metrics.json")["steps"]
    first = [e for e in events if e.get("kind") == "train"][0]["loss"]
    assert first < 0.7 * fresh[0]["loss"], (first, fresh[0]["loss"], fresh[-1]["loss"])
    start = next(e for e in events if e.get("kind") == "start")
    assert start["init_from"]["note"].startswith("the same draft vocabulary")


def test_warm_start_with_another_draft_vocabulary_copies_the_shared_rows(exp):
    other = write_vocab(exp.store, exp.samples, 256, 64, tag="smaller")
    ref = run_train(train_cfg(exp.path, max_steps=1, init_from=str(exp.dest / "draft")), exp.store, other,
                    extract_stage(exp.store, exp.refs))
    init = ref.stats["init_from"]
    old = set(json.loads((exp.dest / "vocab/t2d.json").read_text()))
    art = exp.store.open("train", ref.digest)
    from safetensors.torch import load as st_load

    new_w = st_load(art.read_bytes("draft/model.safetensors"))
    new_tokens = new_w["t2d"].nonzero().flatten().tolist()
    assert init["vocab"] == "remapped" and init["draft_vocab_size"] == 64
    assert init["draft_vocab_rows_copied"] == len(old & set(new_tokens)) > 0
    assert "another draft vocabulary: lm_head rows of the" in init["note"]


def test_a_warm_start_that_cannot_fit_fails_before_training(exp):
    with pytest.raises(TrainError, match=r"1 decoder layer\(s\), this run trains 2"):
        run_train(train_cfg(exp.path, max_steps=1, num_layers=2, init_from=str(exp.dest / "draft")), exp.store,
                  exp.vref, extract_stage(exp.store, exp.refs))
    # another target (hidden 32): refused by the warm start itself, on a draft built for that target
    from tasks.formats.drafts import warm_start
    from tasks.engine.target import load_hf_config
    from tasks.train.model import build_draft_model

    other = make_tiny_target(exp.dest.parent / "wider", hidden=32)
    cfg = train_cfg(other)
    t2d = torch.zeros(256, dtype=torch.bool)
    t2d[:128] = True
    model = build_draft_model(cfg.train, cfg.target, other, load_hf_config(cfg.target, other), LAYER_IDS,
                              torch.zeros(128, dtype=torch.long), t2d)
    with pytest.raises(DraftError, match="hidden size is 64, the target's 32"):
        warm_start(model, str(exp.dest / "draft"), layer_ids=LAYER_IDS, kind="eagle3", num_layers=1)
