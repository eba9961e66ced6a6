"""The draft vocabulary's file: `vocab.safetensors` in a vocab artifact (docs/ARTIFACTS.md).

`d2t` (int64 [K], offsets: draft id i is target id i + d2t[i], the convention of speculators and vLLM),
`t2d` (bool [V], which target ids the draft vocabulary holds) and `token_counts` (int64 [V], the
loss-masked token counts it was chosen from). The vocab stage writes it; training and the tests read it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tasks.core.config import VocabConfig
from tasks.core.errors import DraftlineError
from tasks.formats.vocab_file import FILE, VocabFormatError, read_maps  # noqa: F401 - the file's reader, without torch
from tasks.store.artifacts import ArtifactMissing, ArtifactRef, Store

if TYPE_CHECKING:  # torch is imported where the maps are read: the vocab stage's module stays light
    import torch


class VocabError(DraftlineError, ValueError):
    """A vocabulary that cannot be built; the message says what to change."""


# the default draft vocabulary size, which a smaller target's vocabulary caps
_DEFAULT_K = VocabConfig.model_fields["draft_vocab_size"].default


def draft_size(requested: int, target_vocab: int) -> int:
    """The default (32,000) is capped at the target's vocabulary; an explicit larger size is an error."""
    if requested <= target_vocab:
        return requested
    if requested == _DEFAULT_K:
        return target_vocab
    raise VocabError(
        f"vocab.draft_vocab_size ({requested}) is larger than the target's vocabulary ({target_vocab}); "
        f"set it to at most {target_vocab} (or remove it: the default {_DEFAULT_K} is capped automatically)"
    )


def read_vocab(store: Store, vocab_ref: ArtifactRef, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t offsets int64 [K], t2d bool [V]) from the vocab artifact, checked against each other and against the
    token counts they were chosen from (the top-K)."""
    import torch
    from safetensors.torch import load as st_load

    try:
        art = store.open(vocab_ref.stage or "vocab", vocab_ref.digest)
    except ArtifactMissing:
        raise VocabFormatError(f"vocab artifact {vocab_ref.uri} is not committed on {store.uri}; run the vocab stage "
                               "first (or pass the ref it returned)") from None
    if FILE not in art.files():
        raise VocabFormatError(f"{art.uri} has no {FILE} (files: {art.files()}); it is not a vocab artifact")
    maps = st_load(art.read_bytes(FILE))
    if "d2t" not in maps or "t2d" not in maps:
        raise VocabFormatError(f"{art.uri}/{FILE} lacks d2t/t2d (has {sorted(maps)}); rebuild the vocab stage")
    d2t, t2d = maps["d2t"].to(torch.int64), maps["t2d"].to(torch.bool)
    if t2d.ndim != 1 or t2d.shape[0] != vocab_size:
        raise VocabFormatError(f"{art.uri}: t2d has shape {list(t2d.shape)} but the target's vocabulary has {vocab_size} "
                               "ids; the vocab artifact was built for another target: rerun the vocab stage")
    k = int(d2t.shape[0])
    ids = torch.nonzero(t2d).squeeze(1)  # ascending target ids in the draft vocabulary
    if ids.numel() != k:
        raise VocabFormatError(f"{art.uri}: t2d marks {ids.numel()} ids but d2t has {k} entries; the maps disagree")
    counts = maps.get("token_counts")
    if counts is not None and 0 < k < vocab_size:  # the draft vocabulary is the top-K of the counts it came from
        counts = counts.to(torch.int64)
        inside, outside = counts[t2d], counts[~t2d]
        if int(inside.min()) < int(outside.max()):
            left_out = int(torch.nonzero(~t2d).squeeze(1)[outside.argmax()])
            held = int(ids[inside.argmin()])
            raise VocabFormatError(f"{art.uri}: the draft vocabulary leaves out target id {left_out} (counted "
                                   f"{int(outside.max())} times) but holds id {held} (counted {int(inside.min())}): "
                                   "t2d/d2t are not the top-K of token_counts; rerun the vocab stage")
    arange = torch.arange(k, dtype=torch.int64)
    if torch.equal(d2t + arange, ids):
        return d2t, t2d  # offsets, the convention of speculators and vLLM
    if torch.equal(torch.sort(d2t).values, ids):
        return ids - arange, t2d  # absolute ids: convert (sorted, as the draft lm_head rows follow t2d)
    raise VocabFormatError(f"{art.uri}: d2t is neither offsets (i + d2t[i]) nor ids matching t2d; rerun the vocab stage")
