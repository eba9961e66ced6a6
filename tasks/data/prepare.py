"""prepare: chat data -> tokenized Parquet shards with a verified assistant-only loss mask.

    sources (data_sources) -> normalized messages -> dedupe -> weighted, seeded mix
      -> chat template + loss mask (verified per sample) -> length limit
      -> seeded shuffle -> held-out split -> S Parquet shards on the store

Streamed: the conversations read and the samples encoded go to local spill files (tasks/data/spill.py) in a
scratch folder of this process, deleted after; memory holds indices and token counts, and each shard's rows are
gathered from the spill by index as the shard is written, so memory stays flat as the sample count grows.
The chat template and the verified assistant-only loss mask are tasks/data/chat.py, encoded in this process or on
`data.workers` processes with the same outcome (tasks/data/encoding.py); the Parquet sample format is
tasks/formats/samples.py.
"""

from __future__ import annotations

import json
import os
import random
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from tasks.core.errors import DraftlineError
from tasks.core.config import DataConfig, RunConfig
from tasks.core import owners
from tasks.data.sources import (
    LoadedSource,
    allocate,
    conversation_spill,
    load_sources,
)
from tasks.data.encoding import Encoded, LocalEncoder, PoolEncoder, gather, make_encoder, samples_schema
from tasks.data.spill import Spill
from tasks.data.chat import (  # noqa: F401  (ChatTemplateError, SampleDropped, encode_sample: the stage's errors and API)
    ChatMasker,
    ChatTemplateError,
    SampleDropped,
    encode_sample,
    make_masker,
    template_help,
)
from tasks.address import digests
from tasks.address.data import DATA_SCHEDULING_KEYS, data_identity
from tasks.core.digest import VERSIONS
from tasks.formats.samples import HELDOUT, Sample, length_stats, parquet_bytes, read_samples, shard_name, token_stats  # noqa: F401
from tasks.store.artifacts import ArtifactRef, Store
from tasks.store.stages import Stage

STAGE = "prepare"


class PrepareError(DraftlineError, ValueError):
    """Bad input to prepare (config, sources, sizes); the message says what to change."""


def split_shards(samples: list, num_shards: int) -> list[list]:
    if num_shards > len(samples):
        raise PrepareError(
            f"data.num_shards ({num_shards}) is larger than the number of training samples ({len(samples)}); "
            f"lower data.num_shards to at most {len(samples)} or add data"
        )
    base, extra = divmod(len(samples), num_shards)
    out, at = [], 0
    for i in range(num_shards):
        n = base + (1 if i < extra else 0)
        out.append(samples[at:at + n])
        at += n
    return out


def write_split(w: Any, train: list[int], heldout: list[int], num_shards: int,
                files: Callable[[list[list[int]]], Iterable[bytes]]) -> list[int]:
    """heldout.parquet + shard-*.parquet into an artifact writer, each file's Parquet bytes made by `files` from
    its samples' indices (in order, a few at a time: tasks/data/encoding.py `shard_files`); returns samples per
    shard."""
    shards = split_shards(train, num_shards)
    names = [HELDOUT] + [shard_name(i) for i in range(len(shards))]
    for name, data in zip(names, files([heldout, *shards]), strict=True):
        w.write_bytes(name, data)
    return [len(p) for p in shards]


# =========================================================================== the stage

class _Encoded:
    """The encoded samples: their tokens spilled to a local file (tasks/data/spill.py) as they are made, with the
    row of their conversation in the conversations' spill (its id, source and messages); in memory only each
    one's token and masked-token counts."""

    def __init__(self, path: str, conversations: Spill):
        self.conversations = conversations
        self.spill = Spill(path, samples_schema())
        self.tokens: array = array("q")
        self.masked: array = array("q")

    def add(self, e: Encoded) -> int:
        self.tokens.append(int(e.input_ids.shape[0]))
        self.masked.append(int(e.loss_mask.sum()))
        return self.spill.append({"conversation": e.row, "input_ids": e.input_ids, "loss_mask": e.loss_mask})

    def load(self, indices: list[int]) -> list[Sample]:
        return gather(self.spill, self.conversations, indices)

    def stats(self, indices: list[int]) -> dict[str, Any]:
        return length_stats([self.tokens[i] for i in indices], [self.masked[i] for i in indices])


@dataclass
class _Mix:
    """Per-source progress while filling the mix; `samples` are indices into the encoded samples."""

    loaded: LoadedSource
    weight: float
    cursor: int = 0
    samples: list[int] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)
    truncated: int = 0

    @property
    def left(self) -> int:
        return len(self.loaded.conversations) - self.cursor


Encoder = LocalEncoder | PoolEncoder


def _fill(mix: _Mix, want: int, encoder: Encoder, keep: Callable[[Encoded], int]) -> None:
    """Take this source's next conversations, encoded in order, until `want` more samples or no rows are left."""
    goal = len(mix.samples) + want
    for done in encoder.encoded(mix.loaded.conversations, mix.cursor, lambda: goal - len(mix.samples)):
        mix.cursor += 1
        if done.dropped:
            mix.dropped[done.dropped] += 1
            continue
        mix.samples.append(keep(done))
        mix.truncated += done.truncated


def to_encode(mixes: list[_Mix], data: DataConfig) -> int:
    """How many conversations the mix will encode, about (what sizes the encoding pool): all, or the samples wanted."""
    available = sum(m.left for m in mixes)
    return available if data.max_samples is None else min(available, data.max_samples + data.heldout)


def build_samples(mixes: list[_Mix], encoder: Encoder, data: DataConfig, keep: Callable[[Encoded], int]) -> None:
    """Fill each source's share of the mix (weights; a short source leaves its share to the others); KEEP
    stores each encoded sample (and its conversation's row) and returns its index."""
    if data.max_samples is None:
        for m in mixes:
            _fill(m, m.left, encoder, keep)
        return
    need = data.max_samples + data.heldout
    while True:
        remaining = need - sum(len(m.samples) for m in mixes)
        left = [m.left for m in mixes]
        if remaining <= 0 or sum(left) == 0:
            return
        for m, want in zip(mixes, allocate(remaining, [m.weight for m in mixes], left)):
            if want:
                _fill(m, want, encoder, keep)


def prepare_address(cfg: RunConfig, store: Store) -> str:
    """The prepare artifact's digest (the flow's `STAGE_DEF.address`, and `run_prepare`'s without one)."""
    return digests.prepare(cfg)


def run_prepare(cfg: RunConfig, store: Store, *, digest: str | None = None) -> ArtifactRef:
    """Build (or find) the prepare artifact: `shard-*.parquet` + `heldout.parquet` (docs/ARTIFACTS.md), at
    DIGEST (the flow's address for it; default `prepare_address`)."""
    digest = digest or prepare_address(cfg, store)
    return store.found_or_compute(STAGE, digest, lambda: _prepare(cfg, store, digest))


def _prepare(cfg: RunConfig, store: Store, digest: str) -> ArtifactRef:
    """The stage, streamed: conversations and encoded samples go to local spill files in a scratch folder of
    this process (deleted after, whatever happens); what stays in memory per sample is a few integers and its
    id (for dedupe), and one shard's samples while that shard is written."""
    t0 = time.time()
    data = cfg.data
    if data.max_length > cfg.target.max_model_len:
        raise PrepareError(
            f"data.max_length ({data.max_length}) exceeds target.max_model_len ({cfg.target.max_model_len}): "
            "the target could not read the longest samples; lower data.max_length or raise target.max_model_len"
        )
    masker = make_masker(cfg)
    with owners.owned_temporary_directory("prepare") as scratch, \
            conversation_spill(os.path.join(scratch, "conversations.arrow")) as convs:
        encoded = _Encoded(os.path.join(scratch, "samples.arrow"), convs)
        with encoded.spill:
            before = data_identity(data)
            loaded = load_sources(data.sources, seed=data.seed, keep_thinking=data.keep_thinking,
                                  system_prompt=data.system_prompt, dedupe=data.dedupe,
                                  keep_prompts=cfg.regenerate.enabled, spill=convs)
            if data_identity(data) != before:  # the rows read are not the content the address names
                raise PrepareError("a data source changed while prepare read it (a file still being written, an "
                                   "object overwritten); run again once the data is complete")
            mixes = [_Mix(ld, src.weight) for ld, src in zip(loaded, data.sources)]
            convs.finish()  # the encoding workers read it
            encoder = make_encoder(cfg, masker, convs.path, to_encode(mixes, data))
            try:
                build_samples(mixes, encoder, data, encoded.add)
                return _split_and_write(cfg, store, digest, mixes, masker, encoded, encoder, t0)
            finally:
                encoder.close()


def _split_and_write(cfg: RunConfig, store: Store, digest: str, mixes: list[_Mix], masker: ChatMasker,
                     encoded: _Encoded, encoder: Encoder, t0: float) -> ArtifactRef:
    """Shuffle the encoded samples' indices (seeded), split off the held-out ones and write the shards (their
    Parquet bytes built by the encoder: on its workers when there are some)."""
    data = cfg.data
    everything = [i for m in mixes for i in m.samples]
    for m in mixes:
        if m.loaded.conversations and not m.samples and m.cursor == len(m.loaded.conversations):
            reasons = ", ".join(f"{k}: {v}" for k, v in m.dropped.most_common())
            if m.dropped.get("mask_unverified", 0) + m.dropped.get("template_error", 0) == m.cursor:
                raise ChatTemplateError(
                    f"source {m.loaded.label!r}: no conversation could be masked with the chat template of "
                    f"{cfg.target.model} ({reasons}). {template_help(cfg.target.model)}"
                )
            raise PrepareError(f"source {m.loaded.label!r}: every conversation was dropped ({reasons}); "
                               "raise data.max_length or use overflow: truncate")
    random.Random(data.seed).shuffle(everything)  # the permutation depends only on the count
    if len(everything) <= data.heldout:
        raise PrepareError(
            f"data.heldout ({data.heldout}) leaves no training samples out of {len(everything)}; "
            "lower data.heldout or add data"
        )
    heldout, train = everything[: data.heldout], everything[data.heldout:]
    if data.max_samples is not None:
        train = train[: data.max_samples]
    role = bytearray(encoded.spill.count)  # 0 unused, 1 train, 2 held out
    for i in train:
        role[i] = 1
    for i in heldout:
        role[i] = 2

    dropped: Counter = Counter()
    per_source: dict[str, Any] = {}
    for m in mixes:
        d = m.loaded.dropped + m.dropped
        dropped.update(d)
        entry = per_source.setdefault(m.loaded.label, {"rows": 0, "samples": 0, "heldout": 0, "unused": 0,
                                                       "truncated": 0, "dropped": {}})
        roles = Counter(role[i] for i in m.samples)
        entry["rows"] += m.loaded.rows
        entry["samples"] += roles[1]
        entry["heldout"] += roles[2]
        entry["unused"] += m.left + roles[0]
        entry["truncated"] += m.truncated
        entry["dropped"] = dict(sorted((Counter(entry["dropped"]) + d).items()))

    stats: dict[str, Any] = {
        **encoded.stats(train),
        "dropped": dict(sorted(dropped.items())),
        "num_shards": data.num_shards,
        "heldout": len(heldout),
        "heldout_tokens": sum(encoded.tokens[i] for i in heldout),
        "per_source": per_source,
        "truncated": sum(m.truncated for m in mixes),
        "max_length": data.max_length,
        "mask_mode": masker.mode if masker.generation_tags else "+".join(sorted(masker.modes)) or "offsets",
    }
    config = {"target": cfg.target.model_dump(mode="json"),
              "data": data.model_dump(mode="json", exclude=DATA_SCHEDULING_KEYS)}  # the same at any data.workers
    with store.write(STAGE, digest, VERSIONS[STAGE], {}, config) as w:
        stats["shard_samples"] = write_split(
            w, train, heldout, data.num_shards,
            lambda parts: encoder.shard_files(encoded.spill, encoded.conversations, parts))
        stats["seconds"] = round(time.time() - t0, 2)
        stats["samples_per_s"] = round((len(train) + len(heldout)) / max(stats["seconds"], 1e-9), 1)
        art = w.commit(stats)
    return art.ref()


# the stage as the flow runs it (tasks/store/stages.py)
STAGE_DEF = Stage(name=STAGE, inputs=(), address=prepare_address, run=run_prepare)
