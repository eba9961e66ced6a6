"""The run's own lengths for `draftline plan --from-store`: the mean prompt and answer tokens per sample that
this config's prepare and regenerate stages recorded. Pure like the rest of the cost model: the caller resolves
the config on its store (tasks/store/resolve.py) and passes the resolution; nothing here reads the store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from tasks.benchmark.results import LENGTH_FIX, length_gap
from tasks.core.config import RunConfig
from tasks.formats.acceptance import merge_counts


@dataclass
class Lengths:
    """Mean prompt and answer tokens per sample (and the sample count) that a run's stages recorded."""
    samples: Optional[int] = None
    prompt: Optional[float] = None
    answer: Optional[float] = None  # per sample, the target's (regenerate) or the data's
    source: str = ""
    longest: Optional[int] = None  # the longest sample, and samples per context-length bucket (prepare's stats)
    buckets: Optional[dict] = None


def unresolved(cfg: RunConfig, exc: Exception, data_identity: bool) -> Lengths:
    """No lengths, saying why: the config's data has no address here (DATA_IDENTITY: offline, no record of a
    commit), or the store could not be read."""
    if data_identity:
        return Lengths(source=f"this config's data has no address here ({str(exc)[:160]})")
    return Lengths(source=f"the store {cfg.store.uri} could not be read ({str(exc).splitlines()[0][:120]})")


def run_lengths(cfg: RunConfig, found: Any) -> Lengths:
    """The lengths FOUND (a resolution of CFG up to regenerate) records: its prepare artifact's, and its
    regenerate artifact's (or the regenerate shards committed so far); what is not there stays None, and
    `source` says what was found."""
    prep_at = found.of("prepare")
    prep = prep_at.artifact if prep_at is not None else None
    if prep is None:
        return Lengths(source=f"no prepare artifact of this config on {cfg.store.uri} yet")
    s = prep.stats
    samples = int(s.get("samples") or 0)
    if not samples:
        return Lengths(source=f"the prepare artifact {prep.digest[:12]} records no samples")
    out = Lengths(samples=samples, source=f"prepare {prep.digest[:12]} ({samples:,} samples)",
                  longest=s.get("longest"), buckets=s.get("length_buckets"))
    out.prompt = (s["tokens"] - s["masked_tokens"]) / samples  # with regeneration, the data's answers are replaced
    if not cfg.regenerate.enabled:
        out.answer = s["masked_tokens"] / samples
        return out
    reg = found.of("regenerate")
    arts = ([] if reg is None else [reg.artifact] if reg.artifact is not None
            else [reg.shards[i] for i in sorted(reg.shards)])  # else the shards committed so far
    regen = [a.stats for a in arts if a.stats.get("samples")]
    if not regen:
        out.source += "; nothing regenerated yet"
        return out
    n = sum(int(r["samples"]) for r in regen)
    tokens = sum(int(r["tokens"]) for r in regen)
    gen = sum(int(r.get("generated_tokens", 0)) for r in regen)
    out.answer = gen / n
    out.prompt = (tokens - gen) / n
    if all(r.get("longest") for r in regen):  # the regenerated answers' lengths replace the data's
        out.longest = max(int(r["longest"]) for r in regen)
        out.buckets = merge_counts(*(r.get("length_buckets") for r in regen))
    what = "regenerate" if reg.artifact is not None else f"{len(regen)} regenerate shard(s)"
    out.source += f", {what} ({n:,} samples)"
    return out


def length_notes(cfg: RunConfig, lengths: Lengths) -> list[str]:
    """A note when the target will serve contexts (target.max_model_len) longer than any training sample: the
    run's longest prepared sample with --from-store, else data.max_length. A sample reaches the served context
    at max_model_len - 1 tokens, the most the config check allows (extraction sends max_length + 1)."""
    train = {"longest": lengths.longest, "length_buckets": lengths.buckets, "max_length": cfg.data.max_length}
    gap = length_gap(train, cfg.target.max_model_len - 1, "Lengths: contexts served up to target.max_model_len")
    return [f"{gap}: a draft's acceptance falls at lengths it never trained on; {LENGTH_FIX}."] if gap else []
