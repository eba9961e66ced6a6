"""Planning the extract stage: one `ExtractShard` plan (and the digest its artifact lives under) per data shard.

Apart from the stage so that what only needs the addresses (`draftline export`, the flow's fan-out) reads
them without the engine and part-writing machinery.
"""

from __future__ import annotations

from typing import Any, Callable

from pydantic import Field

from tasks.core.errors import DraftlineError
from tasks.address import digests
from tasks.core.config import RunConfig
from tasks.store.stats import StatsError, data_stats
from tasks.engine.target import resolve_layer_ids, text_config, validate_for_vllm
from tasks.store.artifacts import ArtifactRef, Store
from tasks.store.stages import ShardPlan

STAGE = "extract"
# the stage's own artifact: a manifest naming every shard (tasks/extract/stage.py assemble_extract)
STAGE_ARTIFACT = digests.EXTRACT_STAGE
DATA_STAGES = ("prepare", "regenerate")

ProgressCallback = Callable[[int, int], None]  # (tokens done, tokens in the shard)


class ExtractError(DraftlineError, RuntimeError):
    """Extraction cannot proceed; the message names the problem and the fix."""


class ExtractShard(ShardPlan):
    """Everything one shard's extraction needs, and the digest its artifact lives under."""

    data_stage: str
    data_digest: str
    data_file: str
    layer_ids: list[int]
    hidden_size: int
    num_layers: int
    config: dict[str, Any] = Field(default_factory=dict, description="the extract section that made the digest")

    @property
    def inputs(self) -> dict[str, str]:
        return {"data": self.data_digest, "shard": str(self.shard)}


def plan_extract(cfg: RunConfig, data_ref: ArtifactRef, hf_config: Any) -> list[ExtractShard]:
    if data_ref.stage not in DATA_STAGES:
        raise ExtractError(f"extract reads a prepare or regenerate artifact, got stage {data_ref.stage!r}")
    try:
        num_shards = data_stats(data_ref).num_shards
    except StatsError as exc:
        raise ExtractError(str(exc)) from None
    if num_shards < 1:
        raise ExtractError(f"{data_ref.uri}: its stats list {num_shards} shards; re-run the prepare stage")
    text = text_config(hf_config)
    layer_ids = resolve_layer_ids(cfg, hf_config)
    if cfg.extract.backend == "vllm":  # refuse what vLLM would refuse (or misread) before any engine loads
        validate_for_vllm(hf_config, layer_ids, cfg.target.model)
    section = digests.extract_section(cfg, layer_ids)
    plans = []
    for i in range(num_shards):
        digest = digests.extract_shard(cfg, layer_ids, data_ref.digest, i)
        plans.append(ExtractShard(shard=i, digest=digest, data_stage=data_ref.stage, data_digest=data_ref.digest,
                               data_file=f"shard-{i:05d}.parquet", layer_ids=layer_ids,
                               hidden_size=int(text.hidden_size), num_layers=int(text.num_hidden_layers),
                               config=section))
    return plans


def extract_shards(store: Store, extracted: ArtifactRef) -> list[ArtifactRef]:
    """The shard artifacts the extract stage's artifact EXTRACTED names, in shard order (what training reads)."""
    if extracted.stage != STAGE_ARTIFACT:
        raise ExtractError(f"{extracted.uri} is a {extracted.stage!r} artifact, not the extract stage's "
                           f"({STAGE_ARTIFACT}/DIGEST, naming its shards)")
    manifest = store.manifest(STAGE_ARTIFACT, extracted.digest)
    if manifest is None:
        raise ExtractError(f"the extract stage's artifact {extracted.uri} is not committed on {store.uri}; "
                           "re-run the extract stage (completed shards are reused)")
    # the stage artifact's address IS the digest of its shards' addresses (digests.extract_stage): a manifest whose
    # list is not that list (a store writer's edit) would redirect training to other shards, and is refused
    listed = {k: v for k, v in manifest.inputs.items() if k.startswith("shard-")}
    names = [f"shard-{i}" for i in range(len(listed))]
    if set(listed) != set(names) or digests.extract_stage([listed[n] for n in names]) != extracted.digest:
        raise ExtractError(f"the extract stage's artifact {extracted.uri} names shards whose addresses are not the "
                           "ones its address is made of (its manifest was written by something other than "
                           "draftline); nothing was trained from it: delete its manifest.json and re-run the "
                           "extract stage (completed shards are reused)")
    refs = []
    for name in names:
        art = store.find(STAGE, manifest.inputs[name])
        if art is None:
            raise ExtractError(f"extraction shard {store.uri_of(STAGE, manifest.inputs[name])} (named by "
                               f"{extracted.uri}) is not committed on {store.uri}; re-run the extract stage for it "
                               "(completed shards are reused)")
        refs.append(art.ref())
    return refs
