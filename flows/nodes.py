"""A run's child flow runs on other nodes: the deployment they go to (`child_deployment`), the run's config
they get (`child_config`), starting them (`start_children`: the slice flow, flows/pipeline.py `extract_slice`,
with a `stage` parameter, which a worker on any node of the pool picks up), and waiting for them
(`wait_children`, `wait_claimed`): a child no node takes within TAKE_BACK_AFTER (DRAFTLINE_TAKE_BACK_S) is
cancelled, and its work is taken back. Two users: a sharded stage's shards dealt over nodes
(flows/shard_nodes.py) and training over nodes (flows/train_nodes.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.runtime import deployment, flow_run
from prefect.states import Cancelled

from flows.flow_runs import EXTRACT_FLOW, config_parameters, slice_deployment
from flows.run_record import RunRecord
from tasks.core import stopping
from tasks.core.config import RunConfig
from tasks.store.artifacts import Store


def child_deployment(cfg: RunConfig) -> str:
    """The deployment that this run's slices go to (flows/flow_runs.py slice_deployment)."""
    name = slice_deployment(cfg, deployment.name)
    if not name:
        raise RuntimeError(
            f"extract.nodes={cfg.extract.nodes} (train.nodes={cfg.train.nodes}) sends slices of the regeneration "
            "and extraction shards (training's other nodes) to other nodes through a deployment, "
            "and this run is not a deployment run: set extract.deployment (e.g. --set "
            f"extract.deployment={EXTRACT_FLOW}/local, registered by `draftline deploy --name local`), "
            "submit the run to a pool (`draftline submit ... --deployment b300`), or set extract.nodes=1 "
            "(train.nodes=1)")
    return name


def start_children(stage: str, cfg: RunConfig, store: Store, config: dict[str, Any], slices: list[list[int]],
                   logger, params: dict[str, Any]) -> list[tuple[Any, list[int]]]:
    """A child flow run of `child_deployment` for each slice but the first (this node's): the run's CONFIG
    (`child_config`), its store, PARAMS and the slice's shards; named <run>-<stage>-<i>of<n>-try<attempt>."""

    target = child_deployment(cfg)
    if store.is_local:
        logger.warning(f"{stage}: {store.uri} is a local folder: nodes on other machines cannot use it; "
                       "use a shared s3:// store with extract.nodes or train.nodes > 1")
    attempt = flow_run.run_count or 1
    base = {"config_path": config.get("config_path"), "overrides": list(config.get("overrides") or [])}
    # the children write where this run writes, whatever their node's DRAFTLINE_STORE_URI says
    base["overrides"].append(f"store.uri={store.uri}")
    base.update(params)
    if stage != "extract":  # extraction's children go without it, as to slice deployments registered before
        base["stage"] = stage
    children = []
    for i, part in enumerate(slices[1:], start=1):
        child = start_child(target, run_deployment, parameters={**base, "shards": part}, timeout=0,
                            flow_run_name=f"{flow_run.name or 'draftline'}-{stage}-{i}of{len(slices)}-try{attempt}",
                            tags=["draftline", f"draftline-parent:{flow_run.id}"])
        children.append((child, part))
        logger.info(f"{stage}: " + (f"shards {part} -> " if part else "") +
                    f"child flow run {child.name} ({child.id}) of {target}")
    return children


def child_config(rec: RunRecord) -> dict[str, Any]:
    """This run's config for its children, as `draftline submit` sends one: a file inside the code folder
    travels as its path (every node has it), any other file as its content (overrides)."""
    if not rec.config_path:
        return {"config_path": None, "overrides": list(rec.overrides)}
    params, _ = config_parameters(Path(rec.config_path), list(rec.overrides), None)
    return params


def start_child(target: str, run_deployment: Callable, **kwargs: Any) -> Any:
    try:
        return run_deployment(target, **kwargs)
    except ObjectNotFound:
        raise RuntimeError(f"extract.nodes (train.nodes) sends work to the deployment {target}, which is not "
                           f"registered: `draftline deploy --name {target.split('/', 1)[1]}` registers it (or set "
                           "extract.deployment to one that exists)") from None


def running_children(parent_id: Any) -> list[tuple[Any, list[int]]]:
    """Child runs of this flow run (any attempt, any stage) not yet in a final state, with their shards."""

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
TAKE_BACK_ENV = "DRAFTLINE_TAKE_BACK_S"  # seconds, instead of TAKE_BACK_AFTER (read by the run's node)


def take_back_after() -> float:
    """How long a child run may wait for a node before its parent takes its work back (DRAFTLINE_TAKE_BACK_S,
    default TAKE_BACK_AFTER): long enough for a free node's worker to poll the pool a few times."""
    raw = os.environ.get(TAKE_BACK_ENV, "").strip()
    try:
        value = float(raw) if raw else TAKE_BACK_AFTER
    except ValueError:
        raise ValueError(f"{TAKE_BACK_ENV}={raw!r}: give seconds, e.g. {TAKE_BACK_ENV}=30") from None
    if value <= 0:
        raise ValueError(f"{TAKE_BACK_ENV}={raw!r}: give a positive number of seconds "
                         f"(default {TAKE_BACK_AFTER:.0f})")
    return value


def wait_children(children: list[tuple[Any, list[int]]], store: Store, by_shard: dict[int, Any],
                  logger, take_back: Callable[[list[int]], None] | None = None, poll: float = 5.0,
                  stage: str = "extract", shard_stage: str | None = None) -> list[str]:
    """Wait for the child runs (of STAGE) to end (Completed, Failed, Crashed, Cancelled); the errors of
    those whose shards are not all on the store. A child still Scheduled TAKE_BACK_AFTER seconds after
    this node went idle is cancelled, and `take_back` runs its shards here (a pool short of nodes never
    hangs)."""
    take_back_s = take_back_after()
    errors: list[str] = []
    pending = {c.id: (c, shards) for c, shards in children}
    last_note = idle_since = time.time()
    with get_client(sync_client=True) as client:
        while pending:
            for cid in list(pending):
                child, shards = pending[cid]
                run = client.read_flow_run(cid)
                if (take_back is not None and time.time() - idle_since > take_back_s
                        and cancel_unclaimed(client, run, "its parent ran its shards")):
                    del pending[cid]
                    logger.info(f"{stage}: no node took child {run.name} within {take_back_s:.0f} s: "
                                f"cancelled it, running its shards {shards} here")
                    take_back(shards)
                    idle_since = time.time()
                    continue
                if run.state is None or not run.state.is_final():
                    continue
                del pending[cid]
                there = store.find_many(shard_stage, [by_shard[s].digest for s in shards]) if shards else {}
                lost = [s for s in shards if there[by_shard[s].digest] is None]
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
            stopping.wait(poll, f"waiting for the {stage} child runs")
    return errors


def cancel_unclaimed(client: Any, run: Any, why: str) -> bool:
    """Cancel child RUN if no node has taken it yet (still Scheduled); True when it was."""
    if run.state is None or run.state.type.value != "SCHEDULED":
        return False
    res = client.set_flow_run_state(run.id, Cancelled(
        message=f"no node took it within {take_back_after():.0f} s; {why}"))
    return getattr(res.status, "value", str(res.status)) == "ACCEPT"


def wait_claimed(children: list[tuple[Any, list[int]]], logger, stage: str, why: str,
                 within: float | None = None, poll: float = 1.0) -> list[Any]:
    """The child runs that a node took (Pending or Running) within WITHIN seconds (TAKE_BACK_AFTER); the
    others are cancelled (a pool short of nodes never hangs)."""
    within = take_back_after() if within is None else within
    claimed: list[Any] = []
    pending = {c.id: c for c, _ in children}
    t0 = time.time()
    with get_client(sync_client=True) as client:
        while pending:
            for cid in list(pending):
                run = client.read_flow_run(cid)
                kind = run.state.type.value if run.state is not None else "SCHEDULED"
                if kind in ("PENDING", "RUNNING"):
                    claimed.append(pending.pop(cid))
                elif kind != "SCHEDULED":  # ended before it ran (cancelled by someone, crashed at start)
                    logger.warning(f"{stage}: child {run.name} ended {run.state.name} before it ran")
                    del pending[cid]
                elif time.time() - t0 > within and cancel_unclaimed(client, run, why):
                    logger.info(f"{stage}: no node took child {run.name} within {within:.0f} s: cancelled it")
                    del pending[cid]
            if pending:
                stopping.wait(poll, f"waiting for nodes to take the {stage} child runs")
            else:
                stopping.check(f"waiting for nodes to take the {stage} child runs")
    return claimed


