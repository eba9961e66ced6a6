"""What a head kind asks of its target and of the training step, without torch: whether the target can train
it (`head_target_problem`: an eagle3-mla head needs an MLA target, `is_mla`) and its draft decoder passes per
trained token (`passes_per_token`). tasks/train/model.py builds the drafts on these; `draftline plan` and the
preflight checks ask them before anything imports torch (tasks/cost/shape.py, tasks/train/preflight.py)."""

from __future__ import annotations

from typing import Any

from tasks.core.config import HeadConfig, TrainConfig


def is_mla(tc: Any) -> bool:
    """An MLA target (DeepSeek-V3, Kimi-K2.5): its attention compresses keys and values to a latent."""
    return bool(getattr(tc, "kv_lora_rank", None))


def head_target_problem(head: HeadConfig, tc: Any, model: str) -> str | None:
    """Why head `head` cannot be trained for the target `model` (its text config `tc`), with the fix; None if
    it can. Asked by `draftline run` and `draftline plan` before any work (tasks/train/preflight.py), and by the
    train stage (tasks.train.model.mla_layer_config)."""
    if head.kind == "eagle3-mla" and not is_mla(tc):
        return (f"train.heads: head {head.label!r} is eagle3-mla, which needs an MLA target (kv_lora_rank in its "
                f"config: DeepSeek-V3, Kimi-K2.5); target {model!r} has {getattr(tc, 'model_type', '?')} layers "
                "without MLA. Fix: give that head kind eagle3 or eagle3.1 for this target, or drop it")
    return None


def passes_per_token(head: HeadConfig, train: TrainConfig) -> float:
    """Draft decoder passes per trained token: the TTT steps (the EAGLE-3 kinds), or a DFlash/DSpark block per
    sampled anchor (at most one anchor per token)."""
    if not head.drafts_blocks:
        return float(train.ttt_steps)
    s = head.dflash_settings()
    return s["block_size"] * min(1.0, s["max_anchors"] / train.batch_tokens)
