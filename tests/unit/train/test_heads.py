"""Draft heads beyond EAGLE-3 (train.heads): their addresses, and EAGLE-3.1 and DFlash trained from the
same stored hidden states and exported in the format vLLM loads.

The whole chain (one `draftline run`, every head measured in vLLM's CPU build, one table) is in
tests/e2e/test_e2e.py; these are the fast parts, on the 4-layer random target of tests/unit/train/test_train.py.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load as st_load

from tasks.address import digests
from tasks.core.config import HeadConfig, RunConfig, head_config
from tasks.core.config_load import load_config
from tasks.core.errors import ConfigError
from tasks.store.artifacts import Store
from tasks.train.stage import run_train
from tasks.train import TrainError
from tasks.train.inputs import head_layer_ids
from tasks.train.model import speculators_kind
from train_data import extract_stage, generate_samples, make_tiny_target, write_extract, write_vocab

LAYER_IDS = [1, 2, 3, 4]


class Ref:
    def __init__(self, d, shard=0):
        self.digest, self.stats = d, {"shard": shard}


V, SHARDS = Ref("v"), [Ref("s0", 0), Ref("s1", 1)]


def heads(*items: str) -> RunConfig:
    return load_config(None, [f"train.heads=[{', '.join(items)}]"])


# ============================================================================ addresses


def test_the_default_head_keeps_the_address_drafts_were_stored_at():
    """A config without train.heads, one naming the default head, and one giving it a label train the
    same draft at the same address (tests/unit/flows/test_caching.py pins that address against stored artifacts)."""
    plain = digests.train(RunConfig(), V, SHARDS)
    assert digests.train(heads("{kind: eagle3}"), V, SHARDS) == plain
    assert digests.train(heads("{kind: eagle3, name: main}"), V, SHARDS) == plain
    cfg = heads("{kind: eagle3}", "{kind: eagle3.1}", "{kind: dflash}")
    assert digests.train(cfg, V, SHARDS, cfg.train.heads[0]) == plain
    # benchmark: one head as before; several heads give it another address
    assert digests.benchmark(RunConfig(), Ref("t"), Ref("d")) == digests.benchmark(
        RunConfig(), [("eagle3", Ref("t"))], Ref("d"))
    assert digests.benchmark(cfg, [("eagle3", Ref("t")), ("dflash", Ref("x"))], Ref("d")) != digests.benchmark(
        cfg, Ref("t"), Ref("d"))


def test_each_head_gets_its_own_address_and_equal_recipes_share_one():
    cfg = heads("{kind: eagle3}", "{kind: eagle3.1}", "{kind: dflash}", "{kind: dflash, name: d4, block_size: 4}",
                "{kind: eagle3, name: short, max_steps: 20}")
    addr = [digests.train(cfg, V, SHARDS, h) for h in cfg.train.heads]
    assert len(set(addr)) == len(addr), addr
    # a per-head override is the train key it replaces; DFlash's defaults written out are the defaults
    assert addr[4] == digests.train(load_config(None, ["train.max_steps=20"]), V, SHARDS)
    assert addr[2] == digests.train(heads("{kind: dflash, block_size: 8, max_anchors: 512}"), V, SHARDS)
    # the per-head config a train task (and its ranks) gets has that one head
    one = head_config(cfg, cfg.train.heads[3])
    assert one.train.heads == [cfg.train.heads[3]] and digests.train(one, V, SHARDS) == addr[3]
    with pytest.raises(ValueError, match="3 heads"):
        digests.train(heads("{kind: eagle3}", "{kind: eagle3.1}", "{kind: dflash}"), V, SHARDS)


def test_bad_heads_are_config_errors_that_say_what_to_do():
    with pytest.raises(ConfigError, match=r"train.heads.0.kind: Input should be 'eagle3', 'eagle3.1', 'eagle3-mla', "
                                          r"'dflash' or 'dspark'"):
        heads("{kind: medusa}")
    with pytest.raises(ConfigError, match="head labels must be unique"):
        heads("{kind: dflash}", "{kind: dflash}")
    with pytest.raises(ConfigError, match="block_size apply to dflash and dspark heads only"):
        heads("{kind: eagle3.1, block_size: 4}")
    with pytest.raises(ConfigError, match="at least one head"):
        load_config(None, ["train.heads=[]"])
    with pytest.raises(ConfigError, match="distinct and ascending"):
        heads("{kind: dflash, layer_ids: [9, 3]}")


def test_an_mla_head_on_a_target_without_mla_is_a_clear_error(tiny):
    from tasks.engine.target import load_hf_config
    from tasks.train.model import draft_layer_config

    cfg = head_cfg(tiny, {"kind": "eagle3-mla"})
    # `draftline run` and `draftline plan` refuse it before any work (tests/unit/cli/test_bad_input.py, tests/unit/cost/test_plan.py);
    # the train stage asks again
    with pytest.raises(TrainError, match=r"head 'eagle3-mla' is eagle3-mla, which needs an MLA target .* has llama "
                                         r"layers without MLA. Fix: give that head kind eagle3 or eagle3.1"):
        draft_layer_config(cfg.train, cfg.target, str(tiny.path), load_hf_config(cfg.target, str(tiny.path)),
                           kind="eagle3-mla")


def test_a_speculators_without_the_kind_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "speculators.models.dflash", None)  # import fails as if it were not there
    with pytest.raises(TrainError, match=r"asks for a dflash head, but the installed speculators .* has no "
                                         r"speculators.models.dflash.DFlashDraftModel"):
        speculators_kind("dflash")


# ============================================================================ training and export


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("tiny-heads")
    path = make_tiny_target(root / "target")
    store = Store(f"file://{root}/store")
    samples = generate_samples(path, 12, prompt_len=6, new_tokens=26)
    refs = write_extract(store, path, samples, LAYER_IDS)
    yield SimpleNamespace(path=path, store=store, samples=samples, vref=write_vocab(store, samples, 256, 128),
                          refs=refs)
    torch.set_num_threads(before)


def head_cfg(tiny, head: dict, **train) -> RunConfig:
    section = {"max_steps": 3, "batch_tokens": 128, "warmup_steps": 1, "lr": 3e-3, "eval_batches": 1,
               "heads": [head], **train}
    return RunConfig.model_validate({"target": {"model": tiny.path}, "extract": {"layer_ids": LAYER_IDS},
                                     "train": section})


def exported(tiny, ref) -> tuple[dict, dict]:
    art = tiny.store.open("train", ref.digest)
    return json.loads(art.read_bytes("draft/config.json")), st_load(art.read_bytes("draft/model.safetensors"))


def safetensors_shapes(blob: bytes) -> dict[str, list[int]]:
    """Each tensor's shape from a safetensors file's header (8 bytes of length, then JSON)."""
    n = int.from_bytes(blob[:8], "little")
    return {k: v["shape"] for k, v in json.loads(blob[8:8 + n]).items() if k != "__metadata__"}


def vllm026_dflash_fc_input_size(hf: dict) -> int:
    """The fc input size vLLM 0.26.0 builds for a DFlash/DSpark draft, from the HF config its speculators reader
    makes: model_executor/models/qwen3_dflash.py, DFlashQwen3Model.__init__ (0.26.0, lines 356-406):
        drafter_config = getattr(self.config, "eagle_config", {})
        drafter_config.update(getattr(self.config, "dflash_config", {}))
        num_features_to_use = self.config.num_hidden_layers
        if "target_layer_ids" in drafter_config: num_features_to_use = len(drafter_config["target_layer_ids"])
        elif "layer_ids" in drafter_config: num_features_to_use = len(drafter_config["layer_ids"])
        fc_input_size = (target_hidden_size if present else hidden_size) * num_features_to_use
    (the top-level `target_layer_ids` its update_dspark sets is not read there)."""
    drafter = {**(hf.get("eagle_config") or {}), **(hf.get("dflash_config") or {})}
    n = hf["num_hidden_layers"]
    if "target_layer_ids" in drafter:
        n = len(drafter["target_layer_ids"])
    elif "layer_ids" in drafter:
        n = len(drafter["layer_ids"])
    return (hf["target_hidden_size"] if "target_hidden_size" in hf else hf["hidden_size"]) * n


def test_eagle31_head_trains_with_per_layer_fc_norms(tiny):
    ref = run_train(head_cfg(tiny, {"kind": "eagle3.1"}), tiny.store, tiny.vref, extract_stage(tiny.store, tiny.refs))
    conf, weights = exported(tiny, ref)
    assert conf["speculators_model_type"] == "eagle3"
    assert (conf["fc_norm"], conf["norm_before_fc"], conf["norm_output"]) == (True, False, True)
    assert any(k.startswith("fc_norm") for k in weights), sorted(weights)
    assert ref.stats["head_kind"] == "eagle3.1" and ref.stats["head"] == "eagle3.1"
    default = run_train(head_cfg(tiny, {"kind": "eagle3"}), tiny.store, tiny.vref, extract_stage(tiny.store, tiny.refs))
    assert default.digest != ref.digest
    conf3, _ = exported(tiny, default)
    assert (conf3["fc_norm"], conf3["norm_before_fc"], conf3["norm_output"]) == (False, True, True)


def test_dflash_head_trains_from_the_same_hidden_states_and_exports_what_vllm_reads(tiny):
    events: list[dict] = []
    ref = run_train(head_cfg(tiny, {"kind": "dflash", "block_size": 4, "max_anchors": 16, "mask_token_id": 0}),
                    tiny.store, tiny.vref, extract_stage(tiny.store, tiny.refs), on_metrics=events.append)
    conf, weights = exported(tiny, ref)
    # what vLLM's speculators loader (update_dflash) reads: the layers, the mask token, the block's causality
    assert conf["speculators_model_type"] == "dflash" and conf["architectures"] == ["DFlashDraftModel"]
    assert conf["aux_hidden_state_layer_ids"] == LAYER_IDS[:-1]
    assert (conf["block_size"], conf["mask_token_id"], conf["sample_from_anchor"]) == (4, 0, False)
    assert conf["sliding_window_non_causal"] is True  # vLLM decodes the block bidirectionally, as trained
    assert conf["transformer_layer_config"]["model_type"] == "qwen3"
    assert conf["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert weights["fc.weight"].shape == (64, 3 * 64) and "embed_tokens.weight" not in weights
    steps = [e for e in events if e["kind"] == "train"]
    assert len(steps) == 3 and all(len(e["acc_per_pos"]) == 3 and "expected_acceptance_length" in e for e in steps)
    st = ref.stats
    assert st["head_kind"] == "dflash" and len(st["val_acc_per_pos"]) == 3 and st["simulated_acceptance_length"] >= 1


def test_dspark_head_trains_its_markov_and_confidence_heads_and_exports_what_vllm_reads(tiny):
    """DSpark (speculators' DSparkDraftModel) from the same stored states: DFlash's backbone plus a Markov
    logit-bias head and a confidence head, trained with speculators' DSpark loss, the anchor the bonus token."""
    events: list[dict] = []
    ref = run_train(head_cfg(tiny, {"kind": "dspark", "block_size": 4, "max_anchors": 16, "mask_token_id": 0}),
                    tiny.store, tiny.vref, extract_stage(tiny.store, tiny.refs), on_metrics=events.append)
    conf, weights = exported(tiny, ref)
    # what vLLM's speculators loader (update_dspark -> Qwen3DSparkModel) reads
    assert conf["speculators_model_type"] == "dspark" and conf["architectures"] == ["DSparkDraftModel"]
    assert conf["aux_hidden_state_layer_ids"] == LAYER_IDS[:-1] and conf["transformer_layer_config"]["model_type"] == "qwen3"
    assert (conf["block_size"], conf["mask_token_id"], conf["sample_from_anchor"]) == (4, 0, False)
    assert (conf["markov_rank"], conf["markov_head_type"], conf["enable_confidence_head"],
            conf["confidence_head_with_markov"]) == (256, "vanilla", True, True)
    assert conf["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3  # the anchor is the bonus
    assert weights["markov_head.markov_w1.weight"].shape == (256, 256)  # target vocabulary x rank
    assert weights["markov_head.markov_w2.weight"].shape == (128, 256)  # draft vocabulary x rank
    assert weights["confidence_head.proj.weight"].shape == (1, 64 + 256) and "confidence_head.proj.bias" in weights
    steps = [e for e in events if e["kind"] == "train"]
    assert len(steps) == 3 and all(len(e["acc_per_pos"]) == 3 and "expected_acceptance_length" in e for e in steps)
    assert all(e["loss"] == e["loss"] and e["loss"] > 0 for e in steps)
    st = ref.stats
    assert st["head_kind"] == "dspark" and len(st["val_acc_per_pos"]) == 3 and st["simulated_acceptance_length"] >= 1
    assert all(0 <= a <= 1 for a in st["val_acc_per_pos"]), st["val_acc_per_pos"]
    # vLLM's own reading of it (its speculators loader, no engine): a Qwen3 DSpark draft, method dspark, the
    # anchor the bonus token (what vLLM 0.26's loader assumes of every speculators DSpark draft), DSpark's i - 1
    # layer numbering, every head it builds
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    assert SpeculatorsConfig.extract_vllm_speculative_config(conf) == {"method": "dspark", "num_speculative_tokens": 3}
    pre = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(conf)))
    assert pre["architectures"] == ["Qwen3DSparkModel"] and pre["target_layer_ids"] == [i - 1 for i in LAYER_IDS[:-1]]
    assert (pre["dspark_bonus_anchor"], pre["markov_rank"], pre["confidence_head_with_markov"]) == (True, 256, True)
    # vLLM 0.26 (the lent GPU's) sizes the fc it loads by the rule below: the config vLLM builds gives the fc the
    # exported weight has (one draft layer reading three target layers: 64 x 3 inputs, not 64 x 1)
    fc_in = safetensors_shapes(tiny.store.open("train", ref.digest).read_bytes("draft/model.safetensors"))["fc.weight"][1]
    assert conf["transformer_layer_config"]["num_hidden_layers"] == 1 and len(LAYER_IDS[:-1]) == 3
    assert pre["dflash_config"] == {"target_layer_ids": [i - 1 for i in LAYER_IDS[:-1]]}
    assert vllm026_dflash_fc_input_size(pre) == fc_in == 64 * 3
    # ...and the block vLLM 0.26 reads changes nothing in the installed vLLM's (0.32) reading of the draft: the
    # same keys but dflash_config, the same fc size, attention per layer, causality and mask token
    from vllm.model_executor.models import qwen3_dflash

    plain = {**conf, "transformer_layer_config": {k: v for k, v in conf["transformer_layer_config"].items()
                                                  if k != "dflash_config"}}
    bare = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(plain)))
    assert {k: v for k, v in pre.items() if k != "dflash_config"} == bare and "dflash_config" not in bare
    seen = []
    for p in (pre, bare):
        hf = SpeculatorsConfig(**json.loads(json.dumps(p)))
        seen.append((qwen3_dflash.dflash_has_any_non_causal(hf), qwen3_dflash._resolve_layer_attention(hf, 0),
                     qwen3_dflash._get_dflash_fc_input_size(SimpleNamespace(speculative_config=SimpleNamespace(
                         draft_model_config=SimpleNamespace(hf_config=hf)))),
                     {**getattr(hf, "eagle_config", {}), **getattr(hf, "dflash_config", {})}.get(
                         "mask_token_id", getattr(hf, "mask_token_id", None))))
    # non-causal full attention in the block (as trained), the fc of the weights, mask token 0 (the head's)
    assert seen[0] == seen[1] == (True, (None, False), fc_in, 0), seen
    # the same recipe as a DFlash head is another head: its own address
    cfg = heads("{kind: dflash}", "{kind: dspark}")
    assert len({digests.train(cfg, V, SHARDS, h) for h in cfg.train.heads}) == 2


def test_block_heads_are_scored_over_whole_blocks_so_no_position_beats_certainty():
    """Held-out scoring of a DFlash-family head: two blocks of 3 drafted slots, one whole and all right, one cut
    by its document's end after a right and a wrong slot. Counting the cut block at its early slots only gave the
    last slot a conditional accuracy of 2.0; over whole blocks every slot is 1.0."""
    from tasks.train.evaluation import _block_eval_batch
    from tasks.train.loop import forward_kwargs

    class Block:  # a DFlash head's backbone output for those two blocks (anchor slot first)
        block_size, config = 4, SimpleNamespace(sample_from_anchor=False)

        def _backbone_forward(self, max_anchors):
            pred, target = [0, 1, 2, 3, 0, 1, 0, 3], [0, 1, 2, 3, 0, 1, 2, 3]
            logits = torch.nn.functional.one_hot(torch.tensor([pred]), 4).float() * 9
            targets = torch.nn.functional.one_hot(torch.tensor([target]), 4).float() * 9
            mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0]])
            return None, logits, targets, mask, torch.arange(8)

    kw = forward_kwargs(head_config(heads("{kind: dflash, block_size: 4, max_anchors: 2}"),
                                    HeadConfig(kind="dflash", block_size=4, max_anchors=2)).train)
    _, m = _block_eval_batch(Block(), {}, kw)
    assert [(m[f"full_acc_{i}_sum"], m[f"full_acc_{i}_total"]) for i in range(3)] == [(1.0, 1.0)] * 3
    from tasks.train import ratios

    assert ratios(m, 3)["acc_per_pos"] == [1.0, 1.0, 1.0]


def test_a_head_reads_a_subset_of_the_stored_layers_and_names_extract_layer_ids_for_the_rest(tiny, monkeypatch):
    ref = run_train(head_cfg(tiny, {"kind": "dflash", "name": "two", "block_size": 3, "max_anchors": 8,
                                    "mask_token_id": 0, "layer_ids": [1, 3]}, max_steps=1, eval_batches=0),
                    tiny.store, tiny.vref, extract_stage(tiny.store, tiny.refs))
    conf, weights = exported(tiny, ref)
    assert conf["aux_hidden_state_layer_ids"] == [1, 3] and weights["fc.weight"].shape == (64, 2 * 64)
    # a head reading layers the extraction does not hold is told which extract.layer_ids to set: today the
    # extract stage takes three auxiliary ids (tasks/engine/target.py), so the heads must share one set of three
    cfg = head_cfg(tiny, {"kind": "eagle3.1", "layer_ids": [2, 3]})
    with pytest.raises(TrainError, match=r"eagle3.1 reads target layers \[2, 3\], but the extract stage's hidden "
                                         r"states hold \[1, 3, 20\] .*\[2\] are not there. The extract stage cannot store them "
                                         r"beside the others"):
        head_layer_ids(cfg, [1, 3, 20, 30])
    monkeypatch.setattr("tasks.train.inputs.validate_layer_ids", lambda ids, n: ids)  # an extract stage taking more
    with pytest.raises(TrainError, match=r"\[2\] are not there. Set extract.layer_ids: \[1, 2, 3, 20, 30\]"):
        head_layer_ids(cfg, [1, 3, 20, 30])
    assert head_layer_ids(cfg, [2, 3, 20, 30]) == [2, 3, 30]
    cfg.train.heads = [HeadConfig(kind="eagle3.1", layer_ids=[1, 4])]
    with pytest.raises(TrainError, match="4 is this target's last layer"):
        head_layer_ids(cfg, LAYER_IDS)
    # the flow asks the same (the train stage's `check`) before its sharded stages, from the target's own config
    from tasks.train.preflight import check_head_layers

    with pytest.raises(TrainError, match="4 is this target's last layer"):
        check_head_layers(cfg)
    cfg.train.heads = [HeadConfig(kind="eagle3.1", layer_ids=[1, 3])]
    check_head_layers(cfg)


# ============================================================================ one benchmark, every head


def stored_heads(store: Store, drafts: dict[str, dict]) -> tuple[list, object]:
    """A train artifact per head (its draft's config.json, weights vLLM would not read) and two held-out prompts."""
    from tests.unit.benchmark.test_benchmark import commit, heldout_parquet

    trained = [(label, commit(store, "train", f"{i}" * 32, {"draft/config.json": json.dumps(conf).encode(),
                                                             "draft/model.safetensors": b"x"},
                              stats={"val_acc_per_pos": [0.5, 0.25], "steps": 10}))
               for i, (label, conf) in enumerate(drafts.items())]
    return trained, commit(store, "prepare", "p" * 32, {"heldout.parquet": heldout_parquet(
        [[{"role": "user", "content": q}] for q in ("Hi there", "How are you?")])})


def test_every_head_is_measured_against_one_baseline_and_a_head_vllm_cannot_decode_keeps_its_error(tmp_path,
                                                                                                 monkeypatch):
    """Three heads through run_benchmark with engines that count like vLLM; the DFlash engine fails to start
    the way vLLM fails: its row is offline-only with vLLM's own error, the others are measured."""
    from tests.unit.benchmark.test_benchmark import FakeEngine, bench_cfg

    import tasks.benchmark.stage
    from tasks.benchmark.results import load_report
    from tasks.benchmark.stage import run_benchmark
    from tasks.benchmark.report import report_markdown
    from tasks.engine.process import EngineError

    class Engine(FakeEngine):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def start(self):
            if self.name.startswith("dflash"):
                raise EngineError(f"{self.name} died while starting (exit 1)",
                                  "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                                  "(EngineCore pid=7) NotImplementedError: DFlash needs non-causal attention\n")

        def close(self):
            pass

    started: list[str] = []
    # the machine's description imports vLLM for its version (~10 s); these engines are not vLLM's
    monkeypatch.setattr(tasks.benchmark.stage, "_machine", lambda: {"machine": "test", "load_avg_1m": None})

    def factory(name, kwargs):
        started.append(f"{name}:{(kwargs.get('speculative_config') or {}).get('method')}")
        return Engine(name)

    store = Store(f"file://{tmp_path}/store")
    cfg = bench_cfg(evals=[{"name": "heldout", "source": "heldout", "num_prompts": 2}], num_speculative_tokens=[2],
                    batch_sizes=[2], max_tokens=4, offline_replay=False)
    cfg.train.heads = [HeadConfig(kind="eagle3"), HeadConfig(kind="eagle3.1"), HeadConfig(kind="dflash")]
    drafts = {"eagle3": {"speculators_model_type": "eagle3", "norm_before_fc": True, "norm_output": True},
              "eagle3.1": {"speculators_model_type": "eagle3", "fc_norm": True, "norm_output": True},
              "dflash": {"speculators_model_type": "dflash", "block_size": 3,
                         "aux_hidden_state_layer_ids": [2, 15, 27]}}
    trained, data = stored_heads(store, drafts)
    rep = load_report(store, run_benchmark(cfg, store, trained, data, engine_factory=factory))

    assert started == ["baseline:None", "eagle3-k2:eagle3", "eagle3.1-k2:eagle3", "dflash-k2:dflash"]
    assert list(rep["heads"]) == ["eagle3", "eagle3.1", "dflash"]
    assert [(h["kind"], h["measured"]) for h in rep["heads"].values()] == [
        ("eagle3", "vllm"), ("eagle3.1", "vllm"), ("dflash", "offline only")]
    rows = {r["head"]: r for r in rep["head_table"]}
    assert rows["eagle3.1"]["measured_in"] == "vllm" and rows["eagle3.1"]["acceptance_length"] == pytest.approx(2.0)
    assert rows["eagle3"]["acceptance_length"] == rep["benchmark"]["heldout"]["2"]["mean_acceptance_length"]
    off = rows["dflash"]
    assert off["measured_in"] == "offline only" and off["acceptance_length"] is None
    assert off["simulated"] == pytest.approx(1 + 0.5 + 0.5 * 0.25)
    assert off["error"] == ("EngineError: dflash-k2 died while starting (exit 1) | root cause: (EngineCore pid=7) "
                            "NotImplementedError: DFlash needs non-causal attention")
    assert any(w.startswith("dflash (dflash) k=2: not measured in vLLM") for w in rep["warnings"])
    md = report_markdown(rep)
    assert "## Draft heads" in md and "| dflash | dflash | heldout | 2 | - | offline only |" in md
    assert "NotImplementedError: DFlash needs non-causal attention" in md
    from rich.console import Console

    from tasks.benchmark.report import render_terminal

    console = Console(record=True, width=160)
    render_terminal(rep["benchmark"], console, rep)
    out = console.export_text()
    assert "draft heads, one benchmark" in out and "offline only" in out and "eagle3.1" in out
    assert "dflash k=2: vLLM could not decode it: EngineError: dflash-k2 died while starting" in out


def test_a_benchmark_run_again_after_a_kill_starts_only_the_engines_it_had_not_finished(tmp_path, monkeypatch):
    """Each engine's figures are committed as it closes: a benchmark killed while the second head's engine starts
    starts only that engine when it runs again, and with every engine committed the report is made again, the
    same, without starting one. (tests/integration/test_kill_anywhere.py does this with vLLM's CPU build and a real SIGKILL.)"""
    from tests.unit.benchmark.test_benchmark import FakeEngine, bench_cfg

    import tasks.benchmark.stage
    from tasks.benchmark.results import load_report
    from tasks.benchmark.stage import run_benchmark

    class Killed(BaseException):
        """What a SIGKILL is to the benchmark: nothing after it runs."""

    started: list[str] = []
    kill_at: list[str] = ["eagle3.1-k2"]

    class Engine(FakeEngine):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def start(self):
            if self.name in kill_at:
                kill_at.remove(self.name)
                raise Killed(self.name)
            started.append(self.name)

        def close(self):
            pass

    monkeypatch.setattr(tasks.benchmark.stage, "_machine", lambda: {"machine": "test", "load_avg_1m": None})
    store = Store(f"file://{tmp_path}/store")
    cfg = bench_cfg(evals=[{"name": "heldout", "source": "heldout", "num_prompts": 2}], num_speculative_tokens=[2],
                    batch_sizes=[2], max_tokens=4, offline_replay=False)
    cfg.train.heads = [HeadConfig(kind="eagle3"), HeadConfig(kind="eagle3.1")]
    drafts = {"eagle3": {"speculators_model_type": "eagle3", "norm_before_fc": True, "norm_output": True},
              "eagle3.1": {"speculators_model_type": "eagle3", "fc_norm": True, "norm_output": True}}
    trained, data = stored_heads(store, drafts)

    def bench() -> dict:
        started.clear()
        return load_report(store, run_benchmark(cfg, store, trained, data,
                                               engine_factory=lambda name, kwargs: Engine(name)))

    with pytest.raises(Killed):
        bench()
    assert started == ["baseline", "eagle3-k2"] and store.list("benchmark") == []
    assert sorted(m.stats["engine"] for m in store.list("benchmark-engine")) == ["baseline", "eagle3-k2"]
    rep = bench()
    assert started == ["eagle3.1-k2"]
    assert {n: bool(e.get("reused")) for n, e in rep["engines"].items()} == {
        "baseline": True, "eagle3-k2": True, "eagle3.1-k2": False}
    assert [h["measured"] for h in rep["heads"].values()] == ["vllm", "vllm"]

    import shutil

    shutil.rmtree(tmp_path / "store" / "benchmark")
    again = bench()
    assert started == [] and all(e["reused"] for e in again["engines"].values())

    def same(r: dict) -> dict:  # what was measured, not when the report was assembled
        out = {k: v for k, v in r.items() if k not in ("measured_by", "timing", "engines")}
        out["engines"] = {n: {k: v for k, v in e.items() if k != "reused"} for n, e in r["engines"].items()}
        return {**out, "engine_start_s": r["timing"]["engine_start_s"], "measure_s": r["timing"]["measure_s"]}

    assert same(again) == same(rep)
    # another eval prompt, k or draft is another engine: measured, not reused
    cfg.benchmark.num_speculative_tokens = [3]
    shutil.rmtree(tmp_path / "store" / "benchmark")
    bench()
    assert started == ["eagle3-k3", "eagle3.1-k3"]


def test_the_equal_budget_benchmark_gives_every_head_the_same_budget():
    """benchmarks/heads_equal_budget.yaml (benchmarks/RESULTS.md, "Four heads at an equal training budget"): every
    head the same steps x batch tokens, no clock that would give the slower kinds fewer, block heads able to serve
    every k measured, a store of its own."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    cfg = load_config(root / "benchmarks" / "heads_equal_budget.yaml")
    assert [h.kind for h in cfg.train.heads] == ["eagle3", "eagle3.1", "dflash", "dspark"]
    assert len({(head_config(cfg, h).train.max_steps, head_config(cfg, h).train.batch_tokens)
                for h in cfg.train.heads}) == 1 and cfg.train.max_minutes is None
    assert all(h.dflash_settings()["block_size"] - 1 >= max(cfg.benchmark.num_speculative_tokens)
               for h in cfg.train.heads if h.drafts_blocks)
    assert cfg.store.uri.startswith(f"file://{Path.cwd().resolve()}/.draftline/") and cfg.store.uri != load_config(root / "configs" / "demo.yaml").store.uri


# ============================================================================ train.loss: the LK losses


def test_lk_losses_are_the_papers_formulas_checked_by_hand():
    """train.loss lk is LK^lambda of arXiv 2602.23881, lambda * KL(p||q) + (1 - lambda) * TV(p, q) with
    lambda = exp(-3 alpha) and alpha = sum_v min(p_v, q_v); lk_alpha is LK^alpha = -log(alpha). p = (1/2, 1/4,
    1/4), q = (1/4, 1/2, 1/4): alpha = 3/4, TV = 1/4, KL = ln 2 / 4. Each head kind swaps its own divergence
    (EAGLE-3 and DSpark KL, DFlash CE) for it; default keeps theirs."""
    import math

    from tasks.train.loop import forward_kwargs

    p, q = torch.tensor([[[0.5, 0.25, 0.25]]]).log(), torch.tensor([[[0.25, 0.5, 0.25]]]).log()
    lam = math.exp(-3 * 0.75)
    by_hand = {"lk": lam * math.log(2) / 4 + (1 - lam) * 0.25, "lk_alpha": -math.log(0.75)}
    assert by_hand["lk"] == pytest.approx(0.241915, abs=1e-6)
    for kind, default in (("eagle3", "kl_div"), ("dflash", "ce"), ("dspark", "kl_div")):
        cfg = load_config(None, [f"train.heads=[{{kind: {kind}}}]"])
        assert list(forward_kwargs(cfg.train)["loss_config"]) == [default]
        for loss, want in by_hand.items():
            for t in (cfg.model_copy(update={"train": cfg.train.model_copy(update={"loss": loss})}).train,
                      cfg.train.for_head(HeadConfig(kind=kind, loss=loss))):  # train.loss, or one head's loss
                (fn, weight), = forward_kwargs(t)["loss_config"].values()
                assert weight == 1.0 and fn(q, p).item() == pytest.approx(want, abs=1e-5), (kind, loss)


def test_an_lk_loss_trains_chained_and_block_heads_at_their_own_address(tiny):
    """The loss falls on the tiny target for an EAGLE-3 and a DFlash head trained with train.loss lk; an LK
    head is another draft (its own address), while loss: default keeps the address drafts were stored at."""
    assert digests.train(load_config(None, ["train.loss=default"]), V, SHARDS) == digests.train(RunConfig(), V, SHARDS)
    assert digests.train(load_config(None, ["train.loss=lk"]), V, SHARDS) != digests.train(RunConfig(), V, SHARDS)
    cfg = heads("{kind: eagle3}", "{kind: eagle3, name: eagle3-lk, loss: lk}")
    assert digests.train(cfg, V, SHARDS, cfg.train.heads[1]) == digests.train(
        load_config(None, ["train.loss=lk"]), V, SHARDS)
    for head in ({"kind": "eagle3"}, {"kind": "dflash", "block_size": 4, "max_anchors": 16, "mask_token_id": 0}):
        events: list[dict] = []
        run_train(head_cfg(tiny, head, loss="lk", max_steps=10), tiny.store, tiny.vref,
                  extract_stage(tiny.store, tiny.refs), on_metrics=events.append)
        losses = [e["loss"] for e in events if e["kind"] == "train"]
        assert len(losses) == 10 and sum(losses[-3:]) / 3 < 0.8 * losses[0], (head["kind"], losses)


# ============================================================================ a draft attention window (block heads)


def test_a_block_heads_attention_window_trains_and_is_what_vllm_serves(tiny):
    """attention_window: speculators' DFlash trains with every layer `sliding_attention` over that many context
    tokens, and the exported config.json is one vLLM's speculators reader and its DFlash layer resolve to that
    window (non-causal inside the block, as trained). Its own address; unset keeps the old one."""
    from types import SimpleNamespace as NS

    from vllm.model_executor.models.qwen3_dflash import _resolve_layer_attention
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    block = {"kind": "dflash", "block_size": 4, "max_anchors": 16, "mask_token_id": 0}
    assert digests.train(heads("{kind: dflash, attention_window: 8}"), V, SHARDS) != digests.train(
        heads("{kind: dflash}"), V, SHARDS)
    with pytest.raises(ConfigError, match="attention_window apply to dflash and dspark heads only"):
        heads("{kind: eagle3, attention_window: 8}")
    for window in (8, None):
        ref = run_train(head_cfg(tiny, {**block, "attention_window": window}), tiny.store, tiny.vref,
                        extract_stage(tiny.store, tiny.refs))
        conf, _ = exported(tiny, ref)
        layer = conf["transformer_layer_config"]
        served = NS(**SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(conf))))
        if window:
            assert layer["layer_types"] == ["sliding_attention"] and layer["sliding_window"] == 8
            assert _resolve_layer_attention(served, 0) == (8, False)
        else:
            assert layer["layer_types"] == ["full_attention"]
            assert _resolve_layer_attention(served, 0) == (None, False)
