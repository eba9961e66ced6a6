"""The train stage and its parts. `stage.py` finds, resumes or trains a head (`run_train`), over a node's GPUs
through `ranks.py`; every rank runs the `Trainer` of `loop.py`, whose `fit()` calls the components and whose
`commit()` writes the draft for vLLM (`save_draft`) and commits the train artifact.

What every part shares (the components build on these, never on each other):

- this file   the stage's name, its error, the metrics callback, the logger, whether training wants CUDA,
              and speculators' summed counters as per-position numbers (`ratios`, `rounded`)
- state.py    `RunState`: what a run carries from step to step and a checkpoint restores
- dist.py     `DistEnv`: a rank's distributed environment (rank, world, device, the all-reduce)
- preflight.py the checks before a run (`draftline run`, `plan`, the flow): inputs, each head against the target, remote code
- head_kinds.py what a head kind asks of its target and its passes per token (no torch: `plan` and preflight)

The parts of a run, in the order `build_trainer` and the `Trainer` (loop.py) build them:

- inputs      `resolve_inputs` (inputs.py): target folder and config, layer ids (checked across shards
              and against the config), vocab maps, parts on the store
- held-out    `HeldOut.split` (evaluation.py): the tail of the last part, kept out of training and
              evaluated at the end (the one part read before the stream starts), and once at
              `early_check_step` (`Trainer.early_check`: a warning under `early_check_min_acceptance`)
- model       `build_draft_model` (model.py): decoder shaped like the target (Llama or Qwen3 layers; Qwen3 for the
              block heads, DeepSeek-V3's MLA layer for eagle3-mla),
              verifier embed/norm/lm_head from the target's safetensors; attention `resolve_attn_impl`
              (auto: flex_attention on a GPU where it compiles for the draft's shape, else sdpa, with the
              reason logged)
- optimizer   AdamW over the trainable parameters; `Schedule` (schedule.py) sets its lr each step from
              `lr_at`: linear warm-up, then cosine decay to `min_lr_ratio * lr` by the step (or by the clock
              under `max_minutes`, which also stops the run)
- metrics     `Meter` (metrics.py): one dict per step to `on_metrics` (loss, accuracy per TTT position,
              lr, tokens/s, data wait, achieved FLOP/s) and the periodic log line
- checkpoints `Checkpointer` (checkpoints.py): every `checkpoint_every` steps, a committed store artifact
              `checkpoint/<train digest[:20]>-s<step>`: fp32 weights, optimizer state (safetensors), data
              position, RNG states, history (state.json); loading the newest, keeping the last few
- data        `BatchStream` (stream.py), opened by `fit()`: a seeded (shard, part) order per epoch, seeded
              sample order inside a part, packing to exactly `batch_tokens` per step, `prefetch` parts
              loading ahead in parallel, a packer thread
- commit      `draft/config.json` + `draft/model.safetensors` (with d2t/t2d when the draft vocabulary is smaller
              than the target's), by loop.py
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from tasks.core.errors import DraftlineError

MetricsCallback = Callable[[dict[str, Any]], None]
log = logging.getLogger("draftline.train")

STAGE = "train"
CKPT_STAGE = "checkpoint"  # what checkpoints are stored as (checkpoint/<train digest[:20]>-s<step>)


class TrainError(DraftlineError, ValueError):
    """Training cannot start or continue; the message names the problem and the fix."""


def wants_cuda(train: Any) -> bool:
    """Whether training runs on GPUs (`train.device` cuda, or auto with a GPU visible); cuda where torch sees
    no GPU is an error naming the fix. The one place both the ranks' count and each rank's device ask."""
    import torch  # here, not at the top: this package's __init__ stays light

    use = train.device == "cuda" or (train.device == "auto" and torch.cuda.is_available())
    if use and not torch.cuda.is_available():
        raise TrainError("train.device is cuda but torch sees no GPU; set train.device: auto (or cpu)")
    return use


def rounded(x: float, nd: int = 6) -> float:
    """A metric as the records keep it: a float to `nd` decimals."""
    return float(round(float(x), nd))


def ratios(metrics: dict[str, float], ttt_steps: int) -> dict[str, Any]:
    """Per-position numbers from speculators' summed counters (after any all-reduce)."""
    chain = []
    for k in range(ttt_steps):
        tot = metrics.get(f"full_acc_{k}_total", 0.0)
        chain.append(metrics.get(f"full_acc_{k}_sum", 0.0) / tot if tot > 0 else 0.0)
    cond = [chain[0]] + [chain[k] / chain[k - 1] if chain[k - 1] > 0 else 0.0 for k in range(1, ttt_steps)]
    losses = [metrics.get(f"loss_{k}_sum", 0.0) / max(metrics.get(f"loss_{k}_total", 1.0), 1e-12)
              for k in range(ttt_steps)]
    return {"acc_per_pos": cond, "chain_acc_per_pos": chain, "loss_per_pos": losses}
