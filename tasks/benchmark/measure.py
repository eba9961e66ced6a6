"""What one batch of requests measures in a vLLM engine: output tokens and wall time, TTFT and
TPOT from vLLM's histograms, and the speculative-decoding counters around the requests turned into
acceptance length, per-position acceptance and the draft acceptance rate."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from tasks.benchmark import BenchmarkError
from tasks.benchmark.identity import identical
from tasks.formats.acceptance import acceptance_by_length

M_DRAFTS = "vllm:spec_decode_num_drafts"
M_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
M_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
M_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
M_TTFT = "vllm:time_to_first_token_seconds"
M_TPOT = "vllm:request_time_per_output_token_seconds"


@dataclass
class SpecCounters:
    """vLLM's cumulative spec-decode counters (or a difference of two snapshots)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)

    @classmethod
    def from_metrics(cls, m: dict[str, Any]) -> "SpecCounters":
        return cls(int(m.get(M_DRAFTS, 0) or 0), int(m.get(M_DRAFT_TOKENS, 0) or 0),
                   int(m.get(M_ACCEPTED, 0) or 0), [int(v) for v in (m.get(M_PER_POS) or [])])

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        n = max(len(self.per_pos), len(other.per_pos))
        a = self.per_pos + [0] * (n - len(self.per_pos))
        b = other.per_pos + [0] * (n - len(other.per_pos))
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted - other.accepted, [x - y for x, y in zip(a, b)])


def acceptance_figures(delta: SpecCounters, k: int) -> dict[str, Any]:
    """Acceptance figures from counter deltas over a measured run with k speculative tokens."""
    if delta.drafts <= 0:
        raise BenchmarkError(
            f"vLLM reported no speculative drafts (k={k}) during the measured requests: the draft was not "
            "used. Check that the engine was started with speculative_config and disable_log_stats=False"
        )
    per_pos = (delta.per_pos + [0] * k)[:k]
    cumulative = [p / delta.drafts for p in per_pos]
    conditional = []
    prev = delta.drafts
    for p in per_pos:
        conditional.append(p / prev if prev > 0 else 0.0)
        prev = p
    return {
        "mean_acceptance_length": 1.0 + delta.accepted / delta.drafts,
        "per_position_acceptance": cumulative,
        "per_position_conditional": conditional,
        "draft_acceptance_rate": delta.accepted / delta.draft_tokens if delta.draft_tokens > 0 else 0.0,
        "drafts": delta.drafts,
        "draft_tokens": delta.draft_tokens,
        "accepted_tokens": delta.accepted,
    }


def histogram_delta(before: dict[str, Any], after: dict[str, Any], name: str) -> tuple[int, float] | None:
    """(count, sum) observed between two metric snapshots, or None when the engine has no such histogram."""
    a, b = after.get(name), before.get(name) or {"count": 0, "sum": 0.0}
    if not isinstance(a, dict):
        return None
    return int(a["count"]) - int(b["count"]), float(a["sum"]) - float(b["sum"])


def relative_difference(measured: float, simulated: float) -> float:
    return (measured - simulated) / simulated if simulated else math.inf


@dataclass
class RunResult:
    """One eval at one batch size on one engine."""

    batch_size: int
    outputs: list[list[int]]
    seconds: float
    ttft_ms: float | None
    tpot_ms: float | None
    spec: SpecCounters | None = None
    # per request: its prompt's tokens and vLLM's accepted draft tokens per verify step (None where the engine
    # gives no per-request figures: the baseline, a vLLM before per_request_spec_decode_metrics)
    prompt_tokens: list[int] = field(default_factory=list)
    spec_steps: list[list[int] | None] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    def throughput(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "requests": len(self.outputs), "output_tokens": self.output_tokens,
                "seconds": round(self.seconds, 3),
                "output_tokens_per_s": self.output_tokens / self.seconds if self.seconds > 0 else 0.0,
                "tpot_ms": self.tpot_ms, "ttft_ms": self.ttft_ms}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def measure(engine: Any, prompts: list[list[int]], sampling: dict, batch_size: int) -> RunResult:
    """Generate for every prompt, `batch_size` requests per engine call, and time it.

    TTFT/TPOT come from vLLM's per-request histograms (deltas around the run; at batch size 1 one
    request per delta); engines without them get client-side figures (TTFT unknown, TPOT = latency
    per output token).
    """
    outputs: list[list[int]] = []
    steps: list[list[int] | None] = []
    wall = 0.0
    ttfts: list[float] = []
    tpots: list[float] = []
    first = engine.metrics()
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        before = engine.metrics() if i else first
        t0 = time.perf_counter()
        outs = engine.generate(chunk, sampling)
        dt_s = time.perf_counter() - t0
        after = engine.metrics()
        wall += dt_s
        got = [list(o["token_ids"]) for o in outs]
        outputs.extend(got)
        steps.extend(o.get("spec_steps") for o in outs)
        ttft = histogram_delta(before, after, M_TTFT)
        tpot = histogram_delta(before, after, M_TPOT)
        if ttft and ttft[0] > 0:
            ttfts.append(1000.0 * ttft[1] / ttft[0])
        if tpot and tpot[0] > 0:
            tpots.append(1000.0 * tpot[1] / tpot[0])
        elif tpot is None:
            n = max(g for g in map(len, got)) if got else 0
            if n:
                tpots.append(1000.0 * dt_s / n)
    last = engine.metrics()
    spec = SpecCounters.from_metrics(last) - SpecCounters.from_metrics(first)
    return RunResult(batch_size, outputs, wall, _mean(ttfts), _mean(tpots), spec, [len(p) for p in prompts], steps)


def spec_figures(run: RunResult, base: RunResult, k: int, temperature: float,
                 simulated: float | None, length_buckets: list[int] | None = None) -> dict[str, Any]:
    """Everything the report says about one eval, k and batch size (`length_buckets`: benchmark.length_buckets)."""
    out = run.throughput()
    out.update(acceptance_figures(run.spec or SpecCounters(), k))
    by_length = acceptance_by_length(run.prompt_tokens, run.spec_steps, length_buckets)
    if by_length:
        out["by_length"] = by_length
    b = base.throughput()
    out["baseline_output_tokens_per_s"] = b["output_tokens_per_s"]
    out["baseline_tpot_ms"] = b["tpot_ms"]
    out["baseline_ttft_ms"] = b["ttft_ms"]
    out["speedup"] = out["output_tokens_per_s"] / b["output_tokens_per_s"] if b["output_tokens_per_s"] else None
    if temperature == 0:
        same, firsts = identical(run.outputs, base.outputs)
        out["token_identical"] = same == len(run.outputs) == len(base.outputs)
        out["identical_requests"] = same
        diverged = [f for f in firsts if f is not None]
        out["first_divergence"] = min(diverged) if diverged else None
    else:
        out["token_identical"] = None  # sampling: outputs are not expected to match
        out["identical_requests"] = None
    out["simulated_acceptance_length"] = simulated
    return out
