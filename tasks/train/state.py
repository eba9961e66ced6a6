"""`RunState`: what a training run carries from step to step (step, tokens, training seconds, the metrics
history, the data positions and RNG states a resume restores) and a checkpoint holds. The loop owns it; the
metrics record into it (`Meter.record`) and the checkpoints write and restore it (`Checkpointer`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunState:
    """What a checkpoint restores besides weights and optimizer moments."""

    step: int = 0
    tokens_seen: int = 0
    train_seconds: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    positions: list[dict[str, int]] | None = None
    rng: list[dict[str, Any]] | None = None
    world: int = 1
    stopped_reason: str | None = None
    resumed_from: int | None = None
    early_check: dict[str, Any] | None = None  # the held-out figures at train.early_check_step (Trainer.early_check)
