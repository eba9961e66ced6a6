"""When the training loop steps at what learning rate, and when it stops on time: `lr_at` (linear warm-up,
then cosine decay by steps or by the clock, whichever ends first) and `Schedule`, the object the loop asks
each step "stop now?" (the `train.max_minutes` budget is spent) and "lr for this step?".

Every rank reads rank 0's clock (`env.sum` of it), so all ranks stop at the same step and use the same
rate. The clock is injectable (`clock=`, `time.perf_counter` by default): benchmarks/bench_equal_budget.py
runs the budget on CPU seconds. Training seconds of earlier sessions (a resumed run) count toward it.
"""

from __future__ import annotations

import math
import time
from typing import Callable

from tasks.core.config import TrainConfig
from tasks.train import log
from tasks.train.dist import DistEnv


def lr_at(step: int, train: TrainConfig, elapsed_s: float | None = None) -> float:
    """Learning rate for the step with 0-based index `step`: linear warm-up over
    `warmup_steps`, then cosine decay from `lr` to `min_lr_ratio * lr` at `max_steps`.

    With a wall-clock budget (`max_minutes`) and the training seconds spent so far, the decay
    follows whichever end comes first, steps or time: a run that the budget stops at step 110
    of 400 has still annealed, instead of stopping at almost the peak rate."""
    if train.warmup_steps and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    span = max(1, train.max_steps - train.warmup_steps)
    progress = (step - train.warmup_steps) / span
    if train.max_minutes and elapsed_s is not None:
        progress = max(progress, elapsed_s / (train.max_minutes * 60))
    progress = min(1.0, max(0.0, progress))
    return train.lr * (train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Schedule:
    """The run's clock, its time budget and its learning rate. `start(seconds_before)` when the steps
    begin; per step `stop_now(step)` (reads the clock, rank 0's for every rank under a budget) then
    `lr(step)` (at the clock `stop_now` read); `train_seconds()`: this rank's training seconds so far."""

    def __init__(self, train: TrainConfig, env: DistEnv, clock: Callable[[], float] = time.perf_counter):
        self.t, self.env, self.clock = train, env, clock
        self.budget_s = train.max_minutes * 60 if train.max_minutes else None
        self.seconds_before = 0.0
        self.session_t0 = clock()
        self.elapsed = 0.0

    def start(self, seconds_before: float) -> None:
        """The steps begin now, after `seconds_before` training seconds of earlier sessions."""
        self.seconds_before, self.session_t0 = seconds_before, self.clock()

    def train_seconds(self) -> float:
        return self.seconds_before + self.clock() - self.session_t0

    def stop_now(self, step: int) -> bool:
        """Whether the time budget is spent before step `step` (the same answer on every rank)."""
        elapsed = self.train_seconds()
        if self.budget_s is None:
            self.elapsed = elapsed
            return False
        self.elapsed = self.env.sum({"s": elapsed if self.env.rank == 0 else 0.0})["s"]
        if self.elapsed >= self.budget_s:
            log.info("stopping at step %d: the time budget of %.3g min is spent", step, self.t.max_minutes)
            return True
        return False

    def lr(self, step: int) -> float:
        """The learning rate of step `step` (0-based) at the clock the last `stop_now` read."""
        return lr_at(step, self.t, self.elapsed)
