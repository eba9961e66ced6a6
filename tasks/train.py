"""Stage `train`: an EAGLE-3 draft head trained on stored hidden states, exported for vLLM.

    ref = run_train(cfg, store, vocab_ref, extract_refs, on_metrics=print)
    # store: train/DIGEST/draft/{config.json, model.safetensors}, metrics.json

The model is speculators' `Eagle3DraftModel` (the architecture and checkpoint
format vLLM loads); everything around it is ours, so that it runs on a CPU, one
GPU, or as DDP ranks across a node's GPUs (applied from outside the model),
reads its data from the store (file:// or s3://) and survives kill -9.

Ranks: `train.gpus` (default every visible GPU, 1 on a CPU, where N > 1 means N
gloo ranks). With more than one, `run_train` starts them with torch's elastic
launcher (`launch_ranks`, what torchrun runs), follows rank 0's metrics while
they train and turns a failed rank into a TrainError naming it; each rank calls
`run_train` again. Started by torchrun yourself, every rank calls it directly.

The parts of a run, in the order `Trainer` builds them:

- inputs      `resolve_inputs`: target folder and config, layer ids (checked
              across shards and against the config), vocab maps, parts on the store
- model       `build_draft_model`: decoder shaped like the target (Llama or Qwen3
              layers), verifier embed/norm/lm_head from the target's safetensors;
              attention `resolve_attn_impl` (auto: flex_attention on a GPU where it
              compiles for the draft's shape, else sdpa, with the reason logged)
- data        `BatchStream`: a seeded (shard, part) order per epoch, seeded sample
              order inside a part, packing to exactly `batch_tokens` per step,
              `prefetch` parts loading ahead in parallel, a packer thread
- optimizer   AdamW over the trainable parameters; `lr_at`: linear warm-up, then
              cosine decay to `min_lr_ratio * lr` (a pure function of the step)
- checkpoints every `checkpoint_every` steps, a committed store artifact
              `checkpoint/<train digest[:20]>-s<step>`: fp32 weights, optimizer
              state (safetensors), data position, RNG states, history (state.json)
- metrics     one dict per step to `on_metrics` (loss, accuracy per TTT position,
              lr, tokens/s, data wait, achieved FLOP/s); held-out evaluation at the end
- export      `draft/config.json` + `draft/model.safetensors` (d2t/t2d included)

Resume is exact: the weights after an interrupted-and-resumed run equal those of
an uninterrupted one (same seed, same world size), because every source of
state (weights, AdamW moments, step, data position) is in the checkpoint and the
data order is a function of (seed, epoch, part), not of history.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import json
import logging
import math
import os
import queue
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from tasks import stopping
from tasks.config import RunConfig, TargetConfig, TrainConfig
from tasks import digest as digests
from tasks.acceptance import simulated_acceptance_length
from tasks.stats import StatsError, shard_stats
from tasks.vocab_maps import VocabFormatError, read_vocab
from tasks.digest import TRAIN_SCHEDULING_KEYS, VERSIONS
from tasks.faults import kill_point
from tasks.owners import owned_temporary_directory
from tasks.store import Artifact, ArtifactCorrupt, ArtifactMissing, ArtifactRef, Store
from tasks.target import (
    configured_layer_ids,
    load_hf_config,
    load_verifier_weights,
    resolve_model,
    text_config,
    validate_layer_ids,
)

STAGE = "train"
CKPT_STAGE = "checkpoint"
# Keys that decide where and how fast training runs, not what it produces.
SCHEDULING_KEYS = TRAIN_SCHEDULING_KEYS
MetricsCallback = Callable[[dict[str, Any]], None]
# Dense bf16 peak of the GPUs we know, for MFU (None elsewhere: CPU MFU is not meaningful).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12,
                   "B300": 2250e12, "L40S": 362e12}
HOLDOUT_MAX_FRACTION = 0.1

log = logging.getLogger("draftline.train")


class TrainError(ValueError):
    """Training cannot start or continue; the message names the problem and the fix."""


# ============================================================================ inputs


def _sorted_extract_refs(extract_refs: Sequence[ArtifactRef]) -> list[ArtifactRef]:
    """Shards in shard order (from their stats), so the caller's list order does not matter."""
    try:
        return sorted(extract_refs, key=lambda r: (shard_stats(r).shard, r.digest))
    except StatsError as exc:
        raise TrainError(str(exc)) from None


@dataclass(frozen=True)
class PartSpec:
    """One extraction part, as the data stream sees it."""

    index: int  # position in the run's part list (shard order, then part name)
    shard: int
    digest: str  # the extract artifact holding it
    name: str  # its file name there
    holdout: int = 0  # samples at the END of this part kept out of training for evaluation


@dataclass
class TrainInputs:
    """Everything `run_train` needs to know about its inputs, checked."""

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


def resolve_inputs(cfg: RunConfig, store: Store, vocab_ref: ArtifactRef,
                   extract_refs: Sequence[ArtifactRef]) -> TrainInputs:
    """Open and cross-check the inputs: layer ids, hidden size, vocab maps, parts, held-out samples."""
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
    try:
        d2t, t2d = read_vocab(store, vocab_ref, vocab)
    except VocabFormatError as exc:
        raise TrainError(str(exc)) from None
    return TrainInputs(
        digest=digests.train(cfg, vocab_ref, extract_refs), inputs=digests.train_inputs(cfg, vocab_ref, extract_refs),
        target_path=target_path, hf_config=hf, layer_ids=layer_ids, hidden_size=hidden, vocab_size=vocab,
        d2t=d2t, t2d=t2d, parts=parts, artifacts=arts, total_samples=total_samples)


# ============================================================================ model


def _draft_arch(tc: Any) -> str:
    """vLLM runs EAGLE-3 drafts with Llama or Qwen3 layers; Qwen3 targets get Qwen3 layers."""
    return "qwen3" if str(getattr(tc, "model_type", "")).startswith("qwen3") else "llama"


def draft_layer_config(train: TrainConfig, target: TargetConfig, target_path: str, hf_config: Any) -> Any:
    """The draft decoder layer's config: the target's layer type and attention shape."""
    from speculators.train.cli import create_transformer_layer_config

    tc = text_config(hf_config)
    layer_cfg = create_transformer_layer_config(
        verifier_name_or_path=target_path, num_layers=train.num_layers, draft_arch=_draft_arch(tc),
        hidden_act=None, sliding_window=int(getattr(tc, "max_position_embeddings", 4096) or 4096),
        full_attention_indices=list(range(train.num_layers)), trust_remote_code=target.trust_remote_code)
    if getattr(tc, "kv_lora_rank", None):
        # MLA targets (DeepSeek-V3, Kimi-K2.5): their `head_dim` is the rotary part only (64), which would give
        # the Llama draft layer a narrow attention (64 heads x 64 for a 7168 hidden). Use the value head width.
        layer_cfg.head_dim = int(getattr(tc, "v_head_dim", 0) or int(tc.hidden_size) // int(tc.num_attention_heads))
    return layer_cfg


def attention_shape(layer_cfg: Any) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of a draft layer's attention."""
    heads = int(layer_cfg.num_attention_heads)
    kv_heads = int(getattr(layer_cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(layer_cfg, "head_dim", None) or int(layer_cfg.hidden_size) // heads)
    return heads, kv_heads, head_dim


def flex_attention_compiles(device: torch.device, heads: int, kv_heads: int, head_dim: int,
                            dtype: torch.dtype = torch.bfloat16, seq: int = 256) -> None:
    """Compile flex_attention for this attention shape on `device` and run a forward and a backward
    pass with a causal mask over two packed documents, as a training step does; raises whatever the
    compiler or the kernel raises (no Triton, a head dim the GPU's shared memory cannot hold, ...)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = torch.arange(seq, device=device) // (seq // 2)

    def same_doc_causal(_b, _h, q, k):
        return (q >= k) & (doc[q] == doc[k])

    block = create_block_mask(same_doc_causal, None, None, seq, seq, device=device)
    q = torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, kv_heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, kv_heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    out = torch.compile(flex_attention)(q, k, v, block_mask=block, enable_gqa=heads != kv_heads)
    out.float().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolve_attn_impl(requested: str, device: torch.device, probe: Callable[[], None]) -> tuple[str, str | None]:
    """`train.attn_impl` on this device: (implementation, why auto fell back to sdpa or None).

    auto is flex_attention on a GPU when `probe` (flex_attention_compiles for the draft's shape)
    passes, 1.49x faster than sdpa on the H200 (benchmarks/RESULTS.md), and sdpa when it raises;
    on a CPU it is sdpa without a probe (flex_attention has no backward pass there). An explicit
    choice is returned as it is."""
    if requested != "auto":
        return requested, None
    if device.type != "cuda":
        return "sdpa", None
    try:
        probe()
    except Exception as exc:  # noqa: BLE001 - any compiler failure means: use sdpa
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        reason = f"flex_attention does not compile on {device}: {type(exc).__name__}: {first}"
        log.warning("train.attn_impl auto: %s; training with sdpa instead (set train.attn_impl: sdpa to skip "
                    "this check)", reason)
        with contextlib.suppress(Exception):
            torch._dynamo.reset()  # drop what the failed compile left behind
        return "sdpa", reason
    return "flex_attention", None


def build_draft_model(train: TrainConfig, target: TargetConfig, target_path: str, hf_config: Any,
                      layer_ids: list[int], d2t: torch.Tensor, t2d: torch.Tensor, attn_impl: str | None = None):
    """speculators' Eagle3DraftModel for this target, seeded, verifier weights loaded.

    The decoder follows speculators' EAGLE-3 recipe (`speculators train` defaults:
    norm before residual, norm before fc, normed output fed back across TTT steps),
    with full attention in every draft layer and the target's layer type. `attn_impl`
    (sdpa, flex_attention, eager) is the resolved `train.attn_impl` (auto means sdpa here).
    """
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    tc = text_config(hf_config)
    layer_cfg = draft_layer_config(train, target, target_path, hf_config)
    impl = attn_impl or (train.attn_impl if train.attn_impl != "auto" else "sdpa")
    layer_cfg._attn_implementation = "simple_flex_attention" if impl == "flex_attention" else impl
    k = int(d2t.shape[0])
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_cfg, draft_vocab_size=k, norm_before_residual=True, norm_before_fc=True,
        norm_output=True, eagle_aux_hidden_state_layer_ids=list(layer_ids[:-1]),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=train.ttt_steps)],
            verifier=VerifierConfig(name_or_path=target_path, architectures=list(hf_config.architectures or []))))
    torch.manual_seed(train.seed)
    model = Eagle3DraftModel(config)
    if k != int(t2d.shape[0]):
        model.load_vocab_mappings(t2d, d2t)

    tie = bool(getattr(tc, "tie_word_embeddings", False) or getattr(hf_config, "tie_word_embeddings", False))
    w = load_verifier_weights(target_path, tie)
    head = w["lm_head"][t2d] if model.use_draft_vocab else w["lm_head"]
    expect = {"embed_tokens": model.embed_tokens.weight, "norm": model.verifier_norm.weight}
    for role, param in expect.items():
        if tuple(w[role].shape) != tuple(param.shape):
            raise TrainError(f"{target_path}: verifier {role} has shape {list(w[role].shape)}, the draft expects "
                             f"{list(param.shape)}; the target config and weights disagree")
    with torch.no_grad():
        model.embed_tokens.weight.copy_(w["embed_tokens"])
        model.lm_head.weight.copy_(head)
        model.verifier_lm_head.weight.copy_(head)
        model.verifier_norm.weight.copy_(w["norm"])
    for p in (model.embed_tokens.weight, model.lm_head.weight, model.verifier_lm_head.weight,
              model.verifier_norm.weight):
        p.requires_grad_(False)
    return model


def resolve_precision(requested: str, device: torch.device) -> str:
    """`train.precision` on this device: auto is bf16 autocast on a GPU and on a CPU that multiplies
    bf16 natively (AMX / AVX512-BF16: 1.3-1.4x faster than float32 there, benchmarks/RESULTS.md), float32
    on other CPUs, where bf16 matmuls are emulated and many times slower."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bf16"
    from tasks.engine import cpu_has_fast_bf16

    return "bf16" if cpu_has_fast_bf16() else "fp32"


def trainable_names(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def flops_per_token(model: Any, ttt_steps: int) -> float:
    """Training FLOPs per token (estimate; matmuls only, attention scores left out):
    fc once (fwd+bwd: 6 per weight), the decoder layers per TTT step (6 per weight),
    the frozen draft lm_head per step (fwd + input-grad: 4*H*K), the verifier head once (2*H*K)."""
    hk = model.hidden_size * model.draft_vocab_size
    fc = sum(p.numel() for p in model.fc.parameters())
    layers = sum(p.numel() for p in model.layers.parameters())
    return 6.0 * fc + ttt_steps * (6.0 * layers + 4.0 * hk) + 2.0 * hk


# ============================================================================ data


@dataclass
class PartData:
    """One part in memory: bf16 hidden states [T, L, H] and its token arrays."""

    spec: PartSpec
    hidden: torch.Tensor
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    offsets: list[int]  # [N + 1]

    @property
    def num_samples(self) -> int:
        return len(self.offsets) - 1

    @property
    def train_samples(self) -> int:
        return self.num_samples - self.spec.holdout


class PartReader:
    """Reads parts from the store: a sha256-verified local copy, then `tasks.extract.load_part`
    (bf16 whatever the storage dtype). Thread-safe; used by the loader thread."""

    def __init__(self, artifacts: dict[str, Artifact], layer_ids: list[int], hidden_size: int):
        self.artifacts = artifacts
        self.layer_ids = list(layer_ids)
        self.hidden_size = hidden_size
        self.verified: set[tuple[str, str]] = set()  # sha256 checked once per process, sizes every read

    def __call__(self, spec: PartSpec) -> PartData:
        from tasks.parts import load_part

        art = self.artifacts[spec.digest]
        key = (spec.digest, spec.name)
        try:
            with art.local_copy(spec.name, verify=key not in self.verified) as path:
                raw = load_part(path)
            self.verified.add(key)
        except ArtifactCorrupt as exc:
            raise TrainError(f"{exc}: rerun the run (`draftline retry`) to extract that shard again") from None
        where = f"{art.uri}/{spec.name}"
        hs = raw["hidden_states"]
        offsets = [int(x) for x in raw["offsets"].tolist()]
        if raw.get("layer_ids") and list(raw["layer_ids"]) != self.layer_ids:
            raise TrainError(f"{where}: part metadata says layer ids {raw['layer_ids']}, the shard manifest says "
                             f"{self.layer_ids}; the shard is inconsistent: rerun its extraction")
        n_t = int(raw["input_ids"].shape[0])
        if (hs.ndim != 3 or hs.shape[0] != n_t or hs.shape[1] != len(self.layer_ids)
                or hs.shape[2] != self.hidden_size):
            raise TrainError(f"{where}: hidden_states has shape {list(hs.shape)}, expected [{n_t}, "
                             f"{len(self.layer_ids)}, {self.hidden_size}]")
        if not offsets or offsets[0] != 0 or offsets[-1] != n_t or any(b < a for a, b in zip(offsets, offsets[1:])):
            raise TrainError(f"{where}: offsets do not split its {n_t} tokens into samples; the part is corrupt")
        if spec.holdout > len(offsets) - 1:
            raise TrainError(f"{where}: {spec.holdout} held-out samples but the part has only {len(offsets) - 1}")
        return PartData(spec=spec, hidden=hs, input_ids=raw["input_ids"].to(torch.int64),
                        loss_mask=raw["loss_mask"].to(torch.bool), offsets=offsets)


@dataclass
class Batch:
    """`batch_tokens` packed positions in speculators' layout (after its `shift_batch`):
    position p pairs hidden state t with token t+1 of its sample."""

    hidden_states: torch.Tensor  # [1, T, (L-1)*H], aux layers concatenated
    verifier_last_hidden_states: torch.Tensor  # [1, T, H]
    input_ids: torch.Tensor  # [1, T]
    loss_mask: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    document_ids: torch.Tensor  # [1, T], -1 = padding
    tokens: int  # non-padding positions
    position: dict[str, int] | None = None  # stream position after this batch

    def model_inputs(self, device: torch.device) -> dict[str, torch.Tensor]:
        nb = device.type == "cuda"
        hs_dtype = self.hidden_states.dtype if device.type == "cuda" else torch.float32  # CPU: fp32 math
        return {
            "hidden_states": self.hidden_states.to(device, hs_dtype, non_blocking=nb),
            "verifier_last_hidden_states": self.verifier_last_hidden_states.to(device, hs_dtype, non_blocking=nb),
            "input_ids": self.input_ids.to(device, non_blocking=nb),
            "loss_mask": self.loss_mask.to(device, non_blocking=nb),
            "position_ids": self.position_ids.to(device, non_blocking=nb),
            "document_ids": self.document_ids.to(device, non_blocking=nb),
        }


Piece = tuple[PartData, int, int, int]  # (part, sample start token, offset in the shifted sample, length)


def assemble(pieces: Sequence[Piece], length: int, position: dict[str, int] | None = None,
             pin_memory: bool = False) -> Batch:
    """Copy pieces of samples into one batch of `length` positions (padding at the end).

    A sample of n tokens gives n-1 positions (speculators' shift): position j pairs
    the aux hidden states of token j with token j+1, its loss mask, the verifier's
    last hidden state of token j+1 (the target) and position id j+1.
    """
    first = pieces[0][0]
    n_l, h = int(first.hidden.shape[1]), int(first.hidden.shape[2])
    # pinned (page-locked) on a GPU run, so the copy to the device can overlap compute
    hs = torch.zeros(length, n_l - 1, h, dtype=first.hidden.dtype, pin_memory=pin_memory)
    last = torch.zeros(length, h, dtype=first.hidden.dtype, pin_memory=pin_memory)
    ids = torch.zeros(length, dtype=torch.int64)
    mask = torch.zeros(length, dtype=torch.bool)
    pos = torch.ones(length, dtype=torch.int64)
    doc = torch.full((length,), -1, dtype=torch.int64)
    o = 0
    for d, (data, start, j, n) in enumerate(pieces):
        a = start + j
        hs[o:o + n].copy_(data.hidden[a:a + n, :-1])
        last[o:o + n].copy_(data.hidden[a + 1:a + 1 + n, -1])
        ids[o:o + n] = data.input_ids[a + 1:a + 1 + n]
        mask[o:o + n] = data.loss_mask[a + 1:a + 1 + n]
        pos[o:o + n] = torch.arange(j + 1, j + 1 + n)
        doc[o:o + n] = d
        o += n
    return Batch(hidden_states=hs.view(1, length, -1), verifier_last_hidden_states=last.unsqueeze(0),
                 input_ids=ids.unsqueeze(0), loss_mask=mask.unsqueeze(0), position_ids=pos.unsqueeze(0),
                 document_ids=doc.unsqueeze(0), tokens=o, position=position)


def _rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng([int(k) % (2**32) for k in keys])


_DONE = object()


class BatchStream:
    """Training batches of exactly `batch_tokens` positions, epoch after epoch, forever.

    Order: epoch e visits the parts in the permutation `rng(seed, e)`; inside a part
    the samples go in the permutation `rng(seed, e, part index + 1)`. Samples are
    packed back to back; one that does not fit is split, its rest opening the next
    batch (its positions continue, so no token is dropped or padded). With several
    ranks each rank takes every world-th part of the epoch's order (or, with fewer
    parts than ranks, every world-th sample of every part).

    The position {epoch, cursor, sample, offset} after each batch rides on the batch;
    a stream started from it continues exactly where the other stopped.

    prefetch > 0: `prefetch` loader threads read the next parts in parallel and a
    packer thread assembles batches (2 ahead), so the training loop only waits when
    the store is slower than training. Memory: about prefetch + 2 parts.
    prefetch = 0: everything in the caller's thread.
    """

    def __init__(self, parts: Sequence[PartSpec], load: Callable[[PartSpec], PartData], *, batch_tokens: int,
                 seed: int, rank: int = 0, world: int = 1, prefetch: int = 2,
                 position: dict[str, int] | None = None, pin_memory: bool = False):
        if not parts:
            raise TrainError("no extraction parts to train on")
        self.parts = list(parts)
        self.load = load
        self.batch_tokens = batch_tokens
        self.seed = seed
        self.rank, self.world = rank, world
        self.by_part = len(self.parts) >= world
        self.prefetch = prefetch
        self.pin_memory = pin_memory
        self.start = dict(position or {"epoch": 0, "cursor": 0, "sample": 0, "offset": 0})
        self.position = dict(self.start)
        self.wait_s = 0.0  # time the consumer spent blocked, cumulative
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._batches: Iterator[Batch] | None = None
        self._batch_q: queue.Queue | None = None

    # ---------------------------------------------------------------- order
    def part_order(self, epoch: int) -> list[PartSpec]:
        perm = _rng(self.seed, epoch).permutation(len(self.parts))
        if self.by_part:
            perm = perm[self.rank::self.world]
        return [self.parts[i] for i in perm]

    def sample_order(self, epoch: int, data: PartData) -> np.ndarray:
        order = _rng(self.seed, epoch, data.spec.index + 1).permutation(data.train_samples)
        return order if self.by_part else order[self.rank::self.world]

    def _specs(self) -> Iterator[tuple[int, int, PartSpec]]:
        epoch, cursor = self.start["epoch"], self.start["cursor"]
        while True:
            order = self.part_order(epoch)
            for c in range(cursor, len(order)):
                yield epoch, c, order[c]
            epoch, cursor = epoch + 1, 0

    # ---------------------------------------------------------------- packing
    def _pack(self, loaded: Iterator[tuple[int, int, PartData]]) -> Iterator[Batch]:
        size = self.batch_tokens
        pieces: list[Piece] = []
        room = size
        k, j = self.start["sample"], self.start["offset"]  # only the first part resumes mid-way
        idle = 0
        for epoch, cursor, data in loaded:
            order = self.sample_order(epoch, data)
            produced = False
            while k < len(order):
                i = int(order[k])
                start, n = data.offsets[i], data.offsets[i + 1] - data.offsets[i] - 1
                if j >= n:  # a 0/1-token sample has no position to train on
                    k, j = k + 1, 0
                    continue
                take = min(n - j, room)
                pieces.append((data, start, j, take))
                produced = True
                j += take
                room -= take
                if j >= n:
                    k, j = k + 1, 0
                if room == 0:
                    yield assemble(pieces, size, {"epoch": epoch, "cursor": cursor, "sample": k, "offset": j},
                                   self.pin_memory)
                    pieces, room = [], size
            k, j = 0, 0
            idle = 0 if produced else idle + 1
            if idle > 2 * len(self.parts) + 2:
                raise TrainError("the extraction parts hold no sample of 2 or more tokens; nothing to train on")

    def _loaded_sync(self) -> Iterator[tuple[int, int, PartData]]:
        for epoch, cursor, spec in self._specs():
            yield epoch, cursor, self.load(spec)

    # ---------------------------------------------------------------- threads
    def _put(self, q: queue.Queue, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _get(self, q: queue.Queue) -> Any:
        while True:
            try:
                item = q.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set():
                    return _DONE
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def _loader(self, part_q: queue.Queue) -> None:
        """Loads the next `prefetch` parts in parallel (reading, sha256 and safetensors parsing
        release the GIL) and hands them on in order."""
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=self.prefetch, thread_name_prefix="draftline-part-load")
        pending: collections.deque = collections.deque()
        specs = self._specs()
        try:
            while not self._stop.is_set():
                while len(pending) < self.prefetch:
                    epoch, cursor, spec = next(specs)
                    pending.append((epoch, cursor, pool.submit(self.load, spec)))
                epoch, cursor, fut = pending.popleft()
                if not self._put(part_q, (epoch, cursor, fut.result())):
                    return
        except BaseException as exc:  # handed to the consumer, which raises it
            self._put(part_q, exc)
        finally:
            for *_, fut in pending:
                fut.cancel()
            pool.shutdown(wait=False)

    def _packer(self, part_q: queue.Queue, batch_q: queue.Queue) -> None:
        def parts() -> Iterator[tuple[int, int, PartData]]:
            while True:
                item = self._get(part_q)
                if item is _DONE:
                    return
                yield item

        try:
            for batch in self._pack(parts()):
                if not self._put(batch_q, batch):
                    return
        except BaseException as exc:
            self._put(batch_q, exc)

    def _start(self) -> None:
        if self.prefetch <= 0:
            self._batches = self._pack(self._loaded_sync())
            return
        part_q: queue.Queue = queue.Queue(maxsize=1)  # + `prefetch` loading + 1 being packed
        self._batch_q = queue.Queue(maxsize=2)
        self._threads = [
            threading.Thread(target=self._loader, args=(part_q,), name="draftline-part-loader", daemon=True),
            threading.Thread(target=self._packer, args=(part_q, self._batch_q), name="draftline-packer",
                             daemon=True),
        ]
        for t in self._threads:
            t.start()

    def next(self) -> Batch:
        if self._batches is None and self._batch_q is None:
            self._start()
        t0 = time.perf_counter()
        if self._batches is not None:
            batch = next(self._batches)
        else:
            assert self._batch_q is not None
            batch = self._get(self._batch_q)
            if batch is _DONE:
                raise RuntimeError("the batch stream was closed")
        self.wait_s += time.perf_counter() - t0
        self.position = dict(batch.position or self.position)
        return batch

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        self._threads = []


def holdout_plan(parts: list[PartSpec], last_part: PartData, total_samples: int, train: TrainConfig) -> int:
    """How many samples at the end of the last part are held out for evaluation.

    Enough for `eval_batches` batches, but at most 10% of all samples (at least
    one), and never the whole dataset. 0 when eval_batches is 0.
    """
    n = last_part.num_samples
    if train.eval_batches == 0 or (len(parts) == 1 and n < 2):
        return 0
    cap = max(1, int(max(total_samples, n) * HOLDOUT_MAX_FRACTION))
    if len(parts) == 1:
        cap = min(cap, n - 1)
    want = train.eval_batches * train.batch_tokens
    held, tokens = 0, 0
    while held < min(cap, n) and tokens < want:
        i = n - 1 - held
        tokens += last_part.offsets[i + 1] - last_part.offsets[i] - 1
        held += 1
    return held


def eval_batches(data: PartData, first: int, batch_tokens: int, max_batches: int) -> list[Batch]:
    """Held-out samples first.. of `data`, in order, packed like training (last batch padded)."""
    out: list[Batch] = []
    pieces: list[Piece] = []
    room = batch_tokens
    for i in range(first, data.num_samples):
        start, n = data.offsets[i], data.offsets[i + 1] - data.offsets[i] - 1
        j = 0
        while j < n and len(out) < max_batches:
            take = min(n - j, room)
            pieces.append((data, start, j, take))
            j += take
            room -= take
            if room == 0:
                out.append(assemble(pieces, batch_tokens))
                pieces, room = [], batch_tokens
    if pieces and len(out) < max_batches:
        out.append(assemble(pieces, batch_tokens))
    return out


def tail_copy(data: PartData, first: int) -> PartData:
    """Samples first.. of a part as a standalone copy (so the full part can be freed)."""
    a = data.offsets[first]
    return PartData(spec=data.spec, hidden=data.hidden[a:].clone(), input_ids=data.input_ids[a:].clone(),
                    loss_mask=data.loss_mask[a:].clone(), offsets=[o - a for o in data.offsets[first:]])


# ============================================================================ schedule and metrics


def lr_at(step: int, train: TrainConfig, elapsed_s: float | None = None) -> float:
    """Learning rate for the step with 0-based index `step`: linear warm-up over
    `warmup_steps`, then cosine decay from `lr` to `min_lr_ratio * lr` at `max_steps`.

    With a wall-clock budget (`max_minutes`) and the training seconds spent so far, the decay
    follows whichever end comes first, steps or time: a run that the budget stops at step 110
    of 400 has still annealed, instead of stopping at almost the peak rate."""
    if train.warmup_steps and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    span = max(1, train.max_steps - train.warmup_steps)
    progress = (step - train.warmup_steps) / span
    if train.max_minutes and elapsed_s is not None:
        progress = max(progress, elapsed_s / (train.max_minutes * 60))
    progress = min(1.0, max(0.0, progress))
    return train.lr * (train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _ratios(metrics: dict[str, float], ttt_steps: int) -> dict[str, Any]:
    """Per-position numbers from speculators' summed counters (after any all-reduce)."""
    chain = []
    for k in range(ttt_steps):
        tot = metrics.get(f"full_acc_{k}_total", 0.0)
        chain.append(metrics.get(f"full_acc_{k}_sum", 0.0) / tot if tot > 0 else 0.0)
    cond = [chain[0]] + [chain[k] / chain[k - 1] if chain[k - 1] > 0 else 0.0 for k in range(1, ttt_steps)]
    losses = [metrics.get(f"loss_{k}_sum", 0.0) / max(metrics.get(f"loss_{k}_total", 1.0), 1e-12)
              for k in range(ttt_steps)]
    return {"acc_per_pos": cond, "chain_acc_per_pos": chain, "loss_per_pos": losses}


def _r(x: float, nd: int = 6) -> float:
    return float(round(float(x), nd))


# ============================================================================ distributed


@dataclass
class DistEnv:
    """Rank, world and device; DDP when launched under torchrun (WORLD_SIZE > 1)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    owns_group: bool = False

    @classmethod
    def from_env(cls, train: TrainConfig) -> "DistEnv":
        use_cuda = train.device == "cuda" or (train.device == "auto" and torch.cuda.is_available())
        if use_cuda and not torch.cuda.is_available():
            raise TrainError("train.device is cuda but torch sees no GPU; set train.device: auto (or cpu)")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if use_cuda:
            torch.cuda.set_device(local)
            device = torch.device("cuda", local)
        else:
            device = torch.device("cpu")
        env = cls(rank=rank, world=world, local_rank=local, device=device)
        if world > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group(backend="nccl" if use_cuda else "gloo")
                env.owns_group = True
            if dist.get_world_size() != world:
                raise TrainError(f"WORLD_SIZE={world} but the process group has {dist.get_world_size()} ranks")
        return env

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        if not self.distributed or not values:
            return values
        import torch.distributed as dist

        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))

    def any(self, flag: bool) -> bool:
        """True on every rank if it is True on any (rank 0 decides time-budget stops)."""
        if not self.distributed:
            return flag
        return self.sum({"f": 1.0 if flag else 0.0})["f"] > 0

    def gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.owns_group = False


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states as JSON (torch states base64)."""
    state: dict[str, Any] = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": json.loads(json.dumps(random.getstate())),
    }
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    if device.type == "cuda":
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state(device).numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8),
                                 device)


# ============================================================================ the run


@dataclass
class RunState:
    """What a checkpoint restores besides weights and optimizer moments."""

    step: int = 0
    tokens_seen: int = 0
    train_seconds: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    positions: list[dict[str, int]] | None = None
    rng: list[dict[str, Any]] | None = None
    world: int = 1
    stopped_reason: str | None = None
    resumed_from: int | None = None


def checkpoint_digest(digest: str, step: int) -> str:
    return f"{digest[:20]}-s{step:08d}"


class Trainer:
    """One training run over resolved inputs. Parts (see the module docstring):
    env, model (+ddp), optimizer, stream / eval batches, checkpoints, metrics."""

    def __init__(self, cfg: RunConfig, store: Store, inputs: TrainInputs, env: DistEnv,
                 on_metrics: MetricsCallback | None = None,
                 load_part: Callable[[PartSpec], PartData] | None = None):
        self.cfg, self.t, self.store, self.inp, self.env = cfg, cfg.train, store, inputs, env
        self.on_metrics = on_metrics
        t = self.t
        if env.device.type == "cpu" and t.attn_impl == "flex_attention":
            raise TrainError("train.attn_impl flex_attention has no backward pass on CPU; use sdpa (or eager, "
                             "or auto)")
        if env.device.type == "cpu" and t.loss_impl == "fused":
            raise TrainError("train.loss_impl fused needs Triton on a GPU; use eager on CPU")
        self.read_part = load_part or PartReader(inputs.artifacts, inputs.layer_ids, inputs.hidden_size)
        self.precision = resolve_precision(t.precision, env.device)

        # model (auto attention: flex_attention where it compiles for this shape, else sdpa)
        shape = attention_shape(draft_layer_config(t, cfg.target, inputs.target_path, inputs.hf_config))
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
        self.attn_impl, self.attn_fallback = resolve_attn_impl(
            t.attn_impl, env.device, lambda: flex_attention_compiles(env.device, *shape, dtype=dtype))
        self.model = build_draft_model(t, cfg.target, inputs.target_path, inputs.hf_config, inputs.layer_ids,
                                       inputs.d2t, inputs.t2d, attn_impl=self.attn_impl).to(env.device)
        self.model.train()
        self.names = trainable_names(self.model)
        self.params = [p for n, p in self.model.named_parameters() if p.requires_grad]
        self.ddp: torch.nn.Module = self.model
        if env.distributed:
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = DistributedDataParallel(self.model, device_ids=[env.local_rank] if env.device.type == "cuda"
                                               else None)
        self.flops_per_token = flops_per_token(self.model, t.ttt_steps)
        self.peak_flops = self._peak_flops()

        # optimizer (lr is set every step from lr_at)
        self.optimizer = torch.optim.AdamW(self.params, lr=lr_at(0, t), weight_decay=t.weight_decay)
        from speculators.losses import resolve_loss_config

        self.forward_kwargs = {"ttt_steps": t.ttt_steps, "ttt_step_loss_decay": t.ttt_step_loss_decay,
                               "loss_config": resolve_loss_config("kl_div", t.loss_impl)}

        # held-out data: the tail of the last part
        last_spec = inputs.parts[-1]
        last = self.read_part(last_spec)
        held = holdout_plan(inputs.parts, last, inputs.total_samples, t)
        self.parts = inputs.parts[:-1] + [PartSpec(**{**last_spec.__dict__, "holdout": held})]
        self.eval: list[Batch] = []
        if held:
            tail = tail_copy(last, last.num_samples - held)
            self.eval = eval_batches(tail, 0, t.batch_tokens, t.eval_batches)
        self.heldout_samples = held
        del last

    # ---------------------------------------------------------------- helpers
    def _peak_flops(self) -> float | None:
        if self.env.device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(self.env.device)
        return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)

    def _autocast(self):
        if self.precision == "bf16":
            return torch.autocast(self.env.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _emit(self, rec: dict[str, Any]) -> None:
        if self.env.rank == 0 and self.on_metrics is not None:
            self.on_metrics(rec)

    # ---------------------------------------------------------------- checkpoints
    def _checkpoints(self) -> list[tuple[int, str]]:
        prefix = self.inp.digest[:20] + "-s"
        out = []
        for m in self.store.list(CKPT_STAGE):
            if m.digest.startswith(prefix) and m.inputs.get("train") == self.inp.digest:
                out.append((int(m.stats.get("step", -1)), m.digest))
        return sorted(out)

    def save_checkpoint(self, state: RunState, stream: BatchStream | None) -> str:
        from safetensors.torch import save_file

        env = self.env
        positions = env.gather(stream.position if stream is not None else None)
        rngs = env.gather(rng_state(env.device))
        digest = checkpoint_digest(self.inp.digest, state.step)
        if env.rank == 0:
            named = dict(self.model.named_parameters())
            weights = {n: named[n].detach().float().cpu().contiguous() for n in self.names}
            opt_state = self.optimizer.state_dict()
            index = {i: n for i, n in enumerate(self.names)}
            opt_tensors: dict[str, torch.Tensor] = {}
            for i, s in opt_state["state"].items():
                for key, value in s.items():
                    v = value if torch.is_tensor(value) else torch.tensor(value)
                    opt_tensors[f"{index[i]}::{key}"] = v.detach().cpu().contiguous()
            groups = [{k: v for k, v in g.items() if k != "params"} for g in opt_state["param_groups"]]
            meta = {
                "step": state.step, "tokens_seen": state.tokens_seen, "train_seconds": state.train_seconds,
                "world": env.world, "positions": positions, "rng": rngs, "param_names": self.names,
                "optimizer": {"param_groups": groups},
                # the lr the last step used (under max_minutes it follows the clock, not the step)
                "scheduler": {"kind": "warmup_cosine", "step": state.step, "by_clock": self.t.max_minutes is not None,
                              "lr": state.history[-1]["lr"] if state.history else lr_at(state.step, self.t)},
                "stopped_reason": state.stopped_reason, "history": state.history, "train_digest": self.inp.digest,
            }
            with owned_temporary_directory("draftline-ckpt-") as tmp, \
                    self.store.write(CKPT_STAGE, digest, VERSIONS[CKPT_STAGE], {"train": self.inp.digest},
                                     {"step": state.step}) as w:
                save_file(weights, os.path.join(tmp, "m.safetensors"))
                w.put_file("model.safetensors", os.path.join(tmp, "m.safetensors"))
                kill_point("train.checkpoint-file")
                save_file(opt_tensors, os.path.join(tmp, "o.safetensors"))
                w.put_file("optimizer.safetensors", os.path.join(tmp, "o.safetensors"))
                w.write_json("state.json", meta)
                w.commit({"step": state.step, "tokens_seen": state.tokens_seen})
            for _step, old in self._checkpoints()[:-self.t.keep_checkpoints]:
                self.store.delete(CKPT_STAGE, old)
        env.barrier()
        self._emit({"kind": "checkpoint", "step": state.step, "digest": digest})
        return digest

    def resume(self) -> RunState:
        """The newest committed checkpoint of this run, loaded; a fresh state if there is none."""
        from safetensors.torch import load as st_load

        for step, digest in reversed(self._checkpoints()):
            art = self.store.find(CKPT_STAGE, digest)
            if art is None:
                continue
            try:
                meta = art.read_json("state.json")
                weights = st_load(art.read_bytes("model.safetensors"))
                opt_tensors = st_load(art.read_bytes("optimizer.safetensors"))
            except ArtifactCorrupt as exc:
                log.warning("checkpoint %s unreadable (%s); trying an older one", digest, exc)
                continue
            if meta.get("param_names") != self.names:
                raise TrainError(f"checkpoint {art.uri} holds parameters {meta.get('param_names')[:4]}... but this "
                                 f"model has {self.names[:4]}...; the code changed: bump VERSIONS['train']")
            named = dict(self.model.named_parameters())
            with torch.no_grad():
                for n in self.names:
                    named[n].copy_(weights[n])
            state_by_idx: dict[int, dict[str, torch.Tensor]] = {}
            for key, value in opt_tensors.items():
                name, item = key.split("::", 1)
                state_by_idx.setdefault(self.names.index(name), {})[item] = value.to(self.env.device) \
                    if item != "step" else value
            groups = [dict(g, params=list(range(len(self.names)))) for g in meta["optimizer"]["param_groups"]]
            self.optimizer.load_state_dict({"state": state_by_idx, "param_groups": groups})
            rs = RunState(step=int(meta["step"]), tokens_seen=int(meta["tokens_seen"]),
                          train_seconds=float(meta["train_seconds"]), history=list(meta.get("history", [])),
                          positions=meta.get("positions"), rng=meta.get("rng"), world=int(meta.get("world", 1)),
                          stopped_reason=meta.get("stopped_reason"), resumed_from=step)
            if rs.world == self.env.world and rs.rng:
                set_rng_state(rs.rng[self.env.rank], self.env.device)
            log.info("resumed from checkpoint %s (step %d)", art.uri, rs.step)
            return rs
        return RunState(world=self.env.world)

    # ---------------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, Any]:
        """Held-out loss, per-position accuracy and simulated acceptance length (rank 0's view)."""
        out = evaluate_model(self.model, self.eval, self.env.device, self.forward_kwargs, self._autocast)
        return {**out, "val_samples": self.heldout_samples} if out else {}

    # ---------------------------------------------------------------- the loop
    def fit(self) -> RunState:
        t, env = self.t, self.env
        state = self.resume()
        position = None
        if state.positions:
            if state.world == env.world:
                position = state.positions[env.rank]
            else:
                epoch = max(p["epoch"] for p in state.positions if p) + 1
                log.warning("checkpoint was written by %d ranks, this run has %d: data restarts at epoch %d",
                            state.world, env.world, epoch)
                position = {"epoch": epoch, "cursor": 0, "sample": 0, "offset": 0}
        n_params = sum(p.numel() for p in self.params)
        log.info("train %s: %d trainable parameters, %.3g FLOPs/token, device %s x%d, %s attention, %s, %d parts, "
                 "%d held-out samples", self.inp.digest, n_params, self.flops_per_token, env.device, env.world,
                 self.attn_impl, self.precision, len(self.parts), self.heldout_samples)
        log.info("train config: %s", json.dumps(t.model_dump(mode="json"), sort_keys=True))
        self._emit({"kind": "start", "digest": self.inp.digest, "max_steps": t.max_steps, "step": state.step,
                    "resumed_from": state.resumed_from, "trainable_params": n_params,
                    "flops_per_token": self.flops_per_token, "peak_flops": self.peak_flops,
                    "device": str(env.device), "world_size": env.world, "layer_ids": self.inp.layer_ids,
                    "attn_impl": self.attn_impl, "attn_fallback": self.attn_fallback, "precision": self.precision})
        budget = t.max_minutes * 60 if t.max_minutes else None
        if state.stopped_reason == "time_budget" or state.step >= t.max_steps:
            return state  # the last run already finished training; only eval/export remain

        stream = BatchStream(self.parts, self.read_part, batch_tokens=t.batch_tokens, seed=t.seed, rank=env.rank,
                             world=env.world, prefetch=t.prefetch, position=position,
                             pin_memory=env.device.type == "cuda")
        session_t0 = time.perf_counter()
        seconds_before = state.train_seconds
        last_saved = state.step if state.resumed_from is not None else -1
        every = max(1, t.max_steps // 20)
        try:
            while state.step < t.max_steps:
                elapsed = seconds_before + time.perf_counter() - session_t0
                if budget is not None:  # rank 0's clock for every rank: the same stop and the same lr
                    elapsed = env.sum({"s": elapsed if env.rank == 0 else 0.0})["s"]
                if budget is not None and elapsed >= budget:
                    state.stopped_reason = "time_budget"
                    log.info("stopping at step %d: the time budget of %.3g min is spent", state.step, t.max_minutes)
                    break
                t0 = time.perf_counter()
                wait0 = stream.wait_s
                batch = stream.next()
                wait = stream.wait_s - wait0
                lr = lr_at(state.step, t, elapsed)
                for g in self.optimizer.param_groups:
                    g["lr"] = lr
                inputs = batch.model_inputs(env.device)
                with self._autocast():
                    _, loss, metrics = self.ddp(**inputs, **self.forward_kwargs)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, t.grad_clip)
                self.optimizer.step()
                state.step += 1
                kill_point(f"train.rank{env.rank}.step")  # drills: DRAFTLINE_FAULT_KILL=train.rank1.step:3

                sums = {k: float(v) for k, v in metrics.items()}
                sums["tokens"] = float(batch.tokens)
                sums = env.sum(sums)
                step_s = time.perf_counter() - t0
                tokens = int(sums["tokens"])
                state.tokens_seen += tokens
                state.train_seconds = seconds_before + time.perf_counter() - session_t0
                r = _ratios(sums, t.ttt_steps)
                tps = tokens / step_s if step_s > 0 else 0.0
                rec = {"kind": "train", "step": state.step, "max_steps": t.max_steps,
                       "loss": _r(sums["loss_sum"] / max(sums["loss_total"], 1.0)),
                       "loss_per_pos": [_r(x) for x in r["loss_per_pos"]],
                       "acc_per_pos": [_r(x) for x in r["acc_per_pos"]],
                       "chain_acc_per_pos": [_r(x) for x in r["chain_acc_per_pos"]],
                       "lr": lr, "grad_norm": _r(float(grad_norm)), "tokens": tokens, "tokens_per_s": _r(tps, 1),
                       "step_s": _r(step_s, 4), "data_wait_s": _r(wait, 4), "tflops": _r(tps * self.flops_per_token
                                                                                         / 1e12, 4),
                       "elapsed_s": _r(state.train_seconds, 2)}
                if self.peak_flops:
                    rec["mfu"] = _r(tps * self.flops_per_token / env.world / self.peak_flops, 4)
                state.history.append(rec)
                self._emit(rec)
                if state.step == 1 or state.step % every == 0 or state.step == t.max_steps:
                    log.info("step %d/%d loss %.4f acc %s lr %.3g %.0f tok/s wait %.3fs", state.step, t.max_steps,
                             rec["loss"], rec["acc_per_pos"], lr, tps, wait)
                if state.step % t.checkpoint_every == 0 and state.step < t.max_steps:
                    self.save_checkpoint(state, stream)
                    last_saved = state.step
            if state.stopped_reason is None:
                state.stopped_reason = "max_steps"
            if last_saved != state.step:
                self.save_checkpoint(state, stream)  # so a crash during export never retrains
        finally:
            stream.close()
        return state

    # ---------------------------------------------------------------- export
    def export(self, state: RunState) -> ArtifactRef:
        """Evaluate, write the vLLM draft folder and metrics, commit the train artifact (rank 0)."""
        env = self.env
        if env.rank == 0:
            val = self.evaluate()
            self._emit({"kind": "eval", "step": state.step, **val})
            if state.stopped_reason == "time_budget":
                log.warning("training stopped on the time budget (train.max_minutes=%s) at step %d of %d",
                            self.t.max_minutes, state.step, self.t.max_steps)
            stats = {
                "steps": state.step, "max_steps": self.t.max_steps, "tokens": state.tokens_seen,
                "tokens_per_s": _r(state.tokens_seen / state.train_seconds, 1) if state.train_seconds else 0.0,
                "train_seconds": _r(state.train_seconds, 2), "stopped_reason": state.stopped_reason,
                "val_acc_per_pos": val.get("val_acc_per_pos"), "val_loss": val.get("val_loss"),
                "simulated_acceptance_length": val.get("simulated_acceptance_length"),
                "val_tokens": val.get("val_tokens", 0), "heldout_samples": self.heldout_samples,
                "final_loss": state.history[-1]["loss"] if state.history else None,
                "layer_ids": self.inp.layer_ids, "draft_vocab_size": int(self.inp.d2t.shape[0]),
                "trainable_params": sum(p.numel() for p in self.params), "world_size": env.world,
                "device": env.device.type, "precision": self.precision, "attn_impl": self.attn_impl,
                "resumed_from_step": state.resumed_from,
            }
            metrics = {"steps": state.history, "eval": val, "stopped_reason": state.stopped_reason}
            with owned_temporary_directory("draftline-draft-") as tmp, \
                    self.store.write(STAGE, self.inp.digest, VERSIONS[STAGE], self.inp.inputs,
                                     self.cfg.train.model_dump(mode="json")) as w:
                export_draft(self.model, tmp, self.cfg.target.dtype)
                w.put_file("draft/config.json", os.path.join(tmp, "config.json"))
                w.put_file("draft/model.safetensors", os.path.join(tmp, "model.safetensors"))
                w.write_json("metrics.json", metrics)
                w.commit(stats)
            self._emit({"kind": "done", **stats})
        env.barrier()
        return self.store.open(STAGE, self.inp.digest).ref()


@torch.no_grad()
def evaluate_model(model: Any, batches: Sequence[Batch], device: torch.device, forward_kwargs: dict[str, Any],
                   autocast: Callable[[], Any] = contextlib.nullcontext) -> dict[str, Any]:
    """Loss, per-position accuracy (see `simulated_acceptance_length`) and the simulated
    acceptance length of any Eagle3DraftModel over packed batches; {} without batches."""
    if not batches:
        return {}
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    loss, tokens = 0.0, 0
    try:
        for b in batches:
            with autocast():
                _, batch_loss, m = model(**b.model_inputs(device), **forward_kwargs)
            loss += float(batch_loss)
            tokens += b.tokens
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
    finally:
        model.train(was_training)
    r = _ratios(sums, int(forward_kwargs.get("ttt_steps", 3)))
    return {"val_loss": _r(loss / len(batches)), "val_acc_per_pos": [_r(a) for a in r["acc_per_pos"]],
            "val_chain_acc_per_pos": [_r(a) for a in r["chain_acc_per_pos"]],
            "simulated_acceptance_length": _r(simulated_acceptance_length(r["acc_per_pos"]), 4), "val_tokens": tokens}


def export_draft(model: Any, folder: str, dtype: str = "bfloat16") -> None:
    """`folder/config.json` + `folder/model.safetensors` in speculators' format, which vLLM
    loads as an EAGLE-3 draft (`speculative_config={"method": "eagle3", "model": folder}`).
    Weights in `dtype` except d2t/t2d; the verifier's copies (verifier_lm_head/norm) are left out."""
    from safetensors.torch import save_file

    to = getattr(torch, dtype)
    skip = set(getattr(model, "_keys_to_ignore_on_save", None) or [])
    tensors = {}
    for name, value in model.state_dict().items():
        if name in skip or value is None:
            continue
        v = value.detach().cpu()
        tensors[name] = (v.to(to) if v.is_floating_point() else v).contiguous()
    with tempfile.TemporaryDirectory(prefix="draftline-cfg-") as tmp:
        model.config.save_pretrained(tmp)
        config = json.loads(open(os.path.join(tmp, "config.json")).read())
    config.pop("auto_map", None)  # speculators' custom-code hook; vLLM reads the format natively
    config["architectures"] = [type(model).__name__]  # what save_pretrained writes: "Eagle3DraftModel"
    config["dtype"] = dtype
    config["torch_dtype"] = dtype
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


# ============================================================================ ranks on this node


RANK_ENTRY = "import tasks.train; tasks.train.rank_main()"  # what each rank's `python -c` runs
RANK_LOG_TAIL_LINES = 25


def _wants_cuda(train: TrainConfig) -> bool:
    return train.device == "cuda" or (train.device == "auto" and torch.cuda.is_available())


def train_ranks(train: TrainConfig) -> int:
    """How many ranks `train.gpus` asks for here: every visible GPU by default, 1 on a CPU."""
    if not _wants_cuda(train):
        return train.gpus or 1
    visible = torch.cuda.device_count()
    if visible == 0:
        raise TrainError("train.device is cuda but torch sees no GPU; set train.device: auto (or cpu)")
    n = visible if train.gpus is None else train.gpus
    if n > visible:
        raise TrainError(f"train.gpus={n} but only {visible} GPU(s) are visible (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); lower train.gpus or leave it unset "
                         "to use every visible GPU")
    return n


def launched_as_rank() -> bool:
    """True inside a process torchrun (or our launcher) started: it trains as one rank of WORLD_SIZE."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ


class _MetricsTail:
    """Follows rank 0's JSON-lines metrics file from a thread and hands each record to `on_metrics`
    as it lands; `stop()` delivers what is left. A record is a whole line: a half-written one waits.
    When the run is asked to stop (tasks/stopping.py: Ctrl-C, SIGTERM) it calls `on_stop_request` once."""

    def __init__(self, path: str, on_metrics: MetricsCallback | None,
                 on_stop_request: Callable[[], None] | None = None):
        self.path, self.on_metrics, self.on_stop_request = path, on_metrics, on_stop_request
        self.records = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="draftline-rank0-metrics", daemon=True)
        self._warned = False

    def start(self) -> "_MetricsTail":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        pos, rest = 0, b""
        while True:
            last = self._stop.is_set()
            try:
                with open(self.path, "rb") as fh:
                    fh.seek(pos)
                    chunk = fh.read()
            except FileNotFoundError:
                chunk = b""
            pos += len(chunk)
            *lines, rest = (rest + chunk).split(b"\n")
            for line in lines:
                if line.strip():
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        log.warning("rank 0 wrote a metrics line that is not JSON: %r", line[:200])
                        continue
                    self._deliver(rec)
            if last:
                return
            if self.on_stop_request is not None and stopping.requested():
                self.on_stop_request()
                self.on_stop_request = None
            self._stop.wait(0.2)

    def _deliver(self, rec: dict[str, Any]) -> None:
        self.records += 1
        if self.on_metrics is None:
            return
        try:
            self.on_metrics(rec)
        except Exception as exc:  # noqa: BLE001 - a reporting failure must not stop the training it reports
            if not self._warned:
                log.warning("metrics callback failed (%s: %s); training goes on", type(exc).__name__, exc)
                self._warned = True


def _rank_log_tail(folder: str, local_rank: int) -> str:
    """The last lines a rank wrote to stderr (torch elastic's log layout: RUN/attempt_N/RANK/stderr.log)."""
    import glob

    lines: list[str] = []
    for path in sorted(glob.glob(os.path.join(folder, "*", "attempt_*", str(local_rank), "stderr.log"))):
        with open(path, errors="replace") as fh:
            lines = fh.read().splitlines()
    return "\n".join(lines[-RANK_LOG_TAIL_LINES:])


def describe_rank_failure(failures: dict[int, Any], world: int, log_dir: str) -> str:
    """One message for the ranks that failed (torch elastic's ProcessFailure per rank): the rank
    that started it first (killed by a signal from outside, else the earliest error), its error
    and traceback (or its last log lines when a signal left none), the others in a line each."""
    def tier(f: Any) -> int:  # 0: killed from outside (SIGKILL: OOM killer, a drill); 1: an error; 2: stopped
        if f.exitcode < 0:
            return 2 if f.signal_name() in ("SIGTERM", "SIGINT") else 0
        return 1

    def what(f: Any) -> tuple[str, str]:
        if f.exitcode < 0:
            return f"killed by {f.signal_name()} (exit code {f.exitcode}, pid {f.pid})", ""
        msg = f.message
        if isinstance(msg, dict):
            return msg.get("message", "<no message>"), msg.get("extraInfo", {}).get("py_callstack", "")
        return f"exited with code {f.exitcode} (pid {f.pid}): {msg}", ""

    order = sorted(failures, key=lambda r: (tier(failures[r]), failures[r].timestamp, r))
    root = order[0]
    head, trace = what(failures[root])
    lines = [f"training rank {root} of {world} failed: {head}"]
    for r in order[1:]:
        f = failures[r]
        lines.append(f"rank {r} of {world} was stopped ({f.signal_name()}, pid {f.pid})" if tier(f) == 2
                     else f"rank {r} of {world} also failed: {what(f)[0]}")
    if trace:
        lines += [f"rank {root} traceback:", trace.rstrip()]
    else:
        tail = _rank_log_tail(log_dir, failures[root].local_rank)
        if tail:
            lines += [f"rank {root}'s last log lines:", tail]
    lines.append(f"The other ranks were stopped; every rank's log is under {log_dir}. Fix the cause if it is one, "
                 "then retry the run (`draftline retry`): it resumes from the last checkpoint, if one was written, "
                 "with this or another train.gpus.")
    return "\n".join(lines)


def launch_ranks(cfg: RunConfig, store: Store, vocab_ref: ArtifactRef, extract_refs: list[ArtifactRef],
                 ranks: int, on_metrics: MetricsCallback | None = None) -> ArtifactRef:
    """Train on `ranks` processes of this node started by torch's elastic launcher (what torchrun
    runs): each is a fresh Python that calls `run_train` as one DDP rank (NCCL on GPUs, gloo on a
    CPU). Rank 0 appends its metrics to a JSON-lines file that this process follows while they run.
    A rank that fails stops the others (the launcher's doing) and this call raises TrainError naming
    the rank, with its error and traceback. Rank logs go to a temporary folder, kept on failure."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from tasks.owners import owned_tempdir
    from tasks.store import COMMITTED_HERE

    digest = digests.train(cfg, vocab_ref, extract_refs)
    folder = owned_tempdir("draftline-ranks-")
    paths = {k: os.path.join(folder, name) for k, name in
             (("args", "args.json"), ("metrics", "metrics.jsonl"), ("result", "result.json"), ("logs", "logs"))}
    with open(paths["args"], "w") as fh:  # no secrets: the store's credentials come from each rank's environment
        json.dump({"cfg": cfg.model_dump(mode="json"), "store": store.uri, "vocab": vocab_ref.model_dump(mode="json"),
                   "extract": [r.model_dump(mode="json") for r in extract_refs], "metrics": paths["metrics"],
                   "result": paths["result"]}, fh)
    # Ctrl-C and SIGTERM stay with the run's own handlers (flows/interrupts.py): they raise in this thread, and
    # the launcher stops the ranks on the way out. (It takes a signal nobody sends, restored below; torch < 2.8
    # has no such option and takes SIGTERM/SIGINT itself, which stops the ranks too.)
    quiet = {"signals_to_handle": "SIGUSR2"} if "signals_to_handle" in LaunchConfig.__dataclass_fields__ else {}
    launch = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=ranks, run_id=f"draftline-{digest[:12]}-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",  # torchrun --standalone: a private rendezvous
        max_restarts=0,  # a failed rank fails the task; the retry resumes from the checkpoint
        monitor_interval=0.5, logs_specs=DefaultLogsSpecs(log_dir=paths["logs"], redirects=Std.ALL), **quiet)
    log.info("train %s: starting %d ranks with torch's elastic launcher; rank logs under %s", digest, ranks,
             paths["logs"])
    saved = {}  # the launcher sets handlers in the main thread only; whatever it set, ours come back after
    if threading.current_thread() is threading.main_thread():
        saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                                                        signal.SIGQUIT)}
    tail = _MetricsTail(paths["metrics"], on_metrics, lambda: _terminate_ranks(folder)).start()
    try:
        elastic_launch(launch, sys.executable)("-c", RANK_ENTRY, paths["args"])
    except (ChildFailedError, SignalException) as exc:
        stopping.check(f"training on {ranks} ranks (they were stopped; a rerun resumes from the last checkpoint)")
        if isinstance(exc, SignalException):
            raise TrainError(f"training on {ranks} ranks was stopped by {exc.sigval.name}; the ranks were "
                             f"terminated (logs under {paths['logs']}); a retry resumes from the last checkpoint"
                             ) from None
        raise TrainError(describe_rank_failure(exc.failures, ranks, paths["logs"])) from None
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
        tail.stop()
    with open(paths["result"]) as fh:
        result = json.load(fh)
    ref = ArtifactRef.model_validate(result["ref"])
    if result["executed"]:
        COMMITTED_HERE.add(ref.attempt)  # our ranks computed it: the run summary counts it as executed
    shutil.rmtree(folder, ignore_errors=True)
    return ref


def _terminate_ranks(folder: str) -> None:
    """SIGTERM the ranks whose pid files are in `folder` (the run was asked to stop); the launcher
    then sees them end and returns."""
    import glob

    for path in glob.glob(os.path.join(folder, "rank-*.pid")):
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(open(path).read()), signal.SIGTERM)


def _exit_with_parent() -> None:
    """A rank whose launcher died (the flow's process killed) stops too instead of training on unseen."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="draftline-parent-watch", daemon=True).start()


def _rank_main() -> None:
    args = json.loads(open(sys.argv[-1]).read())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank {rank}/{world} %(levelname)s %(name)s: %(message)s")
    _exit_with_parent()
    with open(os.path.join(os.path.dirname(sys.argv[-1]), f"rank-{rank}.pid"), "w") as fh:
        fh.write(str(os.getpid()))
    cfg = RunConfig.model_validate(args["cfg"])
    if not _wants_cuda(cfg.train) and "OMP_NUM_THREADS" not in os.environ:
        # ranks share the CPU: oversubscribed OpenMP threads spin against each other
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    store = Store.from_config(cfg.store.model_copy(update={"uri": args["store"]}))
    sink = open(args["metrics"], "a", buffering=1) if rank == 0 else None

    def on_metrics(rec: dict[str, Any]) -> None:
        if sink is not None:
            sink.write(json.dumps(rec, default=str) + "\n")  # line-buffered: one whole line per record

    try:
        ref = run_train(cfg, store, ArtifactRef.model_validate(args["vocab"]),
                        [ArtifactRef.model_validate(r) for r in args["extract"]], on_metrics)
    finally:
        if sink is not None:
            sink.close()
    if rank == 0:
        tmp = args["result"] + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"ref": ref.model_dump(mode="json"), "executed": ref.executed_here}, fh)
        os.replace(tmp, args["result"])


def rank_main() -> None:
    """Entry point of one rank that `launch_ranks` started (`python -c RANK_ENTRY ARGS.json`). An
    exception is written to torch elastic's error file, from which the launcher reports it."""
    from torch.distributed.elastic.multiprocessing.errors import record

    record(_rank_main)()


def run_train(cfg: RunConfig, store: Store, vocab_ref: ArtifactRef, extract_refs: list[ArtifactRef],
              on_metrics: MetricsCallback | None = None) -> ArtifactRef:
    """Train (or resume, or find) the draft for these inputs; returns the train artifact's ref.

    A committed train artifact is returned at once. Otherwise training resumes from
    the newest committed checkpoint of the same digest, or starts fresh. With more
    than one rank to use (`train.gpus`, default every visible GPU) this process
    starts them with torch's elastic launcher (`launch_ranks`) and waits; with one,
    it trains itself. Under torchrun every rank calls this; rank 0 writes, all ranks
    return the same ref.
    """
    digest = digests.train(cfg, vocab_ref, extract_refs)
    found = store.find(STAGE, digest)
    if found is not None:
        return found.ref()
    if not launched_as_rank():
        ranks = train_ranks(cfg.train)
        if ranks > 1:
            resolve_inputs(cfg, store, vocab_ref, extract_refs)  # bad inputs fail here, before any rank starts
            return launch_ranks(cfg, store, vocab_ref, extract_refs, ranks, on_metrics)
    env = DistEnv.from_env(cfg.train)
    try:
        inputs = resolve_inputs(cfg, store, vocab_ref, extract_refs)
        trainer = Trainer(cfg, store, inputs, env, on_metrics)
        state = trainer.fit()
        return trainer.export(state)
    finally:
        env.close()


__all__ = [
    "Batch", "BatchStream", "CKPT_STAGE", "DistEnv", "PartData", "PartReader", "PartSpec", "SCHEDULING_KEYS",
    "STAGE", "TrainError", "TrainInputs", "Trainer", "build_draft_model", "checkpoint_digest", "evaluate_model",
    "export_draft",
    "flops_per_token", "launch_ranks", "lr_at", "resolve_attn_impl", "resolve_inputs", "run_train",
    "simulated_acceptance_length", "train_ranks",
]
