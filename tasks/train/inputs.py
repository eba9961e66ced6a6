"""The train stage's inputs, opened and cross-checked before any training: the target's folder and
config, the layer ids the shards hold (against each other and the config) and the subset the head
reads, the draft vocabulary maps, and every part on the store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tasks.address import digests
from tasks.core.config import RunConfig
from tasks.store.stats import StatsError, shard_stats
from tasks.store.artifacts import ArtifactCorrupt, ArtifactMissing, ArtifactRef, Store
from tasks.store.reader import Artifact
from tasks.engine.target import (
    configured_layer_ids,
    load_hf_config,
    resolve_model,
    text_config,
    validate_layer_ids,
)
from tasks.train import TrainError
from tasks.train.stream import PartSpec
from tasks.formats.vocab_maps import VocabFormatError, read_vocab


def _sorted_extract_refs(extract_refs: Sequence[ArtifactRef]) -> list[ArtifactRef]:
    """Shards in shard order (from their stats), so the caller's list order does not matter."""
    try:
        return sorted(extract_refs, key=lambda r: (shard_stats(r).shard, r.digest))
    except StatsError as exc:
        raise TrainError(str(exc)) from None


@dataclass
class TrainInputs:
    """Everything training needs to know about its inputs, checked (`resolve_inputs`)."""

    digest: str
    inputs: dict[str, str]
    target_path: str
    hf_config: Any
    layer_ids: list[int]
    hidden_size: int
    vocab_size: int
    d2t: torch.Tensor  # int64 [K], offsets: draft index i -> target id i + d2t[i]
    t2d: torch.Tensor  # bool [V]
    parts: list[PartSpec]
    artifacts: dict[str, Artifact]  # extract digest -> opened artifact
    total_samples: int
    stored_layer_ids: list[int] | None = None  # what the parts hold, when the head reads a subset (layer_ids)


def resolve_inputs(cfg: RunConfig, store: Store, vocab_ref: ArtifactRef,
                   extract_refs: Sequence[ArtifactRef], *, digest: str | None = None) -> TrainInputs:
    """Open and cross-check the inputs: layer ids, hidden size, vocab maps, parts, held-out samples. DIGEST:
    the train artifact's address when the caller has it (the stage's); computed from the inputs otherwise."""
    if not extract_refs:
        raise TrainError("train needs at least one extraction shard; run the extract stage first")
    target_path = resolve_model(cfg.target)
    hf = load_hf_config(cfg.target, target_path)
    tc = text_config(hf)
    n_layers, hidden, vocab = int(tc.num_hidden_layers), int(tc.hidden_size), int(tc.vocab_size)

    want = configured_layer_ids(cfg, n_layers)  # compared with the shards' own ids below
    refs = _sorted_extract_refs(extract_refs)
    arts: dict[str, Artifact] = {}
    parts: list[PartSpec] = []
    layer_ids: list[int] | None = None
    total_samples = 0
    for ref in refs:
        try:
            art = store.open(ref.stage or "extract", ref.digest)
        except ArtifactMissing:
            raise TrainError(f"extraction shard {ref.uri} is not committed on {store.uri}; rerun extraction "
                             "for it (completed shards are reused)") from None
        except ArtifactCorrupt as exc:
            raise TrainError(f"extraction shard {ref.uri} is corrupt ({exc}); rerun the run (`draftline retry`): "
                             "a corrupt shard counts as missing and is extracted again") from None
        st = shard_stats(art.ref())
        ids = list(st.layer_ids)
        if not ids:
            raise TrainError(f"{art.uri}: its manifest has no layer_ids; it was not written by the extract stage")
        if layer_ids is None:
            layer_ids = ids
        elif ids != layer_ids:
            raise TrainError(f"extraction shards disagree on layer ids: {refs[0].uri} has {layer_ids}, {art.uri} "
                             f"has {ids}; re-extract the odd shard with extract.layer_ids: {layer_ids}")
        if st.hidden_size is not None and st.hidden_size != hidden:
            raise TrainError(f"{art.uri}: hidden_size {st.hidden_size} but the target {target_path} has "
                             f"{hidden}; these hidden states come from another model")
        names = sorted(f for f in art.files() if f.startswith("part-") and f.endswith(".safetensors"))
        if not names:
            raise TrainError(f"{art.uri} holds no part-*.safetensors files; rerun extraction for it")
        arts[art.digest] = art
        parts += [PartSpec(index=len(parts) + i, shard=st.shard, digest=art.digest, name=n)
                  for i, n in enumerate(names)]
        total_samples += st.samples
    assert layer_ids is not None
    if layer_ids != want:
        source = "extract.layer_ids in the config" if cfg.extract.layer_ids else "the default for this target"
        raise TrainError(f"the extraction shards hold layer ids {layer_ids} but {source} is {want}; "
                         f"set extract.layer_ids: {layer_ids} or re-extract")
    try:
        validate_layer_ids(layer_ids, n_layers)
    except ValueError as exc:
        raise TrainError(str(exc)) from None
    stored, layer_ids = layer_ids, head_layer_ids(cfg, layer_ids)
    try:
        d2t, t2d = read_vocab(store, vocab_ref, vocab)
    except VocabFormatError as exc:
        raise TrainError(str(exc)) from None
    return TrainInputs(
        digest=digest or digests.train(cfg, vocab_ref, extract_refs),
        inputs=digests.train_inputs(cfg, vocab_ref, extract_refs),
        target_path=target_path, hf_config=hf, layer_ids=layer_ids, hidden_size=hidden, vocab_size=vocab,
        d2t=d2t, t2d=t2d, parts=parts, artifacts=arts, total_samples=total_samples, stored_layer_ids=stored)


def head_layer_ids(cfg: RunConfig, stored: list[int]) -> list[int]:
    """The layers the run's head reads (its auxiliary ids, then the last layer) out of the `stored` ones:
    all of them unless the head names a subset; a TrainError naming extract.layer_ids when it names
    layers the extraction does not hold."""
    head = train_head(cfg)
    aux = list(head.layer_ids or stored[:-1])
    if aux[-1] >= stored[-1]:
        raise TrainError(f"train.heads: {head.label} reads target layers {aux}, but {stored[-1]} is this target's "
                         f"last layer: auxiliary ids lie below it")
    missing = [i for i in aux if i not in stored[:-1]]
    if missing:
        union = sorted(set(stored[:-1]) | set(aux)) + [stored[-1]]
        fix = (f"Set extract.layer_ids: {union}: the extract stage extracts them (once, cached) and every head "
               "reads its own layers from them")
        try:
            validate_layer_ids(union, stored[-1])
        except ValueError as exc:  # the extract stage's own rule refuses that set
            fix = (f"The extract stage cannot store them beside the others ({exc}): give the heads layer_ids "
                   "from one set that extract.layer_ids can hold, and set extract.layer_ids to it")
        raise TrainError(
            f"train.heads: {head.label} reads target layers {aux}, but the extract stage's hidden states hold "
            f"{stored[:-1]} (and the last layer, {stored[-1]}): {missing} are not there. {fix}")
    return aux + [stored[-1]]


def train_head(cfg: RunConfig):
    """The one head a train run makes (config.head_config picks it out of train.heads)."""
    try:
        return cfg.train.head
    except ValueError as exc:
        raise TrainError(f"{exc}: run_train trains one head at a time (tasks.core.config.head_config)") from None
