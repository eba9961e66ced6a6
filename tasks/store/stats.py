"""The manifest stats that travel between stages, typed (docs/ARTIFACTS.md).

A stage reads what an upstream artifact says about itself through these models, never from the raw
dict: a missing or mistyped value is an error that names the artifact and what to rerun, not a
silent default. Stats a stage only reports (timings, rates) stay free-form (`extra="allow"`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError

from tasks.core.errors import DraftlineError
from tasks.store.artifacts import ArtifactRef


class StatsError(DraftlineError, ValueError):
    """An artifact's manifest lacks a stat the next stage needs."""


class DataStats(BaseModel):
    """A prepare or regenerate artifact: its Parquet shards and held-out split."""

    model_config = ConfigDict(extra="allow")
    num_shards: int
    samples: int = 0
    tokens: int = 0
    heldout: int = 0
    heldout_tokens: int = 0


class ShardStats(BaseModel):
    """One extraction shard: which shard of the data it holds, and the hidden states' shape."""

    model_config = ConfigDict(extra="allow")
    shard: int
    samples: int = 0
    tokens: int = 0
    layer_ids: list[int] = []
    hidden_size: int | None = None


def _typed(model: type[BaseModel], ref: ArtifactRef, what: str, rerun: str):
    try:
        return model.model_validate(ref.stats)
    except ValidationError as exc:
        bad = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise StatsError(f"{ref.uri}: its manifest's stats are not those of {what} ({bad}); {rerun}") from None


def data_stats(ref: ArtifactRef) -> DataStats:
    return _typed(DataStats, ref, "a data artifact", "re-run the prepare stage (its manifest must list num_shards)")


def shard_stats(ref: ArtifactRef) -> ShardStats:
    return _typed(ShardStats, ref, "an extraction shard", "re-run extraction for it (finished shards are reused)")
