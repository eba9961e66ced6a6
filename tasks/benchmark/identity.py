"""Greedy identity, judged against a control: at temperature 0 speculative outputs should equal the
baseline's, but the baseline itself differs between batch shapes where the engine rounds differently
(vLLM's CPU bf16 decode of a lone sequence, for one). The baseline decodes the same prompts again at
other batch sizes; its own divergence is the floor a speculative run is judged against.
"""

from __future__ import annotations

from typing import Any

IDENTICAL, WITHIN_NOISE, BEYOND_NOISE = "identical", "within_noise", "beyond_noise"


def identical(a: list[list[int]], b: list[list[int]]) -> tuple[int, list[int | None]]:
    """(requests whose tokens are equal, first differing position per request or None)."""
    firsts: list[int | None] = []
    same = 0
    for x, y in zip(a, b):
        if x == y:
            same += 1
            firsts.append(None)
            continue
        pos = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        firsts.append(pos)
    return same, firsts


def control_batch_sizes(batch_sizes: list[int], num_prompts: int) -> list[int]:
    """The baseline decodes added to the measured ones to show the engine's own divergence: the largest
    batch size again (run to run) and, when only one batch size is measured, one other batch shape
    (batch 1, or all prompts at once when batch 1 is the one measured). A few seconds on a started engine."""
    largest = max(batch_sizes)
    extra = [largest]
    if len(batch_sizes) == 1:
        other = 1 if largest > 1 else max(2, num_prompts)
        if other != largest:
            extra.append(other)
    return extra


def _common_prefix(x: list[int], y: list[int]) -> int:
    return len(x) if x == y else next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))


def baseline_floor(decodes: dict[str, list[list[int]]]) -> dict[str, Any]:
    """The engine's own greedy divergence: every pair of baseline decodes of the same prompts (other batch
    sizes, a repeat). Per request, `earliest` is the first token at which any two of them differ (None:
    they all agree), the noise floor a speculative output is judged against. `pairs` lists each pair once,
    a repeat ("batch 8 (repeat)") only against its original."""
    labels = list(decodes)
    n = min((len(v) for v in decodes.values()), default=0)
    pairs = []
    earliest: list[int | None] = [None] * n
    for i, la in enumerate(labels):
        for lb in labels[i + 1:]:
            firsts = identical(decodes[la], decodes[lb])[1]
            hits = [f for f in firsts if f is not None]
            repeats = [x.removesuffix(" (repeat)") for x in (la, lb) if x.endswith(" (repeat)")]
            if not repeats or repeats[0] in (la, lb):
                pairs.append({"a": la, "b": lb, "requests": len(firsts), "differing": len(hits),
                              "first_divergence": min(hits) if hits else None})
            for r, f in enumerate(firsts[:n]):
                if f is not None and (earliest[r] is None or f < earliest[r]):
                    earliest[r] = f
    return {"decodes": labels, "pairs": pairs, "earliest": earliest,
            "unstable_requests": sum(1 for e in earliest if e is not None), "requests": n}


def describe_floor(floor: dict[str, Any]) -> str:
    """'batch 1 vs batch 8: 7 of 8 prompts differ (first at token 5); batch 8 vs batch 8 (repeat): identical'."""
    parts = []
    for p in floor["pairs"]:
        what = ("identical" if not p["differing"] else
                f"{p['differing']} of {p['requests']} prompts differ (first at token {p['first_divergence']})")
        parts.append(f"baseline {p['a']} vs {p['b']}: {what}")
    return "; ".join(parts) if parts else "no second baseline decode"


def judge_identity(outputs: list[list[int]], reference: str, decodes: dict[str, list[list[int]]],
                   floor: dict[str, Any]) -> dict[str, Any]:
    """Speculative greedy outputs against the baseline at the same batch size (`reference`), with the
    baseline's own divergence as the floor. Per request: identical; or equal to another baseline decode
    (another batch shape gives this very output); or agreeing with some baseline decode at least up to the
    token where the baseline's decodes part among themselves (noise at the same place); else beyond noise.
    """
    kinds = {"identical": 0, "equals_other_decode": 0, "within_floor": 0, "beyond": 0}
    beyond_at: list[int] = []
    firsts: list[int] = []
    for r, out in enumerate(outputs):
        ref = decodes[reference][r]
        if out == ref:
            kinds["identical"] += 1
            continue
        firsts.append(_common_prefix(out, ref))
        if any(out == d[r] for d in decodes.values() if r < len(d)):
            kinds["equals_other_decode"] += 1
            continue
        agree = max(_common_prefix(out, d[r]) for d in decodes.values() if r < len(d))
        own = floor["earliest"][r] if r < len(floor["earliest"]) else None
        if own is not None and agree >= own:
            kinds["within_floor"] += 1
        else:
            kinds["beyond"] += 1
            beyond_at.append(agree)
    verdict = IDENTICAL if len(firsts) == 0 else (WITHIN_NOISE if not kinds["beyond"] else BEYOND_NOISE)
    return {"verdict": verdict, "requests": len(outputs), "differing": len(firsts),
            "first_divergence": min(firsts) if firsts else None, **kinds,
            "beyond_first_divergence": min(beyond_at) if beyond_at else None}


def identity_sentence(j: dict[str, Any], floor: dict[str, Any]) -> str:
    """What the report says about one eval, k and batch size."""
    if j["verdict"] == IDENTICAL:
        return "identical"
    differ = f"{j['differing']} of {j['requests']} outputs differ (first at token {j['first_divergence']})"
    if j["verdict"] == WITHIN_NOISE:
        how = []
        if j["equals_other_decode"]:
            how.append(f"{j['equals_other_decode']} equal the baseline's own output at another batch shape")
        if j["within_floor"]:
            how.append(f"{j['within_floor']} part where the baseline's own decodes part")
        return (f"differs within the engine's own numeric noise (measured: {describe_floor(floor)}): {differ}; "
                + ", ".join(how))
    return (f"differs beyond it: likely a bug: {differ}, {j['beyond']} of them from every baseline decode "
            f"(first at token {j['beyond_first_divergence']}) where the baseline's own decodes agree "
            f"(measured: {describe_floor(floor)})")
