"""What a stage is, as the flow sees it: the one `ShardPlan` every sharded stage's shards derive from.

A shard plan names one shard of a stage's work and the address its artifact is committed at; a stage's
own plan (tasks/data/regenerate.py `RegenerateShard`, tasks/extract/shards.py `ExtractShard`) adds what its
shard needs to run. Plans travel as flow task arguments (JSON), so they are pydantic models.
"""

from __future__ import annotations

from pydantic import BaseModel


class ShardPlan(BaseModel):
    """One shard of a sharded stage: its index and the digest its artifact is committed at."""

    shard: int
    digest: str
