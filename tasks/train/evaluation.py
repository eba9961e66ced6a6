"""Held-out evaluation: `HeldOut` splits the tail of the run's last part off for evaluation (the one part
read before the batch stream starts: `HeldOut.split`, called by `loop.build_trainer`, never by the Trainer
itself), packs it into eval batches and evaluates a model on them; `evaluate_model` is that evaluation for any
Eagle3DraftModel or DFlash head over packed batches (the benchmarks evaluate speculators' models with it).
A DFlash or DSpark head is scored by the same counters as EAGLE-3 (`_block_eval_batch`), so the simulated
acceptance length means the same for every kind.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from tasks.core.config import TrainConfig
from tasks.formats.acceptance import bucket_bounds, bucket_rank, length_bucket, simulated_acceptance_length
from tasks.train import ratios, rounded
from tasks.train.stream import Batch, PartData, PartSpec, eval_batches, holdout_plan, tail_copy


@dataclass
class HeldOut:
    """The run's parts for training (the last one marked with the samples it holds out), the held-out
    samples packed as eval batches, and their count (0: no evaluation, `train.eval_batches` 0)."""

    parts: list[PartSpec]
    batches: list[Batch]
    samples: int

    @classmethod
    def split(cls, parts: list[PartSpec], read_part: Callable[[PartSpec], PartData], total_samples: int,
              train: TrainConfig) -> "HeldOut":
        """Read the last part and hold out its tail (`holdout_plan`); the rest of it is freed here."""
        last_spec = parts[-1]
        last = read_part(last_spec)
        held = holdout_plan(parts, last, total_samples, train)
        batches = eval_batches(tail_copy(last, last.num_samples - held), 0, train.batch_tokens,
                               train.eval_batches) if held else []
        return cls(parts[:-1] + [PartSpec(**{**last_spec.__dict__, "holdout": held})], batches, held)

    def evaluate(self, model: Any, device: torch.device, forward_kwargs: dict[str, Any],
                 autocast: Callable[[], Any] = contextlib.nullcontext, by_length: bool = False) -> dict[str, Any]:
        """Held-out loss, per-position accuracy and simulated acceptance length (by_length: also per
        context-length bucket); {} with nothing held out."""
        out = evaluate_model(model, self.batches, device, forward_kwargs, autocast, by_length)
        return {**out, "val_samples": self.samples} if out else {}


def early_check_record(val: dict[str, Any], step: int, threshold: float | None) -> dict[str, Any]:
    """The early check's record (train.early_check_step): the held-out simulated acceptance length at `step` against
    `threshold` (None: shown, never `below`). No held-out split: no figure, and nothing to warn about."""
    sal = val.get("simulated_acceptance_length")
    return {"kind": "early_check", "step": step, "simulated_acceptance_length": sal,
            "val_acc_per_pos": val.get("val_acc_per_pos"), "val_tokens": val.get("val_tokens", 0),
            "threshold": threshold, "below": threshold is not None and sal is not None and sal < threshold}


@torch.no_grad()
def evaluate_model(model: Any, batches: Sequence[Batch], device: torch.device, forward_kwargs: dict[str, Any],
                   autocast: Callable[[], Any] = contextlib.nullcontext, by_length: bool = False) -> dict[str, Any]:
    """Loss, per-position accuracy (see `simulated_acceptance_length`) and the simulated
    acceptance length of any Eagle3DraftModel over packed batches; {} without batches.

    by_length: also `val_by_length`, the same figures per context-length bucket (tasks.formats.acceptance's
    buckets, the benchmark's): a token's context is its position in its sample + 1, and each bucket is one more
    pass over the batches with the loss mask kept to that bucket's tokens (one bucket: the figures above)."""
    if not batches:
        return {}
    out = _evaluate_pass(model, batches, device, forward_kwargs, autocast)
    if by_length:
        present = sorted({lb for b in batches for lb in _buckets_of(b)}, key=bucket_rank)
        out["val_by_length"] = {lb: (_bucket_figures(out) if len(present) == 1 else _bucket_figures(
            _evaluate_pass(model, batches, device, forward_kwargs, autocast, keep=lb))) for lb in present}
    return out


def _buckets_of(batch: Batch) -> set[str]:
    """The context-length buckets of the batch's scored tokens."""
    pos = batch.position_ids.reshape(-1)[batch.loss_mask.reshape(-1).to(torch.bool)]
    return {length_bucket(int(p) + 1) for p in torch.unique(pos).tolist()}


def _bucket_figures(val: dict[str, Any]) -> dict[str, Any]:
    return {k: val[k] for k in ("val_acc_per_pos", "simulated_acceptance_length", "val_tokens")}


def _evaluate_pass(model: Any, batches: Sequence[Batch], device: torch.device, forward_kwargs: dict[str, Any],
                   autocast: Callable[[], Any], keep: str | None = None) -> dict[str, Any]:
    """One pass over the batches; `keep`: score only the tokens whose context falls in that bucket."""
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    loss, tokens = 0.0, 0
    blocks = "max_anchors" in forward_kwargs
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(0)  # DFlash and DSpark sample their anchors: the same ones on every evaluation
            for b in batches:
                inputs = b.model_inputs(device)
                if keep is not None:
                    inputs["loss_mask"] = inputs["loss_mask"] * context_mask(inputs["position_ids"], keep).to(
                        inputs["loss_mask"].dtype)
                with autocast():
                    if blocks:
                        batch_loss, m = _block_eval_batch(model, inputs, forward_kwargs)
                    else:
                        _, batch_loss, m = model(**inputs, **forward_kwargs)
                loss += float(batch_loss)
                tokens += int(inputs["loss_mask"].sum()) if keep is not None else b.tokens
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
    finally:
        model.train(was_training)
    r = ratios(sums, _drafted(model) if blocks else int(forward_kwargs.get("ttt_steps", 3)))
    return {"val_loss": rounded(loss / len(batches)), "val_acc_per_pos": [rounded(a) for a in r["acc_per_pos"]],
            "val_chain_acc_per_pos": [rounded(a) for a in r["chain_acc_per_pos"]],
            "simulated_acceptance_length": rounded(simulated_acceptance_length(r["acc_per_pos"]), 4),
            "val_tokens": tokens}


def context_mask(position_ids: torch.Tensor, label: str) -> torch.Tensor:
    """True where a token's context (its position in its sample + 1) falls in the bucket `label`."""
    lo, hi = bucket_bounds(label)
    ctx = position_ids + 1
    return (ctx >= lo) & (ctx < hi) if hi is not None else ctx >= lo


def _drafted(model: Any) -> int:
    """Tokens a DFlash-family model drafts per block: every slot when it samples from the anchor (DSpark),
    else all but the anchor."""
    return int(model.block_size) - (0 if model.config.sample_from_anchor else 1)


def _dspark_heads(model: Any, input_ids: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor,
                  block_indices: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DSpark's heads over its backbone's output, as `DSparkDraftModel.forward` applies them: the Markov
    bias from the token before each slot added to the logits, and the confidence logits."""
    n = int(model.block_size)
    tokens = input_ids[0, block_indices].view(blocks, n)
    prev = tokens if model.config.sample_from_anchor else torch.cat([tokens[:, :1], tokens[:, :-1]], dim=1)
    hidden = hidden.view(blocks, n, -1)
    prev_emb = None
    if model.markov_head is not None:
        prev_emb = model.markov_head.prev_embeddings(prev)
        bias = model.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden, prev_emb=prev_emb)
        logits = (logits.view(blocks, n, -1) + bias).view(1, blocks * n, -1)
    confidence = None
    if model.confidence_head is not None:
        features = hidden
        if model.config.confidence_head_with_markov and prev_emb is not None:
            features = torch.cat([hidden, prev_emb.to(hidden.dtype)], dim=-1)
        confidence = model.confidence_head(features).reshape(1, blocks * n)
    return logits, confidence


def _block_eval_batch(model: Any, inputs: dict[str, torch.Tensor],
                      kw: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """A DFlash or DSpark head's loss on one batch (speculators' own loss for the kind), and per drafted slot
    i the share of whole blocks whose slots up to i are all right (`full_acc_{i}`, as EAGLE-3 counts its steps),
    so `ratios` gives the same conditional accuracies and the benchmark's simulated acceptance length means
    the same for every kind."""
    hidden, logits, targets, mask, indices = model._backbone_forward(**inputs, max_anchors=kw["max_anchors"])
    n, first = int(model.block_size), 0 if model.config.sample_from_anchor else 1
    common = {"gamma": kw["gamma"], "loss_config": kw["loss_config"], "dpace_alpha": kw["dpace_alpha"],
              "per_position_loss_weight": kw["per_position_loss_weight"],
              "sample_from_anchor": bool(model.config.sample_from_anchor)}
    if "confidence_head_alpha" in kw:  # DSpark
        from speculators.models.dspark.metrics import compute_metrics as dspark_metrics

        logits, confidence = _dspark_heads(model, inputs["input_ids"], hidden, logits, indices, kw["max_anchors"])
        loss, _ = dspark_metrics(logits, targets, confidence, mask, n, tv_loss_fn=kw["tv_loss_fn"],
                                 confidence_head_alpha=kw["confidence_head_alpha"], **common)
    else:
        from speculators.models.dflash.metrics import compute_metrics

        loss, _ = compute_metrics(logits, targets, mask, n, **common)
    right = (logits.argmax(-1) == targets.argmax(-1)).reshape(-1, n)[:, first:]
    valid = mask.to(torch.bool).reshape(-1, n)[:, first:]
    # blocks whose every drafted slot is inside the loss mask: over the same blocks at every slot the leading
    # runs only shrink, so each conditional accuracy is at most 1 (a block cut short by its document's end
    # would count at its early slots only)
    whole = valid.all(dim=-1)
    run = right[whole].to(torch.int64).cumprod(dim=-1)
    out: dict[str, float] = {}
    for i in range(n - first):
        out[f"full_acc_{i}_sum"] = float(run[:, i].sum())
        out[f"full_acc_{i}_total"] = float(whole.sum())
    return loss, out
