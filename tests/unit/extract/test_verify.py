"""The extraction check's arithmetic (tasks/extract/verify.py), without an engine: the verdict on one dataset's
checked positions is the same however many shards they are dealt into. The same with a real engine and store:
tests/unit/extract/test_extract.py::test_the_check_gives_one_verdict_at_4_and_at_64_shards_of_one_dataset."""

from __future__ import annotations

import random

import pytest

from tasks.extract.verify import MIN_ALONE, StateCheck, pooled_failure, refuses, summarize, upper_bound

THRESHOLD, CONFIDENCE = 0.85, 0.999


def test_the_bound_is_the_wilson_score_bound():
    # Wilson's upper bound at z = 3.0902 (one-sided 99.9%), worked by hand: 4/5 -> 0.9823, 0/2 -> 0.8268
    assert upper_bound(4, 5, CONFIDENCE) == pytest.approx(0.9823, abs=1e-4)
    assert upper_bound(0, 2, CONFIDENCE) == pytest.approx(0.8268, abs=1e-4)
    assert upper_bound(5, 5, CONFIDENCE) == 1.0 and upper_bound(0, 0, CONFIDENCE) == 1.0
    assert upper_bound(254, 256, CONFIDENCE) > 0.97  # the demo's 99.2% of 256 positions
    # more positions at the same agreement: a tighter bound
    assert upper_bound(80, 100, CONFIDENCE) < upper_bound(8, 10, CONFIDENCE) < upper_bound(4, 5, CONFIDENCE)


def test_four_of_five_is_not_refused_and_a_bad_shard_is():
    assert not refuses(4, 5, THRESHOLD, CONFIDENCE)  # issue 43's false alarm
    assert refuses(0, 8, THRESHOLD, CONFIDENCE) and refuses(20, 64, THRESHOLD, CONFIDENCE)  # 31%: a wrong layer
    assert refuses(39, 64, THRESHOLD, CONFIDENCE)  # 61%: the demo's planted cut
    assert not refuses(62, 64, THRESHOLD, CONFIDENCE)  # 96.9%: the lowest correct shard measured on the H100


def shard_check(outcomes: list[bool]) -> StateCheck:
    return StateCheck(head=None, positions_per_part=64, threshold=THRESHOLD, confidence=CONFIDENCE,
                      positions=len(outcomes), agree=sum(outcomes))


def deal(outcomes: list[bool], num_shards: int) -> list[list[bool]]:
    """OUTCOMES dealt into NUM_SHARDS shards in order, as prepare deals samples (the first ones one longer)."""
    base, extra = divmod(len(outcomes), num_shards)
    bounds = [i * base + min(i, extra) for i in range(num_shards + 1)]
    return [outcomes[a:b] for a, b in zip(bounds, bounds[1:])]


def verdict(outcomes: list[bool], num_shards: int) -> tuple[list[str], str | None]:
    """OUTCOMES (one dataset's checked positions, agreeing or not) dealt into NUM_SHARDS shards: the shards
    refused alone, then the pooled verdict over the others (what assembling the stage says)."""
    refused, committed = [], []
    for i, part in enumerate(deal(outcomes, num_shards)):
        check = shard_check(part)
        error = check.failure(i, [1, 3, 4, 6], "bf16", None)
        if error:
            refused.append(error)
        else:
            stats = check.stats() | {"mean_logit_gap": 0.0, "min_part_agreement": None}
            committed.append({"shard": i, "verify": stats})
    return refused, (None if refused else pooled_failure(summarize(committed), [1, 3, 4, 6], "bf16"))


@pytest.mark.parametrize("agreement,passes", [(1.0, True), (0.992, True), (0.94, True), (0.6, False),
                                              (0.31, False), (0.0, False)])
def test_one_dataset_gets_one_verdict_at_4_and_at_64_shards(agreement, passes):
    """160 positions, each agreeing with probability AGREEMENT (a seeded draw): correct extractions (100%, the
    demo's 99.2%, fp8-like near-ties at 94%) pass at 4 and at 64 shards; a cut (60%), a wrong layer (31%) and
    garbage (0%) fail at both, alone at 4 shards (40 positions each) and pooled at 64 (2-3 each)."""
    rng = random.Random(43)
    outcomes = [rng.random() < agreement for _ in range(160)]
    for n in (4, 64):
        refused, pooled = verdict(outcomes, n)
        assert (not refused and pooled is None) == passes, (n, refused, pooled)
        if not passes and n == 4:
            assert len(refused) == 4 and "do not reproduce the target's own next token" in refused[0]
        if not passes and n == 64:
            assert refused == [] and "pooled over every shard" in pooled and "Likely causes" in pooled
    if agreement == 0.94:  # the bare figure at 64 shards would have stopped this run
        assert min(sum(p) / len(p) for p in deal(outcomes, 64)) < THRESHOLD


def test_a_shard_of_few_positions_is_judged_only_pooled():
    assert shard_check([False] * (MIN_ALONE - 1)).failure(0, [1, 2], "bf16", None) is None
    said = shard_check([False] * MIN_ALONE).failure(0, [1, 2], "bf16", None)
    assert said.startswith("extract shard 0: the stored hidden states do not reproduce") and "at most" in said


def test_a_manifest_from_before_the_bound_is_pooled_from_its_figure():
    old = {"verify": {"positions": 64, "top1_agreement": 0.9844, "mean_logit_gap": 0.01, "threshold": 0.85,
                      "min_part_agreement": 0.98, "seconds": 0.1}}
    v = summarize([old, old])
    assert v["agree"] == 126 and v["positions"] == 128 and v["confidence"] == CONFIDENCE
    assert v["upper_bound"] > v["top1_agreement"] and pooled_failure(v) is None
