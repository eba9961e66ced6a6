"""One run's regeneration and extraction over several nodes (extract.nodes > 1): a stage's shards not
yet on the store are dealt into slices, this node runs the first and each other slice is a child flow
run of the `draftline-extract` deployment (the slice flow, flows/pipeline.py `extract_slice`, with a
`stage` parameter) that a worker on any node of the pool picks up. The shared store, not Prefect, says
what is done; a lost node leaves exactly its unfinished shards for `draftline retry`. One mechanism for
both stages: `SHARDED` says where each stage's shards are committed and how they are counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from flows.prefect_api import EXTRACT_FLOW, child_stage, config_parameters, slice_deployment
from flows.report_artifacts import Progress
from flows.run_record import RunRecord
from tasks.core import stopping
from tasks.core.config import RunConfig
from tasks.store.artifacts import ArtifactRef, Store


@dataclass(frozen=True)
class ShardedStage:
    """A stage that runs as one task per shard, over engine groups and nodes."""

    store_stage: str  # where each shard is committed (the store's stage folder)
    label: str        # in messages: "3 of 8 extraction shards failed"
    title: str        # progress artifacts: "Extraction: 3/8 shards"
    tokens: str       # the shard stat the stage sums and reports a rate of
    rate: str         # that rate's unit


SHARDED = {
    "regenerate": ShardedStage("regenerate-shard", "regeneration", "Regeneration", "generated_tokens",
                               "generated tok/s"),
    "extract": ShardedStage("extract", "extraction", "Extraction", "tokens", "tok/s"),
}


def child_deployment(cfg: RunConfig) -> str:
    """The deployment that this run's slices go to (flows/prefect_api.py slice_deployment)."""
    from prefect.runtime import deployment

    name = slice_deployment(cfg, deployment.name)
    if not name:
        raise RuntimeError(
            f"extract.nodes={cfg.extract.nodes} sends slices of the regeneration and extraction shards to other "
            "nodes through a deployment, "
            "and this run is not a deployment run: set extract.deployment (e.g. --set "
            f"extract.deployment={EXTRACT_FLOW}/local, registered by `draftline deploy --name local`), "
            "submit the run to a pool (`draftline submit ... --deployment b300`), or set extract.nodes=1")
    return name


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
    from prefect.deployments import run_deployment
    from prefect.runtime import flow_run

    kind = SHARDED[stage]
    r = rec.stages[stage]
    by_shard = {p.shard: p for p in plans}
    cached = [p.shard for p in plans if store.find(kind.store_stage, p.digest) is not None]
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
        target = child_deployment(cfg)
        if store.is_local:
            logger.warning(f"{stage}: {store.uri} is a local folder: slices on other machines cannot write to it; "
                           "use a shared s3:// store with extract.nodes > 1")
        attempt = flow_run.run_count or 1
        params = child_config(rec)
        # the children write where this run writes, whatever their node's DRAFTLINE_STORE_URI says
        params["overrides"].append(f"store.uri={store.uri}")
        params.update(data_stage=data.stage, data_digest=data.digest)
        if stage != "extract":  # extraction's children go without it, as to slice deployments registered before
            params["stage"] = stage
        for i, part in enumerate(slices[1:], start=1):
            child = start_child(target, run_deployment, parameters={**params, "shards": part}, timeout=0,
                                flow_run_name=f"{flow_run.name or 'draftline'}-{stage}-{i}of{len(slices)}-try{attempt}",
                                tags=["draftline", f"draftline-parent:{flow_run.id}"])
            children.append((child, part))
            logger.info(f"{stage}: shards {part} -> child flow run {child.name} ({child.id}) of {target}")
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

    errors += wait_children(children, store, by_shard, logger, take_back, stage=stage)
    found = {s: store.find(kind.store_stage, by_shard[s].digest) for s in missing}
    have = {int(x.stats.get("shard", 0)) for x in refs}
    refs += [a.ref() for s, a in found.items() if a is not None and s not in have]
    refs.sort(key=lambda x: int(x.stats.get("shard", 0)))
    r.executed = sum(1 for a in found.values() if a is not None)
    r.cached = len(cached)
    r.failed = len(plans) - len(refs)
    r.seconds = round(time.time() - t0, 1)
    r.status = ("failed" if not refs else "partial") if r.failed else ("ran" if r.executed else "cached")
    r.artifact = f"{store.uri}/{kind.store_stage}/"
    r.stats = {"shards": len(plans), kind.tokens: sum(int(x.stats.get(kind.tokens, 0)) for x in refs),
               "nodes": 1 + len(children)}
    if r.failed:
        lost = sorted(s for s, a in found.items() if a is None)
        r.error = errors[0] if errors else f"shards {lost} are not on {store.uri}"
        logger.error(f"{stage}: {r.failed} of {len(plans)} shards not finished ({lost}); " + "; ".join(errors))
        raise RuntimeError(f"{r.failed} of {len(plans)} {kind.label} shards not finished ({lost}): {r.error}; "
                           f"`draftline retry` this run: it runs only those, on any node")
    logger.info(f"{stage}: {r.executed} shards ran (on {1 + len(children)} nodes), {r.cached} cached, in {r.seconds}s")
    return refs


def child_config(rec: RunRecord) -> dict[str, Any]:
    """This run's config for its children, as `draftline submit` sends one: a file inside the code folder
    travels as its path (every node has it), any other file as its content (overrides)."""
    if not rec.config_path:
        return {"config_path": None, "overrides": list(rec.overrides)}
    params, _ = config_parameters(Path(rec.config_path), list(rec.overrides), None)
    return params


def start_child(target: str, run_deployment: Callable, **kwargs: Any) -> Any:
    from prefect.exceptions import ObjectNotFound

    try:
        return run_deployment(target, **kwargs)
    except ObjectNotFound:
        raise RuntimeError(f"extract.nodes sends slices of the shards to the deployment {target}, which is not "
                           f"registered: `draftline deploy --name {target.split('/', 1)[1]}` registers it (or set "
                           "extract.deployment to one that exists)") from None


def running_children(parent_id: Any) -> list[tuple[Any, list[int]]]:
    """Child runs of this flow run (any attempt, any stage) not yet in a final state, with their shards."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )

    if parent_id is None:
        return []
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])), limit=200)
    return [(run, list((run.parameters or {}).get("shards") or [])) for run in runs
            if run.state is not None and not run.state.is_final()]


# A child that no node has taken this long after the parent ran out of work of its own (every node
# busy, or fewer nodes than extract.nodes): the parent cancels it and runs its shards itself.
TAKE_BACK_AFTER = 30.0


def wait_children(children: list[tuple[Any, list[int]]], store: Store, by_shard: dict[int, Any],
                  logger, take_back: Callable[[list[int]], None] | None = None, poll: float = 5.0,
                  stage: str = "extract") -> list[str]:
    """Wait for the child runs (of STAGE) to end (Completed, Failed, Crashed, Cancelled); the errors of
    those whose shards are not all on the store. A child still Scheduled TAKE_BACK_AFTER seconds after
    this node went idle is cancelled, and `take_back` runs its shards here (a pool short of nodes never
    hangs)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    store_stage = SHARDED[stage].store_stage
    errors: list[str] = []
    pending = {c.id: (c, shards) for c, shards in children}
    last_note = idle_since = time.time()
    with get_client(sync_client=True) as client:
        while pending:
            for cid in list(pending):
                child, shards = pending[cid]
                run = client.read_flow_run(cid)
                if (take_back is not None and run.state is not None and run.state.type.value == "SCHEDULED"
                        and time.time() - idle_since > TAKE_BACK_AFTER):
                    res = client.set_flow_run_state(cid, Cancelled(
                        message=f"no node took it within {TAKE_BACK_AFTER:.0f} s; its parent ran its shards"))
                    if getattr(res.status, "value", str(res.status)) == "ACCEPT":
                        del pending[cid]
                        logger.info(f"{stage}: no node took child {run.name} within {TAKE_BACK_AFTER:.0f} s: "
                                    f"cancelled it, running its shards {shards} here")
                        take_back(shards)
                        idle_since = time.time()
                        continue
                if run.state is None or not run.state.is_final():
                    continue
                del pending[cid]
                lost = [s for s in shards if store.find(store_stage, by_shard[s].digest) is None]
                state = run.state.name
                if lost and run.state.is_completed():
                    errors.append(f"child {run.name} completed but shards {lost} are not on {store.uri}: its node "
                                  "writes to another store; give every node the same s3:// store")
                elif lost:
                    why = (run.state.message or "").strip()[:300]
                    errors.append(f"child {run.name} ({run.id}) ended {state}" + (f" ({why})" if why else "")
                                  + f" with shards {lost} unfinished")
                logger.info(f"{stage}: child {run.name} {state}; shards {shards}: "
                            f"{len(shards) - len(lost)} on the store, {len(lost)} missing")
            if not pending:
                break
            if time.time() - last_note > 300:
                last_note = time.time()
                logger.info(f"{stage}: waiting for child runs " + ", ".join(
                    f"{c.name} ({client.read_flow_run(c.id).state.name})" for c, _ in pending.values()))
            deadline = time.time() + poll
            while time.time() < deadline:
                stopping.check(f"waiting for the {SHARDED[stage].label} child runs")
                time.sleep(0.5)
    return errors
