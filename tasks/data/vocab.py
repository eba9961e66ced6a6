"""vocab: the draft's vocabulary, from the tokens the draft will be trained to predict.

Token counts over the loss-masked tokens of every training shard (streamed, one
Parquet row group at a time), the top-K of them as the draft vocabulary, and
the two maps speculators' `Eagle3DraftModel` and vLLM load with the draft:

- `d2t` int64 [K]: draft index i -> target id `i + d2t[i]` (an offset, not the id);
- `t2d` bool [V]: whether a target id is in the draft vocabulary.

Same selection rule as `speculators.train.vocab_mapping.build_vocab_mappings_from_distribution`
(count descending, then id ascending; padded with the lowest unused ids when
fewer than K tokens were seen; kept in ascending id order), so a draft made
here and one made by speculators from the same counts are interchangeable.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from tasks.core.config import RunConfig
from tasks.address import digests
from tasks.core.digest import VERSIONS
from tasks.store.artifacts import ArtifactRef, Store
from tasks.store.stages import Shown, Stage
from tasks.formats.vocab_maps import FILE, VocabError, draft_size

STAGE = "vocab"
_REPORT_SIZES = (1024, 2048, 4096, 8192, 16384, 32000, 65536)


def target_vocab_size(cfg: RunConfig) -> int:
    """The target's output vocabulary (its lm_head rows), from its config."""
    from tasks.engine.target import load_hf_config, text_config

    return int(text_config(load_hf_config(cfg.target)).vocab_size)


def training_shards(data_art: Any) -> list[str]:
    from tasks.formats.samples import HELDOUT

    shards = sorted(f for f in data_art.files() if f.endswith(".parquet") and f != HELDOUT)
    if not shards:
        raise VocabError(f"{data_art.uri} holds no training shards (shard-*.parquet); re-run prepare")
    return shards


def count_tokens(data_art: Any, vocab_size: int, files: list[str] | None = None) -> tuple[np.ndarray, int]:
    """Counts of loss-masked token ids over the training shards (or `files`), and the number of masked tokens."""
    from tasks.formats.samples import iter_token_batches

    shards = files if files is not None else training_shards(data_art)
    counts = np.zeros(vocab_size, dtype=np.int64)
    masked = 0
    for ids, mask in iter_token_batches(data_art, shards):
        picked = ids[mask.astype(bool)]
        if picked.size == 0:
            continue
        hi = int(picked.max())
        if hi >= vocab_size or int(picked.min()) < 0:
            raise VocabError(
                f"{data_art.uri}: token id {hi} is outside the target's vocabulary of {vocab_size}; the data was "
                "tokenized for another model (check target.model)"
            )
        counts += np.bincount(picked, minlength=vocab_size)
        masked += int(picked.size)
    return counts, masked


def build_maps(counts: np.ndarray, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [K], t2d bool [V]) from per-id counts; see the module docstring for the rule."""
    v = counts.shape[0]
    k = draft_vocab_size
    if k > v:
        raise VocabError(f"draft vocabulary {k} > target vocabulary {v}")
    seen = np.nonzero(counts > 0)[0]
    order = seen[np.lexsort((seen, -counts[seen]))]  # count descending, id ascending
    chosen = order[:k]
    if chosen.size < k:  # pad with the lowest ids not chosen yet
        free = np.setdiff1d(np.arange(v), chosen, assume_unique=False)
        chosen = np.concatenate([chosen, free[: k - chosen.size]])
    chosen = np.sort(chosen).astype(np.int64)
    d2t = chosen - np.arange(k, dtype=np.int64)
    t2d = np.zeros(v, dtype=bool)
    t2d[chosen] = True
    return d2t, t2d


def coverage_table(counts: np.ndarray, masked: int, sizes: list[int]) -> dict[int, float]:
    """Share of masked tokens a top-k vocabulary covers, for several k."""
    ranked = np.sort(counts[counts > 0])[::-1]
    cum = np.cumsum(ranked)
    out = {}
    for k in sizes:
        if k <= counts.shape[0]:
            out[k] = float(cum[min(k, cum.size) - 1] / masked) if masked and cum.size else 0.0
    return out


def summary_markdown(stats: dict[str, Any], table: dict[int, float], source: str) -> str:
    k = stats["draft_vocab_size"]
    lines = [
        "## Draft vocabulary",
        "",
        f"Top **{k:,}** of the target's {stats['target_vocab_size']:,} tokens, counted over "
        f"**{stats['masked_tokens']:,}** loss-masked tokens ({stats['distinct_tokens']:,} distinct) of `{source}`.",
        "",
        f"Coverage (share of masked tokens inside the draft vocabulary): **{stats['coverage']:.2%}**",
        "",
    ]
    if stats.get("heldout_coverage") is not None:
        lines += [f"On the held-out split (not used to choose it): **{stats['heldout_coverage']:.2%}**", ""]
    lines += [
        "| draft vocabulary | coverage |",
        "|---:|---:|",
    ]
    for size, cov in sorted(table.items()):
        mark = " (chosen)" if size == k else ""
        lines.append(f"| {size:,}{mark} | {cov:.2%} |")
    if k not in table:
        lines.append(f"| {k:,} (chosen) | {stats['coverage']:.2%} |")
    return "\n".join(lines) + "\n"


def vocab_address(cfg: RunConfig, store: Store, data_ref: ArtifactRef) -> str:
    """The vocab artifact's digest (the flow's `STAGE_DEF.address`, and `run_vocab`'s without one)."""
    return digests.vocab(cfg, data_ref)


def run_vocab(cfg: RunConfig, store: Store, data_ref: ArtifactRef, *, digest: str | None = None) -> ArtifactRef:
    """Build (or find) `vocab.safetensors` (d2t, t2d, token_counts) for the data artifact `data_ref`, at DIGEST
    (the flow's address for it; default `vocab_address`)."""
    digest = digest or vocab_address(cfg, store, data_ref)
    return store.found_or_compute(STAGE, digest, lambda: _vocab(cfg, store, data_ref, digest))


def _vocab(cfg: RunConfig, store: Store, data_ref: ArtifactRef, digest: str) -> ArtifactRef:
    from safetensors.numpy import save

    t0 = time.time()
    vocab_size = target_vocab_size(cfg)
    k = draft_size(cfg.vocab.draft_vocab_size, vocab_size)
    data_art = store.open(data_ref.stage, data_ref.digest)
    counts, masked = count_tokens(data_art, vocab_size)
    if masked == 0:
        raise VocabError(f"{data_art.uri} has no loss-masked tokens; the data has no assistant answers to learn")
    d2t, t2d = build_maps(counts, k)
    coverage = float(counts[t2d].sum() / masked)
    from tasks.formats.samples import HELDOUT

    heldout_coverage = None
    if HELDOUT in data_art.files():  # out of sample: tokens the vocabulary was not chosen on
        h_counts, h_masked = count_tokens(data_art, vocab_size, [HELDOUT])
        heldout_coverage = round(float(h_counts[t2d].sum() / h_masked), 6) if h_masked else None
    table = coverage_table(counts, masked, sorted({*(s for s in _REPORT_SIZES if s < vocab_size), k}))
    stats: dict[str, Any] = {
        "draft_vocab_size": k,
        "target_vocab_size": vocab_size,
        "coverage": round(coverage, 6),
        "masked_tokens": masked,
        "distinct_tokens": int((counts > 0).sum()),
        "coverage_at": {str(s): round(c, 6) for s, c in table.items()},
        "heldout_coverage": heldout_coverage,
    }
    stats["summary_md"] = summary_markdown(stats, table, f"{data_ref.stage}/{data_ref.digest}")
    blob = save({"d2t": d2t, "t2d": t2d, "token_counts": counts},
                metadata={"draft_vocab_size": str(k), "target_vocab_size": str(vocab_size)})
    with store.write(STAGE, digest, VERSIONS[STAGE], {data_ref.stage: data_ref.digest},
                     {"vocab": cfg.vocab.model_dump(mode="json")}) as w:
        w.write_bytes(FILE, blob)
        stats["seconds"] = round(time.time() - t0, 2)
        art = w.commit(stats)
    return art.ref()


# the stage as the flow runs it (tasks/store/stages.py)
def show_vocab(cfg: RunConfig, store: Store, made: dict[str, Any]) -> Shown:
    """The coverage table of the vocabulary, in the Prefect UI."""
    summary = made[STAGE].stats.get("summary_md")
    return Shown(markdown=[("draft-vocabulary", "Draft vocabulary coverage", summary)] if summary else [])


STAGE_DEF = Stage(name=STAGE, inputs=("data",), address=vocab_address, run=run_vocab, show=show_vocab)
