"""prepare: chat data -> tokenized Parquet shards with a verified assistant-only loss mask.

    sources (data_sources) -> normalized messages -> dedupe -> weighted, seeded mix
      -> chat template + loss mask (verified per sample) -> length limit
      -> seeded shuffle -> held-out split -> S Parquet shards on the store

The chat template and the verified assistant-only loss mask are tasks/data/chat.py; the Parquet sample
format is tasks/formats/samples.py.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


from tasks.core.errors import DraftlineError
from tasks.core.config import DataConfig, RunConfig
from tasks.data.sources import (
    LoadedSource,
    allocate,
    load_sources,
)
from tasks.data.chat import (  # noqa: F401  (ChatTemplateError, SampleDropped, encode_sample: the stage's errors and API)
    ChatMasker,
    ChatTemplateError,
    SampleDropped,
    encode_sample,
    make_masker,
    template_help,
)
from tasks.address import digests
from tasks.address.data import data_identity
from tasks.core.digest import VERSIONS
from tasks.formats.samples import HELDOUT, Sample, parquet_bytes, read_samples, shard_name, token_stats  # noqa: F401
from tasks.store.artifacts import ArtifactRef, Store
from tasks.store.stages import Stage

STAGE = "prepare"


class PrepareError(DraftlineError, ValueError):
    """Bad input to prepare (config, sources, sizes); the message says what to change."""


def split_shards(samples: list[Sample], num_shards: int) -> list[list[Sample]]:
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


def write_split(w: Any, train: list[Sample], heldout: list[Sample], num_shards: int) -> list[int]:
    """heldout.parquet + shard-*.parquet into an artifact writer; returns samples per shard."""
    shards = split_shards(train, num_shards)
    w.write_bytes(HELDOUT, parquet_bytes(heldout))
    for i, part in enumerate(shards):
        w.write_bytes(shard_name(i), parquet_bytes(part))
    return [len(p) for p in shards]


# =========================================================================== the stage

@dataclass
class _Mix:
    """Per-source progress while filling the mix."""

    loaded: LoadedSource
    weight: float
    cursor: int = 0
    samples: list[Sample] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)
    truncated: int = 0

    @property
    def left(self) -> int:
        return len(self.loaded.conversations) - self.cursor


def _fill(mix: _Mix, want: int, masker: ChatMasker, data: DataConfig) -> None:
    """Encode this source's next conversations until `want` more samples or no rows are left."""
    goal = len(mix.samples) + want
    convs = mix.loaded.conversations
    while len(mix.samples) < goal and mix.cursor < len(convs):
        conv = convs[mix.cursor]
        mix.cursor += 1
        try:
            sample, truncated = encode_sample(masker, conv, data)
        except SampleDropped as drop:
            mix.dropped[drop.reason] += 1
            continue
        mix.samples.append(sample)
        mix.truncated += truncated


def build_samples(mixes: list[_Mix], masker: ChatMasker, data: DataConfig) -> None:
    """Fill each source's share of the mix (weights; a short source leaves its share to the others)."""
    if data.max_samples is None:
        for m in mixes:
            _fill(m, m.left, masker, data)
        return
    need = data.max_samples + data.heldout
    while True:
        remaining = need - sum(len(m.samples) for m in mixes)
        left = [m.left for m in mixes]
        if remaining <= 0 or sum(left) == 0:
            return
        for m, want in zip(mixes, allocate(remaining, [m.weight for m in mixes], left)):
            if want:
                _fill(m, want, masker, data)


def prepare_address(cfg: RunConfig, store: Store) -> str:
    """The prepare artifact's digest (the flow's `STAGE_DEF.address`, and `run_prepare`'s without one)."""
    return digests.prepare(cfg)


def run_prepare(cfg: RunConfig, store: Store, *, digest: str | None = None) -> ArtifactRef:
    """Build (or find) the prepare artifact: `shard-*.parquet` + `heldout.parquet` (docs/ARTIFACTS.md), at
    DIGEST (the flow's address for it; default `prepare_address`)."""
    digest = digest or prepare_address(cfg, store)
    return store.found_or_compute(STAGE, digest, lambda: _prepare(cfg, store, digest))


def _prepare(cfg: RunConfig, store: Store, digest: str) -> ArtifactRef:
    t0 = time.time()
    data = cfg.data
    if data.max_length > cfg.target.max_model_len:
        raise PrepareError(
            f"data.max_length ({data.max_length}) exceeds target.max_model_len ({cfg.target.max_model_len}): "
            "the target could not read the longest samples; lower data.max_length or raise target.max_model_len"
        )
    masker = make_masker(cfg)
    before = data_identity(data)
    loaded = load_sources(data.sources, seed=data.seed, keep_thinking=data.keep_thinking,
                          system_prompt=data.system_prompt, dedupe=data.dedupe,
                          keep_prompts=cfg.regenerate.enabled)
    if data_identity(data) != before:  # the rows read are not the content the address names
        raise PrepareError("a data source changed while prepare read it (a file still being written, an object "
                           "overwritten); run again once the data is complete")
    mixes = [_Mix(ld, src.weight) for ld, src in zip(loaded, data.sources)]
    build_samples(mixes, masker, data)

    everything = [s for m in mixes for s in m.samples]
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
    random.Random(data.seed).shuffle(everything)
    if len(everything) <= data.heldout:
        raise PrepareError(
            f"data.heldout ({data.heldout}) leaves no training samples out of {len(everything)}; "
            "lower data.heldout or add data"
        )
    heldout, train = everything[: data.heldout], everything[data.heldout:]
    if data.max_samples is not None:
        train = train[: data.max_samples]
    held_ids = {s.sample_id for s in heldout}
    train_ids = {s.sample_id for s in train}

    dropped: Counter = Counter()
    per_source: dict[str, Any] = {}
    for m in mixes:
        d = m.loaded.dropped + m.dropped
        dropped.update(d)
        entry = per_source.setdefault(m.loaded.label, {"rows": 0, "samples": 0, "heldout": 0, "unused": 0,
                                                       "truncated": 0, "dropped": {}})
        entry["rows"] += m.loaded.rows
        entry["samples"] += sum(1 for s in m.samples if s.sample_id in train_ids)
        entry["heldout"] += sum(1 for s in m.samples if s.sample_id in held_ids)
        entry["unused"] += m.left + sum(1 for s in m.samples if s.sample_id not in train_ids | held_ids)
        entry["truncated"] += m.truncated
        entry["dropped"] = dict(sorted((Counter(entry["dropped"]) + d).items()))

    stats: dict[str, Any] = {
        **token_stats(train),
        "dropped": dict(sorted(dropped.items())),
        "num_shards": data.num_shards,
        "heldout": len(heldout),
        "heldout_tokens": sum(s.tokens for s in heldout),
        "per_source": per_source,
        "truncated": sum(m.truncated for m in mixes),
        "max_length": data.max_length,
        "mask_mode": masker.mode if masker.generation_tags else "+".join(sorted(masker.modes)) or "offsets",
    }
    config = {"target": cfg.target.model_dump(mode="json"), "data": data.model_dump(mode="json")}
    with store.write(STAGE, digest, VERSIONS[STAGE], {}, config) as w:
        stats["shard_samples"] = write_split(w, train, heldout, data.num_shards)
        stats["seconds"] = round(time.time() - t0, 2)
        stats["samples_per_s"] = round((len(train) + len(heldout)) / max(stats["seconds"], 1e-9), 1)
        art = w.commit(stats)
    return art.ref()


# the stage as the flow runs it (tasks/store/stages.py)
STAGE_DEF = Stage(name=STAGE, inputs=(), address=prepare_address, run=run_prepare)
