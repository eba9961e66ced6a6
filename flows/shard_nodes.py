"""A sharded stage's shards over several nodes (extract.nodes > 1): the shards not yet on the store are dealt
into slices, this node runs the first and each other slice is a child flow run (flows/nodes.py) that a worker
on any node of the pool picks up. The shared store, not Prefect, says what is done; a lost node leaves exactly
its unfinished shards for `draftline retry`. One mechanism for every sharded stage (regeneration, extraction):
`SHARDED` holds their stage objects (tasks/store/stages.py), which say where each stage's shards are committed,
how they are counted and what is shown of them.
"""

from __future__ import annotations

from typing import Callable

from prefect.runtime import flow_run

from flows.flow_runs import child_stage
from flows.nodes import child_config, running_children, start_children, wait_children
from flows.report_artifacts import Progress, show
from flows.run_record import RunRecord, StageRecord, finish_stage
from tasks.core.config import RunConfig
from tasks.store.artifacts import ArtifactRef, Store
from tasks.store.stages import ShardedStage, stage_defs

# the sharded stages by name (tasks/store/stages.py ShardedStage: where shards are committed, how they are counted)
SHARDED = {st.name: st for st in stage_defs() if isinstance(st, ShardedStage)}


def finish_sharded(stage: str, record: StageRecord, store: Store, plans: list, refs: list[ArtifactRef],
                   errors: list[str], t0: float, logger, *, executed: int | None = None,
                   nodes: int | None = None) -> list[ArtifactRef]:
    """The end of a sharded stage, on one node or several: REFS (the shards there are) sorted, the record's
    counts, status, figures and error; raises naming the shards not finished, which `draftline retry` runs."""
    kind = SHARDED[stage]
    refs.sort(key=lambda x: int(x.stats.get("shard", 0)))
    done = {int(x.stats.get("shard", 0)) for x in refs}
    lost = sorted(p.shard for p in plans if p.shard not in done)
    finish_stage(record, t0, refs, failed=len(lost), executed=executed)
    try:  # what a listing of the shards' folder reads in one GET (`draftline ls`, `check`, the next run's start)
        store.write_index(kind.shard_stage, [x.digest for x in refs])
    except Exception as exc:  # only a listing's speed depends on it: never the stage
        logger.warning(f"{stage}: the index of its shards' manifests was not written ({exc}); listings read "
                       "each manifest instead")
    record.artifact = f"{store.uri}/{kind.shard_stage}/"
    record.stats = {"shards": len(plans), kind.tokens: sum(int(x.stats.get(kind.tokens, 0)) for x in refs)}
    if kind.show_shards is not None:
        show(kind.show_shards(refs, errors), record, logger)
    where = ""
    if nodes is not None:
        record.stats["nodes"] = nodes
        where = f" (on {nodes} nodes)"
    if lost:
        record.error = errors[0] if errors else f"shards {lost} are not on {store.uri}"
        logger.error(f"{stage}: {len(lost)} of {len(plans)} shards not finished ({lost}); " + "; ".join(errors))
        raise RuntimeError(f"{len(lost)} of {len(plans)} {kind.label} shards not finished ({lost}): "
                           f"{record.error}; `draftline retry` this run: it runs only those, on any node")
    logger.info(f"{stage}: {record.executed} shards ran{where}, {record.cached} cached, in {record.seconds}s")
    return refs


def slice_shards(missing: list[int], nodes: int) -> list[list[int]]:
    """Missing shards dealt round-robin into at most NODES slices (none empty)."""
    k = min(nodes, len(missing))
    return [missing[i::k] for i in range(k)]


def run_nodes(stage: str, cfg: RunConfig, store: Store, rec: RunRecord, data: ArtifactRef, plans: list, logger,
              t0: float, run_here: Callable[[list, Progress], tuple[list[ArtifactRef], list[str]]],
              ) -> list[ArtifactRef]:
    """extract.nodes > 1: STAGE's (regenerate or extract) shards not yet on the store are dealt into
    slices; this node runs the first slice, a child flow run of `child_deployment` each other one
    (Prefect's run_deployment: a worker of that deployment's pool picks it up, on any node). The store,
    not Prefect, says what is done: the children's shards are read back from it, and a child that
    crashed (its node lost: the heartbeat automation of `draftline deploy` marks it Crashed) leaves
    exactly its unfinished shards missing, which `draftline retry` runs again on any node.
    `run_here(plans, progress)` runs shards on this node (the flow's shard tasks over its engine groups)."""
    kind = SHARDED[stage]
    r = rec.stages[stage]
    by_shard = {p.shard: p for p in plans}
    on_store = store.find_many(kind.shard_stage, [p.digest for p in plans])  # at once: a hero stage has 512
    cached = [p.shard for p in plans if on_store[p.digest] is not None]
    missing = [p.shard for p in plans if p.shard not in set(cached)]
    # A retry whose earlier attempt's children still run (its own node died, theirs did not): wait for
    # them instead of running their shards a second time.
    children = [(run, shards) for run, shards in running_children(flow_run.id)
                if child_stage(run) == stage and set(shards) & set(missing)]
    for run, shards in children:
        logger.info(f"{stage}: child {run.name} of an earlier attempt still runs shards {shards}: waiting for it")
    adopted = {s for _, shards in children for s in shards}
    slices = slice_shards([s for s in missing if s not in adopted], max(1, cfg.extract.nodes - len(children)))
    own = slices[0] if slices else []
    if len(slices) > 1:
        children += start_children(stage, cfg, store, child_config(rec), slices, logger,
                                   {"data_stage": data.stage, "data_digest": data.digest})
    logger.info(f"{stage}: {len(plans)} shards, {len(cached)} on the store; this node runs {own}, "
                f"{len(children)} child run(s) the rest")
    progress = Progress(f"{stage}-progress", f"{kind.title}: 0/{len(plans)} shards")
    # The cached shards go through Prefect too (Cached task runs), so the run's page lists every shard.
    mine = [by_shard[s] for s in sorted(cached + own)]
    refs, errors = run_here(mine, progress)

    def take_back(shards: list[int]) -> None:
        more, errs = run_here([by_shard[s] for s in shards], progress)
        refs.extend(more)
        errors.extend(errs)

    errors += wait_children(children, store, by_shard, logger, take_back, stage=stage, shard_stage=kind.shard_stage)
    after = store.find_many(kind.shard_stage, [by_shard[s].digest for s in missing])
    found = {s: after[by_shard[s].digest] for s in missing}
    have = {int(x.stats.get("shard", 0)) for x in refs}
    refs += [a.ref() for s, a in found.items() if a is not None and s not in have]
    return finish_sharded(stage, r, store, plans, refs, errors, t0, logger,
                          executed=sum(1 for a in found.values() if a is not None), nodes=1 + len(children))
