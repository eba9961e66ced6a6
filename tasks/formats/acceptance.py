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
