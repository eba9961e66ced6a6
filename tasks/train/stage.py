"""Stage `train`: a draft head trained on stored hidden states, saved for vLLM.

    ref = run_train(cfg, store, vocab_ref, extracted, on_metrics=print)   # extracted: the extract stage's artifact
    # store: train/DIGEST/draft/{config.json, model.safetensors}, metrics.json

One head per call (`train.heads`: eagle3, eagle3.1, eagle3-mla, dflash, dspark). The models are
speculators' (`Eagle3DraftModel`, `DFlashDraftModel`, `DSparkDraftModel`; eagle3-mla gives the EAGLE-3
draft DeepSeek's MLA layer, tasks/train/model.py), in the checkpoint formats vLLM loads; everything around
them is ours, so that training runs on a CPU, one GPU, or as DDP ranks across a node's GPUs (applied from
outside the model), reads its data from the store (file:// or s3://) and survives kill -9.

Ranks: `train.gpus` (default every visible GPU, 1 on a CPU, where N > 1 means N
gloo ranks). With more than one, `run_train` starts them with torch's elastic
launcher (`launch_ranks` in tasks/train/ranks.py, what torchrun runs), follows rank 0's metrics while
they train and turns a failed rank into a TrainError naming it; each launched rank calls
`train_here` (tasks/train/loop.py) with the stage's address. Started by torchrun yourself, every rank
calls `run_train`, which sees it runs as a rank and trains in place (`train_here` too).

The parts of a run, in the order they are built, are listed in tasks/train/__init__.py.

Resume is exact: the weights after an interrupted-and-resumed run equal those of
an uninterrupted one (same seed, same world size), because every source of
state (weights, AdamW moments, step, data position) is in the checkpoint and the
data order is a function of (seed, epoch, part), not of history.
"""

from __future__ import annotations

import re
from typing import Any

from tasks.address import digests
from tasks.core.config import HeadConfig, RunConfig, head_config
from tasks.store.artifacts import ArtifactRef, Store
from tasks.store.stages import Shown, Stage, Tick, as_variants
from tasks.extract.shards import ExtractError, extract_shards
from tasks.train import STAGE, MetricsCallback, TrainError
from tasks.train.preflight import check_head_layers

# The training parts (inputs, loop, ranks) import torch: they are imported where a head is trained, so this
# module, and with it the stage registry's STAGE_DEF, stays light (tasks/store/resolve.py reads the addresses).


def train_address(cfg: RunConfig, store: Store, vocab_ref: ArtifactRef, extracted: ArtifactRef) -> str:
    """The train artifact's digest, made of the shards the extract stage's artifact names (tasks/address/digests.py
    `train`): the flow's `STAGE_DEF.address`, and `run_train`'s without one."""
    return digests.train(cfg, vocab_ref, training_shards(store, extracted))


def run_train(cfg: RunConfig, store: Store, vocab_ref: ArtifactRef, extracted: ArtifactRef, *,
              on_metrics: MetricsCallback | None = None, digest: str | None = None) -> ArtifactRef:
    """Train (or resume, or find) the draft for these inputs at DIGEST (the flow's address for it; default
    `train_address`); returns the train artifact's ref.

    EXTRACTED: the extract stage's artifact (`extract-stage/DIGEST`), which names the shards trained on; the
    train address is made of those shards themselves (tasks/address/digests.py `train`).

    A committed train artifact is returned at once. Otherwise training resumes from
    the newest committed checkpoint of the same digest, or starts fresh. With more
    than one rank to use (`train.gpus`, default every visible GPU) this process
    starts them with torch's elastic launcher (`launch_ranks`) and waits; with one,
    it trains itself. Under torchrun every rank calls this; rank 0 writes, all ranks
    return the same ref.
    """
    from tasks.train.inputs import train_head

    train_head(cfg)  # one head per call
    digest = digest or train_address(cfg, store, vocab_ref, extracted)
    return store.found_or_compute(STAGE, digest, lambda: _train(cfg, store, vocab_ref, training_shards(
        store, extracted), on_metrics, digest))


def _train(cfg: RunConfig, store: Store, vocab_ref: ArtifactRef, extract_refs: list[ArtifactRef],
           on_metrics: MetricsCallback | None, digest: str) -> ArtifactRef:
    from tasks.train.inputs import resolve_inputs
    from tasks.train.loop import train_here
    from tasks.train.ranks import launch_ranks, launched_as_rank, train_ranks

    if not launched_as_rank():
        ranks = train_ranks(cfg.train)
        if ranks > 1:
            # bad inputs fail here, before any rank starts
            resolve_inputs(cfg, store, vocab_ref, extract_refs, digest=digest)
            return launch_ranks(cfg, store, vocab_ref, extract_refs, ranks, on_metrics, digest=digest)
    return train_here(cfg, store, vocab_ref, extract_refs, on_metrics, digest=digest)


def training_shards(store: Store, extracted: ArtifactRef) -> list[ArtifactRef]:
    """The extraction shards the extract stage's artifact names, a TrainError naming the one missing."""
    try:
        return extract_shards(store, extracted)
    except ExtractError as exc:
        raise TrainError(str(exc)) from None


# the stage as the flow runs it (tasks/store/stages.py), once per head of train.heads (tasks.core.config
# head_config): its address is made of the shards the extract stage's artifact names
def head_variants(cfg: RunConfig) -> list[tuple[str, RunConfig]]:
    """The stage's variants: one (label, config) per head of train.heads, each trained at its own address."""
    return [(head.label, head_config(cfg, head)) for head in cfg.train.heads]


def head_key(head: HeadConfig) -> str:
    """'' for the default EAGLE-3 head, else '-' + its label as a Prefect artifact key allows."""
    return "" if head == HeadConfig() else "-" + re.sub(r"[^a-z0-9-]+", "-", head.label.lower())


def show_heads(cfg: RunConfig, store: Store, made: dict[str, Any]) -> Shown:
    """Each head's held-out accuracy per TTT position as a table artifact; with several heads, each one's digest
    and steps on the stage's line of the run's summary."""
    heads = as_variants(made[STAGE])
    out = Shown()
    for head, (_, ref) in zip(cfg.train.heads, heads):
        acc = ref.stats.get("val_acc_per_pos")
        if acc:
            out.tables.append((f"train{head_key(head)}-heldout-accuracy",
                               f"Draft accuracy per TTT position on held-out data ({head.label})",
                               [{"position": i + 1, "accuracy": round(a, 4)} for i, a in enumerate(acc)]))
    if len(heads) > 1:
        out.stats["heads"] = ", ".join(f"{label} {ref.digest[:8]} ({ref.stats.get('steps')} steps)"
                                       for label, ref in heads)
    return out


def tick(m: dict[str, Any]) -> Tick:
    """A training record (rank 0's, from this process or the launched ranks) as the flow shows it: the bar at
    its step, a log line at start, every ~5% of the steps, checkpoints and evaluation."""
    out = Tick()
    if "step" in m and "max_steps" in m:
        out.percent = 100.0 * m["step"] / max(1, m["max_steps"])
        out.message = f"step {m['step']}/{m['max_steps']}" + (f", loss {m['loss']:.4f}" if "loss" in m else "")
    line = _log_line(m)
    if line:
        (out.warnings if m.get("below") else out.log).append(line)  # an early check under its threshold warns
    if m.get("attn_fallback"):
        out.warnings.append(f"train: {m['attn_fallback']}; training with sdpa")
    return out


def _log_line(m: dict[str, Any]) -> str | None:
    kind = m.get("kind")
    if kind == "start":
        resumed = f", resumed from the checkpoint of step {m['resumed_from']}" if m.get("resumed_from") is not None else ""
        warm = f"; warm start from {m['init_from']['source']}: {m['init_from']['note']}" if m.get("init_from") else ""
        return (f"train: {m.get('world_size', 1)} rank(s) on {m.get('device')}, {m.get('attn_impl')} attention, "
                f"{m.get('precision')}, step {m.get('step')}/{m.get('max_steps')}{resumed}{warm}")
    if kind == "train":
        step, total = int(m["step"]), int(m["max_steps"])
        if step == 1 or step == total or step % max(1, total // 20) == 0:
            return (f"train step {step}/{total}: loss {m['loss']:.4f}, acc {m.get('acc_per_pos')}, "
                    f"{m.get('tokens_per_s', 0):.0f} tok/s, data wait {m.get('data_wait_s', 0):.3f}s")
        return None
    if kind == "checkpoint":
        return f"train: checkpoint at step {m['step']} ({m.get('digest')})"
    if kind == "eval":
        return (f"train: held-out accuracy per position {m.get('val_acc_per_pos')}, simulated acceptance length "
                f"{m.get('simulated_acceptance_length')}")
    if kind == "early_check":
        sal, threshold = m.get("simulated_acceptance_length"), m.get("threshold")
        if m.get("below"):
            return (f"train: early check at step {m['step']}: held-out simulated acceptance length {sal} is under "
                    f"{threshold} (train.early_check_min_acceptance): this head is not on course for its target; "
                    "stop it and fix the data or the recipe before spending the rest of the steps")
        return (f"train: early check at step {m['step']}: held-out simulated acceptance length {sal}"
                + (f" (threshold {threshold})" if threshold is not None else ""))
    if kind == "done" and m.get("head"):
        return f"train: the {m['head']} head ({m.get('head_kind')}) saved after {m.get('steps')} steps"
    return None


# (over train.nodes > 1 nodes the flow starts the other nodes: flows/train_nodes.py; a head reading layers the
# extraction will not hold fails before extraction: `check`)
STAGE_DEF = Stage(name=STAGE, inputs=("vocab", "extract"), address=train_address, run=run_train,
                  variants=head_variants, show=show_heads, context=("on_metrics",), tick=tick,
                  check=check_head_layers, nodes=lambda cfg: cfg.train.nodes)
