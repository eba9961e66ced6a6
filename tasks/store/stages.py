"""What a stage is to the flow: one object per stage module, which flows/pipeline.py iterates.

A `Stage` runs as one task: `run(cfg, store, *inputs, digest=D)` finds or commits its artifact at
D = `address(cfg, store, *inputs)` in the store's `name` folder. A `ShardedStage` (regeneration, extraction)
runs as one task per shard and one for its own artifact: `plan(cfg, data)` lists its shards (each a
`ShardPlan` with the address its artifact is committed at in `shard_stage`), `shard(cfg, store, plan,
engine)` finds or commits one, and `assemble(cfg, store, data, shards, t0, reused, digest=D)` commits the
stage's artifact at D = `address(cfg, data, plans)` in `store_stage` from every shard's. Every stage, sharded
ones included, commits a stage artifact; the next stage takes that one ref.

The address is computed once per stage per run: the flow computes D (its task asks the store's manifest
there, flows/caching.py) and passes it in. Called without `digest` (a command, a test, a script), a stage
computes it with the very function its `address` is, so the flow and the stage cannot disagree.

`inputs` names what a stage takes, by the stage that made it (`data`: regenerate's artifact when
regeneration ran, else prepare's), in the order its `run` takes them. `locate(cfg, store, inputs)` is the one
question every caller asks a stage, sharded or not: (its digest, its shard plans); the flow and `resolve`
(tasks/store/resolve.py) ask it the same way.

What differs between stages is data on the stage object, never a branch in the flow: `variants` (the train
stage's heads, each its own task at its own address), `show` (what the Prefect UI and the run's record show of
its artifacts, as `Shown` data that one publisher in flows/ turns into artifacts), `context` (keywords of `run`
the flow fills: `on_metrics`, whose records `tick` turns into the progress bar and log lines; `flow_run_id`),
`check` (asked before the run's first sharded stage), `nodes` (a stage the flow runs over several nodes), and
a sharded stage's `show_shards` (what is shown of its shards).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Callable

from pydantic import BaseModel

from tasks.core.config import RunConfig
from tasks.core.stages import REGISTRY
from tasks.store.artifacts import ArtifactRef, Store


class ShardPlan(BaseModel):
    """One shard of a sharded stage: its index and the digest its artifact is committed at. A stage's own plan
    (tasks/data/regenerate.py `RegenerateShard`, tasks/extract/shards.py `ExtractShard`) adds what its shard
    needs; plans travel as flow task arguments (JSON), hence pydantic."""

    shard: int
    digest: str


@dataclass
class Shown:
    """What the flow shows of a stage's artifacts, as data (one publisher in flows/ turns it into Prefect
    artifacts and log lines): markdown and table artifacts, figures for the stage's line of the run's summary,
    fields of the run's record (the draft's `vllm serve` line, the benchmark's figures), log lines."""

    markdown: list[tuple[str, str, str]] = field(default_factory=list)  # (key, description, markdown)
    tables: list[tuple[str, str, list[dict[str, Any]]]] = field(default_factory=list)  # (key, description, rows)
    stats: dict[str, Any] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)


@dataclass
class Tick:
    """One progress record of a running stage as the flow shows it: the bar (percent, its line) and log lines."""

    percent: float | None = None
    message: str | None = None
    log: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def as_variants(made: Any) -> list[tuple[str, ArtifactRef]]:
    """A stage's artifacts as (label, artifact) per variant: what `combine` (tasks/store/resolve.py) made."""
    return [("", made)] if isinstance(made, ArtifactRef) else list(made)


def never_shown(cfg: RunConfig, store: Store, made: dict[str, Any]) -> Shown:
    return Shown()


def one_node(cfg: RunConfig) -> int:
    return 1


def always(cfg: RunConfig) -> bool:
    return True


def one_variant(cfg: RunConfig) -> list[tuple[str, RunConfig]]:
    """A stage with no variants: the run's config, unnamed."""
    return [("", cfg)]


@dataclass(frozen=True)
class Stage:
    """A stage the flow runs as one task."""

    name: str                            # the stage: its store folder and its task's name
    inputs: tuple[str, ...]              # the artifacts `run` takes after (cfg, store), by the stage that made them
    address: Callable[..., str]          # (cfg, store, *inputs) -> the digest `run` commits at
    run: Callable[..., ArtifactRef]      # (cfg, store, *inputs, digest=address(...)) -> the artifact, found
                                         # or committed (without digest: it computes it by `address`)
    enabled: Callable[[RunConfig], bool] = always
    # (label, config) per artifact the stage makes from the same inputs, each at its own address: the train
    # stage's heads (train.heads); one unnamed variant for every other stage
    variants: Callable[[RunConfig], list[tuple[str, RunConfig]]] = one_variant
    # what the flow shows once the stage is done, from the artifacts MADE so far (by stage name)
    show: Callable[[RunConfig, Store, dict[str, Any]], Shown] = never_shown
    # keywords of `run` the flow fills from the flow run: `on_progress` (records `tick` turns into the
    # progress bar and log lines), `flow_run_id`
    context: tuple[str, ...] = ()
    tick: Callable[[dict[str, Any]], Tick] | None = None
    # run before any sharded (long) stage before it, so a bad config fails before hours of work
    check: Callable[[RunConfig], None] | None = None
    nodes: Callable[[RunConfig], int] = one_node  # > 1: the flow runs it over nodes (flows/train_nodes.py)

    @property
    def store_stage(self) -> str:
        """Where the stage's artifact is committed: its name."""
        return self.name

    def locate(self, cfg: RunConfig, store: Store, inputs: list[Any]) -> tuple[str, list[Any]]:
        """(the digest this stage commits at from INPUTS, no shard plans): what every caller asks a stage."""
        return self.address(cfg, store, *inputs), []


@dataclass(frozen=True)
class ShardedStage:
    """A stage the flow runs as one task per shard, over engine groups and nodes, then one for its artifact."""

    name: str                            # the stage: its tasks' names (`NAME`, `NAME-shard-I`)
    inputs: tuple[str, ...]              # the one artifact its shards read (the data)
    store_stage: str                     # where the stage's artifact is committed
    shard_stage: str                     # where each shard's artifact is committed
    plan: Callable[[RunConfig, ArtifactRef], list[Any]]                  # (cfg, data) -> a ShardPlan per shard
    address: Callable[[RunConfig, ArtifactRef, list[Any]], str]          # (cfg, data, plans) -> the stage's digest
    shard: Callable[[RunConfig, Store, Any, Any], ArtifactRef]           # (cfg, store, plan, engine started)
    assemble: Callable[..., ArtifactRef]  # (cfg, store, data, shard refs, t0, reused, digest=address(...))
    copies_shards: bool                  # the stage's artifact holds its shards' data (then, once committed,
                                         # its shards are not needed); else it names shards that must stay
    label: str                           # in messages: "3 of 8 extraction shards failed"
    title: str                           # progress: "Extraction: 3/8 shards"
    tokens: str                          # the shard stat the stage sums and reports a rate of
    rate: str                            # that rate's unit
    enabled: Callable[[RunConfig], bool] = always
    variants: Callable[[RunConfig], list[tuple[str, RunConfig]]] = one_variant
    show: Callable[[RunConfig, Store, dict[str, Any]], Shown] = never_shown
    # what the flow shows of the shards once they are all done: (shard refs, errors) -> Shown
    show_shards: Callable[[list[ArtifactRef], list[str]], Shown] | None = None
    check: Callable[[RunConfig], None] | None = None

    def locate(self, cfg: RunConfig, store: Store, inputs: list[Any]) -> tuple[str, list[Any]]:
        """(the digest the stage's artifact commits at, the plan of each shard) from INPUTS (its data)."""
        plans = self.plan(cfg, inputs[0])
        return self.address(cfg, inputs[0], plans), plans


@cache
def stage_defs() -> tuple[Stage | ShardedStage, ...]:
    """Every registered stage's STAGE_DEF (tasks/core/stages.py's REGISTRY), in the order the flow runs them,
    each checked against its registry line (name, sharded or not, store folders). Imports the stage modules,
    torch with some of them: the flow's modules call it, the command line reads the registry instead."""
    out = []
    for e in REGISTRY:
        st = importlib.import_module(e.module).STAGE_DEF
        folders = (st.store_stage, st.shard_stage) if isinstance(st, ShardedStage) else (st.name,)
        if (st.name, folders) != (e.name, e.folders):
            raise RuntimeError(f"{e.module}.STAGE_DEF is stage {st.name!r} in {folders}, its registry line says "
                               f"{e.name!r} in {e.folders}: make tasks/core/stages.py's line and the module agree")
        out.append(st)
    return tuple(out)
