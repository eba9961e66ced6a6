"""Acceptance length from per-position draft accuracy: the one formula training stats, the benchmark's
offline estimate and its plot share.

acc_j = P(draft token j is right | draft tokens 1..j-1 were right), the per-position accuracy training
reports (`val_acc_per_pos`: greedy, against the verifier's argmax within the draft vocabulary, on
loss-masked positions). The chance that the first j drafts are all accepted is prod_{i<=j} acc_i, and
the expected tokens per verifier step with k draft tokens is

    E[acceptance length] = 1 + sum_{j=1..k} prod_{i<=j} acc_i

(the leading 1 is the token the verifier always emits). speculators measures the products directly
(`full_acc_k`).
"""

from __future__ import annotations

from typing import Sequence


def accepted_up_to(acc_per_pos: Sequence[float], k: int | None = None) -> list[float]:
    """prod_{i<=j} acc_i for j = 1..k. With k beyond the trained positions the last position's
    accuracy is repeated (an extrapolation; the benchmark's report marks it)."""
    acc = [min(1.0, max(0.0, float(a))) for a in acc_per_pos]
    if not acc:
        return []
    out, run = [], 1.0
    for j in range(len(acc) if k is None else k):
        run *= acc[min(j, len(acc) - 1)]
        out.append(run)
    return out


def simulated_acceptance_length(acc_per_pos: Sequence[float] | None, k: int | None = None) -> float | None:
    """1 + sum_{j=1..k} prod_{i<=j} acc_i (1.0 with no draft position); None when no accuracies were
    measured. k defaults to the trained positions."""
    if acc_per_pos is None:
        return None
    return 1.0 + sum(accepted_up_to(acc_per_pos, k))


# ---------------------------------------------------------------------------- by context length

# Context-length buckets (upper bounds, exclusive): the report, the data stats and `draftline check` share them.
# benchmark.length_buckets gives a benchmark's by-length table other bounds (`bounds` below).
DEFAULT_BOUNDS: tuple[int, ...] = (512, 2048, 8192, 32768)


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else f"{n:,}"


def buckets_of(bounds: Sequence[int] | None = None) -> tuple[tuple[int | None, str], ...]:
    """(upper bound, label) per bucket of ascending `bounds` (default DEFAULT_BOUNDS), the last one unbounded:
    (512, 2048) gives <512, 512-2K, >2K."""
    b = tuple(bounds or DEFAULT_BOUNDS)
    return ((b[0], f"<{_tokens(b[0])}"),
            *((hi, f"{_tokens(lo)}-{_tokens(hi)}") for lo, hi in zip(b, b[1:])),
            (None, f">{_tokens(b[-1])}"))


LENGTH_BUCKETS = buckets_of(DEFAULT_BOUNDS)


def length_bucket(tokens: int, bounds: Sequence[int] | None = None) -> str:
    """The bucket of a context of `tokens` tokens."""
    for bound, label in buckets_of(bounds):
        if bound is None or tokens < bound:
            return label
    raise AssertionError("unreachable")


def bucket_rank(label: str, bounds: Sequence[int] | None = None) -> int:
    return [lb for _, lb in buckets_of(bounds)].index(label)


def bucket_bounds(label: str) -> tuple[int, int | None]:
    """[lower, upper) context lengths of the bucket `label` (upper None: unbounded)."""
    i = bucket_rank(label)
    return (LENGTH_BUCKETS[i - 1][0] or 0) if i else 0, LENGTH_BUCKETS[i][0]


def length_counts(lengths: Sequence[int]) -> dict[str, int]:
    """How many of `lengths` fall in each bucket: the non-empty ones, shortest first."""
    counts: dict[str, int] = {}
    for n in lengths:
        b = length_bucket(int(n))
        counts[b] = counts.get(b, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: bucket_rank(kv[0])))


def merge_counts(*many: dict[str, int] | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for counts in many:
        for b, n in (counts or {}).items():
            out[b] = out.get(b, 0) + int(n)
    return dict(sorted(out.items(), key=lambda kv: bucket_rank(kv[0])))


def steps_by_length(prompt_tokens: int, accepted_per_step: Sequence[int],
                    bounds: Sequence[int] | None = None) -> dict[str, list[int]]:
    """[drafts, accepted tokens] per context-length bucket of one request, from vLLM's per-step accepted counts
    (`per_request_spec_decode_metrics: detailed`). The first draft is made once prefill has produced the first
    output token (context = prompt + 1); every verify step adds its accepted tokens plus the bonus token."""
    out: dict[str, list[int]] = {}
    context = prompt_tokens + 1
    for a in accepted_per_step:
        cell = out.setdefault(length_bucket(context, bounds), [0, 0])
        cell[0] += 1
        cell[1] += int(a)
        context += int(a) + 1
    return out


def acceptance_by_length(prompt_tokens: Sequence[int], steps: Sequence[Sequence[int] | None],
                         bounds: Sequence[int] | None = None) -> dict[str, dict[str, float | int]]:
    """Mean acceptance length (1 + accepted / drafts) per context-length bucket over requests, shortest bucket
    first, empty buckets left out, with the requests that drafted in each (a long answer can span two buckets);
    {} when no request carried per-step figures. `bounds`: the buckets' upper bounds (default DEFAULT_BOUNDS)."""
    total: dict[str, list[int]] = {}
    for p, s in zip(prompt_tokens, steps):
        for b, (d, a) in steps_by_length(p, s or [], bounds).items():
            cell = total.setdefault(b, [0, 0, 0])
            cell[0] += d
            cell[1] += a
            cell[2] += 1
    return {b: {"mean_acceptance_length": 1.0 + a / d, "drafts": d, "accepted_tokens": a, "requests": r}
            for b, (d, a, r) in sorted(total.items(), key=lambda kv: bucket_rank(kv[0], bounds)) if d}
