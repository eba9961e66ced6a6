"""What the training loop reports: `Meter` builds each step's record from all ranks' summed counters (loss,
per-position and chain accuracy, lr, grad norm, tokens/s, data wait, TFLOP/s, MFU on known GPUs, a DFlash
head's expected acceptance length), keeps it in the run's history, writes the periodic log line and emits
records (train, checkpoint, start, eval, done) to the metrics callback on rank 0. `step_ratios` turns a
training step's summed counters into per-position numbers, for every kind of head (an EAGLE-3 head's through
`tasks.train.ratios`, which the evaluation uses too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from tasks.core.config import TrainConfig
from tasks.train import MetricsCallback, log, ratios, rounded
from tasks.train.dist import DistEnv

if TYPE_CHECKING:
    from tasks.train.state import RunState
    from tasks.train.stream import BatchStream

# Dense bf16 peak of the GPUs we know, for MFU (None elsewhere: CPU MFU is not meaningful).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12,
                   "B300": 2250e12, "L40S": 362e12}


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of `device` if it is a GPU we know, else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def step_ratios(metrics: dict[str, float], head: Any, ttt_steps: int) -> dict[str, Any]:
    """A training step's per-position numbers. EAGLE-3 heads: `ratios`. DFlash and DSpark: speculators' accuracy
    per drafted slot of a block (DFlash: slot 1 = the first token after the anchor; DSpark drafts from the
    anchor, slot 0; each slot on its own) and its expected accepted length (per block: the leading run of
    right slots plus the bonus token)."""
    if not head.drafts_blocks:
        return ratios(metrics, ttt_steps)
    slots = sorted(int(k.split("_")[1]) for k in metrics if k.startswith("position_") and k.endswith("_acc_sum"))
    acc = [metrics[f"position_{i}_acc_sum"] / metrics[f"position_{i}_acc_total"]
           if metrics.get(f"position_{i}_acc_total") else 0.0 for i in slots]
    eal = metrics.get("eal_sum", 0.0) / metrics["eal_total"] if metrics.get("eal_total") else 0.0
    return {"acc_per_pos": acc, "chain_acc_per_pos": [], "loss_per_pos": [], "expected_acceptance_length": eal}


class Meter:
    """A run's step records: `begin(stream)` before a step takes its batch (the step's clock and the
    stream's wait so far), `record(state, ...)` after the optimizer step (all-reduces the counters, adds the
    record to `state.history`, emits it, logs every max_steps/20 steps); `emit(rec)` for the other kinds.
    `train_seconds` is the schedule's clock of this run's training seconds."""

    def __init__(self, train: TrainConfig, head: Any, env: DistEnv, flops_per_token: float,
                 on_metrics: MetricsCallback | None, clock: Callable[[], float],
                 train_seconds: Callable[[], float]):
        self.t, self.head, self.env, self.on_metrics = train, head, env, on_metrics
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops(env.device)
        self.clock, self.train_seconds = clock, train_seconds
        self.every = max(1, train.max_steps // 20)
        self.step_t0, self.wait0, self.stream = 0.0, 0.0, None

    def emit(self, rec: dict[str, Any]) -> None:
        if self.env.rank == 0 and self.on_metrics is not None:
            self.on_metrics(rec)

    def begin(self, stream: "BatchStream") -> None:
        self.step_t0, self.wait0, self.stream = self.clock(), stream.wait_s, stream

    def record(self, state: "RunState", metrics: dict[str, Any], tokens: int, lr: float,
               grad_norm: Any) -> dict[str, Any]:
        """The record of step `state.step` (just taken) from this rank's `metrics` and batch `tokens`."""
        t, env = self.t, self.env
        wait = self.stream.wait_s - self.wait0 if self.stream is not None else 0.0
        sums = {k: float(v) for k, v in metrics.items()}
        sums["tokens"] = float(tokens)
        sums = env.sum(sums)
        step_s = self.clock() - self.step_t0
        tokens = int(sums["tokens"])
        state.tokens_seen += tokens
        state.train_seconds = self.train_seconds()
        r = step_ratios(sums, self.head, t.ttt_steps)
        tps = tokens / step_s if step_s > 0 else 0.0
        rec = {"kind": "train", "step": state.step, "max_steps": t.max_steps,
               "loss": rounded(sums["loss_sum"] / max(sums["loss_total"], 1.0)),
               "loss_per_pos": [rounded(x) for x in r["loss_per_pos"]],
               "acc_per_pos": [rounded(x) for x in r["acc_per_pos"]],
               "chain_acc_per_pos": [rounded(x) for x in r["chain_acc_per_pos"]],
               "lr": lr, "grad_norm": rounded(float(grad_norm)), "tokens": tokens, "tokens_per_s": rounded(tps, 1),
               "step_s": rounded(step_s, 4), "data_wait_s": rounded(wait, 4),
               "tflops": rounded(tps * self.flops_per_token / 1e12, 4), "elapsed_s": rounded(state.train_seconds, 2)}
        if "expected_acceptance_length" in r:
            rec["expected_acceptance_length"] = rounded(r["expected_acceptance_length"], 4)
        if self.peak_flops:
            rec["mfu"] = rounded(tps * self.flops_per_token / env.world / self.peak_flops, 4)
        state.history.append(rec)
        self.emit(rec)
        if state.step == 1 or state.step % self.every == 0 or state.step == t.max_steps:
            log.info("step %d/%d loss %.4f acc %s lr %.3g %.0f tok/s wait %.3fs", state.step, t.max_steps,
                     rec["loss"], rec["acc_per_pos"], lr, tps, wait)
        return rec
