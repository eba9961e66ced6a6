"""Stage `train`: an EAGLE-3 draft head trained on stored hidden states, exported for vLLM.

    ref = run_train(cfg, store, vocab_ref, extract_refs, on_metrics=print)
    # store: train/DIGEST/draft/{config.json, model.safetensors}, metrics.json

The model is speculators' `Eagle3DraftModel` (the architecture and checkpoint
format vLLM loads); everything around it is ours, so that it runs on a CPU, one
GPU, or as DDP ranks across a node's GPUs (applied from outside the model),
reads its data from the store (file:// or s3://) and survives kill -9.

Ranks: `train.gpus` (default every visible GPU, 1 on a CPU, where N > 1 means N
gloo ranks). With more than one, `run_train` starts them with torch's elastic
launcher (`launch_ranks` in tasks/train/ranks.py, what torchrun runs), follows rank 0's metrics while
they train and turns a failed rank into a TrainError naming it; each rank calls
`run_train` again. Started by torchrun yourself, every rank calls it directly.

The parts of a run, in the order `build_trainer` and the `Trainer` (tasks/train/loop.py) build them:

- inputs      `resolve_inputs` (tasks/train/inputs.py): target folder and config, layer ids (checked
              across shards and against the config), vocab maps, parts on the store
- held-out    `HeldOut.split` (tasks/train/evaluation.py): the tail of the last part, kept out of
              training and evaluated at the end (the one part read before the stream starts)
- model       `build_draft_model` (tasks/train/model.py): decoder shaped like the target (Llama or Qwen3
              layers), verifier embed/norm/lm_head from the target's safetensors;
              attention `resolve_attn_impl` (auto: flex_attention on a GPU where it
              compiles for the draft's shape, else sdpa, with the reason logged)
- optimizer   AdamW over the trainable parameters; `Schedule` (tasks/train/schedule.py) sets its lr
              each step from `lr_at`: linear warm-up, then cosine decay to `min_lr_ratio * lr` by the
              step (or by the clock under `max_minutes`, which also stops the run)
- metrics     `Meter` (tasks/train/metrics.py): one dict per step to `on_metrics` (loss, accuracy per
              TTT position, lr, tokens/s, data wait, achieved FLOP/s)
- checkpoints `Checkpointer` (tasks/train/checkpoints.py): every `checkpoint_every` steps, a committed
              store artifact `checkpoint/<train digest[:20]>-s<step>`: fp32 weights, optimizer
              state (safetensors), data position, RNG states, history (state.json)
- data        `BatchStream` (tasks/train/stream.py), opened by `fit()`: a seeded (shard, part) order per
              epoch, seeded sample order inside a part, packing to exactly `batch_tokens` per step,
              `prefetch` parts loading ahead in parallel, a packer thread
- export      `draft/config.json` + `draft/model.safetensors` (d2t/t2d included)

Resume is exact: the weights after an interrupted-and-resumed run equal those of
an uninterrupted one (same seed, same world size), because every source of
state (weights, AdamW moments, step, data position) is in the checkpoint and the
data order is a function of (seed, epoch, part), not of history.
"""

from __future__ import annotations

from tasks.address import digests
from tasks.core.config import RunConfig
from tasks.store.artifacts import ArtifactRef, Store
from tasks.train import STAGE, MetricsCallback
from tasks.train.inputs import resolve_inputs, train_head
from tasks.train.loop import train_here
from tasks.train.ranks import launch_ranks, launched_as_rank, train_ranks


def run_train(cfg: RunConfig, store: Store, vocab_ref: ArtifactRef, extract_refs: list[ArtifactRef], *,
              on_metrics: MetricsCallback | None = None) -> ArtifactRef:
    """Train (or resume, or find) the draft for these inputs; returns the train artifact's ref.

    A committed train artifact is returned at once. Otherwise training resumes from
    the newest committed checkpoint of the same digest, or starts fresh. With more
    than one rank to use (`train.gpus`, default every visible GPU) this process
    starts them with torch's elastic launcher (`launch_ranks`) and waits; with one,
    it trains itself. Under torchrun every rank calls this; rank 0 writes, all ranks
    return the same ref.
    """
    train_head(cfg)  # one head per call
    digest = digests.train(cfg, vocab_ref, extract_refs)
    return store.found_or_compute(STAGE, digest, lambda: _train(cfg, store, vocab_ref, extract_refs, on_metrics, digest))


def _train(cfg: RunConfig, store: Store, vocab_ref: ArtifactRef, extract_refs: list[ArtifactRef],
           on_metrics: MetricsCallback | None, digest: str) -> ArtifactRef:
    if not launched_as_rank():
        ranks = train_ranks(cfg.train)
        if ranks > 1:
            resolve_inputs(cfg, store, vocab_ref, extract_refs)  # bad inputs fail here, before any rank starts
            return launch_ranks(cfg, store, vocab_ref, extract_refs, ranks, on_metrics)
    return train_here(cfg, store, vocab_ref, extract_refs, on_metrics)
