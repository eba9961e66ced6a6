"""What a config produces: the address of every stage it runs (and of each of a stage's variants, the train
stage's heads), and what the store holds there.

    found = resolve(cfg, store)              # every stage, in the order the flow runs them
    found.ref("vocab")                       # its committed artifact, or None
    found.of("train", "dflash").digest       # one head's train address

A stage's address is made of its inputs' artifacts (tasks/address/digests.py), so it is known only once
those are committed: resolution walks the stages in the registry's order (tasks/core/stages.py), asks each
stage's `locate` (tasks/store/stages.py) from the artifacts found so far, and stops at the first stage not on
the store (`missing`), or after UNTIL. The flow takes the same steps as it runs (`locate`, `combine`), the
commands (`draftline export`, `check`, `plan --from-store`) and a run's child nodes read a resolution. No
torch and no Prefect: the stage modules import them where they compute, never at their top.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tasks.core.config import RunConfig
from tasks.core.stages import stage_names
from tasks.store.artifacts import Artifact, ArtifactRef, Store
from tasks.store.stages import ShardedStage, Stage, stage_defs

DATA = "data"  # the input name of what the data stages made: regenerate's artifact when it ran, else prepare's


@dataclass
class Address:
    """One artifact a config produces: where it is committed and, when it is, the artifact."""

    stage: str                        # the stage (the registry's name)
    folder: str                       # the store folder it is committed in
    digest: str
    variant: str = ""                 # a variant's label (one head of several); "" for a stage's only one
    artifact: Artifact | None = None  # committed there (verified), else None
    plans: list[Any] = field(default_factory=list)  # a sharded stage's shards (each with its own digest)
    shards: dict[int, Artifact] = field(default_factory=dict)  # the shards committed, when the stage is not

    @property
    def ref(self) -> ArtifactRef | None:
        return self.artifact.ref() if self.artifact is not None else None


@dataclass
class Resolution:
    """Each resolved stage's addresses (one per variant), in the order the flow runs the stages."""

    addresses: dict[str, list[Address]] = field(default_factory=dict)
    missing: str | None = None     # the first stage not (wholly) on the store: later ones have no address yet
    skipped: list[str] = field(default_factory=list)  # stages the config switches off

    def of(self, stage: str, variant: str | None = None) -> Address | None:
        """STAGE's address (VARIANT's, default the first); None for a stage not resolved."""
        for a in self.addresses.get(stage, []):
            if variant is None or a.variant == variant:
                return a
        return None

    def ref(self, stage: str, variant: str | None = None) -> ArtifactRef | None:
        """STAGE's committed artifact (DATA: the data stages'), or None."""
        if stage == DATA:
            return self.ref("regenerate") if "regenerate" in self.addresses else self.ref("prepare")
        a = self.of(stage, variant)
        return a.ref if a is not None else None


def combine(made: list[tuple[str, ArtifactRef]]) -> ArtifactRef | list[tuple[str, ArtifactRef]]:
    """A stage's artifacts as the next stage takes them: the one artifact, or (label, artifact) per variant."""
    return made[0][1] if len(made) == 1 else made


def inputs_of(st: Stage | ShardedStage, made: dict[str, Any]) -> list[Any] | None:
    """ST's inputs from the artifacts MADE (by stage name; DATA: regenerate's, else prepare's); None when one is
    not made."""
    got = {**made, DATA: made.get("regenerate") or made.get("prepare")}
    inputs = [got.get(name) for name in st.inputs]
    return None if any(x is None for x in inputs) else inputs


def resolve(cfg: RunConfig, store: Store, until: str | None = None, sizes: bool = True) -> Resolution:
    """Every stage's address for CFG on STORE, from the first stage up to UNTIL (default: every stage), as far
    as the store holds the artifacts an address is made of. Reads manifests (and, with SIZES, checks each found
    artifact's files by size; `plan --from-store` reads only the manifests' stats: a hero's prepare has 512
    files); computes nothing."""
    if until is not None and until not in stage_names():
        raise ValueError(f"until={until!r}: the stages are {', '.join(stage_names())}")
    out = Resolution()
    made: dict[str, Any] = {}
    for st in stage_defs():
        if not st.enabled(cfg):
            out.skipped.append(st.name)
        else:
            inputs = inputs_of(st, made)
            if inputs is None:
                out.missing = out.missing or st.name
                break
            addresses = [_address(st, vcfg, store, inputs, label, sizes) for label, vcfg in st.variants(cfg)]
            out.addresses[st.name] = addresses
            if all(a.artifact is not None for a in addresses):
                made[st.name] = combine([(a.variant, a.ref) for a in addresses])
            else:
                out.missing = st.name
                break
        if st.name == until:
            break
    return out


def _address(st: Stage | ShardedStage, cfg: RunConfig, store: Store, inputs: list[Any], label: str,
             sizes: bool = True) -> Address:
    digest, plans = st.locate(cfg, store, inputs)
    find = store.find_many if sizes else store.described
    a = Address(st.name, st.store_stage, digest, label, find(st.store_stage, [digest])[digest], plans)
    if isinstance(st, ShardedStage) and a.artifact is None and plans:  # the shards committed so far, read at once
        found = find(st.shard_stage, [p.digest for p in plans])
        a.shards = {p.shard: found[p.digest] for p in plans if found[p.digest] is not None}
    return a
