"""One run's regeneration and extraction over several nodes (extract.nodes > 1): a stage's shards not
yet on the store are dealt into slices, this node runs the first and each other slice is a child flow
run of the `draftline-extract` deployment (the slice flow, flows/pipeline.py `extract_slice`, with a
`stage` parameter) that a worker on any node of the pool picks up. The shared store, not Prefect, says
what is done; a lost node leaves exactly its unfinished shards for `draftline retry`. One mechanism for
both stages: `SHARDED` holds their stage objects (tasks/store/stages.py), which say where each stage's shards
are committed and how they are counted.

Training over several nodes (train.nodes > 1, `train_nodes`) starts its other nodes the same way
(`start_children`, the slice flow with stage=train, `train_child` there): one c10d rendezvous hosted by
the run's node, a control store there for the node count and the nodes' heartbeats, which name a node
lost mid-training. A child no node takes within TAKE_BACK_AFTER (DRAFTLINE_TAKE_BACK_S) is cancelled: the
run trains on the nodes there are.
"""

from __future__ import annotations

# The train stage's modules are imported where used: they import torch, which is heavy (seconds), and a run
# that never trains over several nodes never needs them.

import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.runtime import deployment, flow_run
from prefect.states import Cancelled

from flows.flow_runs import EXTRACT_FLOW, child_stage, config_parameters, slice_deployment, submitting_worker
from flows.report_artifacts import Progress
from flows.run_record import RunRecord, StageRecord, finish_stage
from tasks.address import digests
from tasks.core import stopping
from tasks.core.config import RunConfig
from tasks.extract.verify import markdown, summarize, summary_line
from tasks.store.artifacts import ArtifactRef, Store
from tasks.store.stages import ShardedStage, stage_defs
from tasks.train import TrainError


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
    record.artifact = f"{store.uri}/{kind.shard_stage}/"
    record.stats = {"shards": len(plans), kind.tokens: sum(int(x.stats.get(kind.tokens, 0)) for x in refs)}
    if stage == "extract":
        _publish_check(record, refs, errors, logger)
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


def _publish_check(record: StageRecord, refs: list[ArtifactRef], errors: list[str], logger) -> None:
    """The extraction check's figures (tasks/extract/verify.py) in the run's summary and, as a markdown
    artifact, in the Prefect UI, the refused shards' causes included."""
    verified = summarize([r.stats for r in refs])
    if verified is not None:
        record.stats["verified"] = verified
        logger.info(f"extract: {summary_line(verified)}")
    try:
        create_markdown_artifact(markdown([r.stats for r in refs], errors), key="extraction-check",
                                 description="Stored hidden states against the engine's next token")
    except Exception as exc:  # noqa: BLE001 - the UI's view only; the figures are in the summary and the manifests
        logger.warning(f"extract: the extraction-check artifact was not published to the Prefect UI "
                       f"({type(exc).__name__}: {exc}); its figures are in the run's summary and the manifests")


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

    errors += wait_children(children, store, by_shard, logger, take_back, stage=stage)
    after = store.find_many(kind.shard_stage, [by_shard[s].digest for s in missing])
    found = {s: after[by_shard[s].digest] for s in missing}
    have = {int(x.stats.get("shard", 0)) for x in refs}
    refs += [a.ref() for s, a in found.items() if a is not None and s not in have]
    return finish_sharded(stage, r, store, plans, refs, errors, t0, logger,
                          executed=sum(1 for a in found.values() if a is not None), nodes=1 + len(children))


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
                  stage: str = "extract") -> list[str]:
    """Wait for the child runs (of STAGE) to end (Completed, Failed, Crashed, Cancelled); the errors of
    those whose shards are not all on the store. A child still Scheduled TAKE_BACK_AFTER seconds after
    this node went idle is cancelled, and `take_back` runs its shards here (a pool short of nodes never
    hangs)."""
    take_back_s = take_back_after()
    store_stage = SHARDED[stage].shard_stage if stage in SHARDED else None
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
                there = store.find_many(store_stage, [by_shard[s].digest for s in shards]) if shards else {}
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


# Training over several nodes (train.nodes > 1): the nodes' heartbeats on the run node's control store
NODE_BEAT = 2.0        # seconds between a training node's heartbeats
NODE_LOST_AFTER = 8.0  # a node whose heartbeat has not changed this long (and whose run has not ended) is lost


def train_nodes(cfg: RunConfig, store: Store, config: dict[str, Any], vocab: ArtifactRef,
                extracted: ArtifactRef, digest: str, logger, on_metrics) -> ArtifactRef:
    """train.nodes > 1: torch's elastic launcher on this node and on train.nodes - 1 child flow runs of
    `child_deployment` (the slice flow with stage=train), one c10d rendezvous hosted here. The nodes that
    take their child within TAKE_BACK_AFTER seconds train (the others are cancelled: the run trains on the
    nodes there are); rank 0 is on this node. A node that stops heartbeating while training failed is named
    in the error; `draftline retry` resumes from the last checkpoint on whatever nodes are there then.
    CONFIG: the run's config for the children (`child_config`); DIGEST: the train artifact's address (the
    flow's task found it not committed, flows/caching.py), which every node's ranks take."""
    from tasks.train.inputs import resolve_inputs
    from tasks.train.ranks import Rendezvous, launch_ranks, node_address, secret_run_id, train_ranks
    from tasks.train.stage import training_shards

    shards = training_shards(store, extracted)
    ranks = train_ranks(cfg.train)
    resolve_inputs(cfg, store, vocab, shards, digest=digest)  # bad inputs fail here, before any node is taken
    host = node_address()
    # one store on this node, listening on the address the nodes use only: torch's rendezvous and our control
    control = Rendezvous(endpoint="", control=f"{host}:0", run_id="").store(is_master=True)
    spec = Rendezvous(endpoint=f"{host}:{control.port}", control=f"{host}:{control.port}",
                      run_id=secret_run_id(digest), host=True)
    # The secret run id travels to the child runs as a flow-run parameter (docs/SECURITY.md says who sees it).
    children = start_children("train", cfg, store, config, [[] for _ in range(cfg.train.nodes)], logger, {
        "rendezvous": {"endpoint": spec.endpoint, "control": spec.control, "run_id": spec.run_id},
        "train_inputs": {"vocab": vocab.model_dump(mode="json"),
                         "extract": [r.model_dump(mode="json") for r in shards], "digest": digest}})
    claimed = wait_claimed(children, logger, "train", "its parent trains on the nodes there are")
    nodes = 1 + len(claimed)
    control.set(f"{spec.run_id}/nodes", str(nodes))
    spec = dataclasses.replace(spec, nodes=nodes)
    logger.info(f"train: {nodes} of {cfg.train.nodes} node(s) x {ranks} rank(s) = {nodes * ranks} rank(s); "
                f"rendezvous {spec.endpoint} (id {spec.label}), this node holds rank 0"
                + (f"; nodes: this one and {', '.join(c.name for c in claimed)}" if claimed else ""))
    try:
        ref = launch_ranks(cfg, store, vocab, shards, ranks, on_metrics, rendezvous=spec, digest=digest)
    except TrainError as exc:
        lost = lost_nodes(control, spec, claimed)
        if not lost:
            raise
        names = []
        with get_client(sync_client=True) as client:
            for run in lost:
                worker = submitting_worker(client, run)
                names.append(f"{worker.name if worker is not None else 'its node'} (child flow run {run.name}, "
                             f"{run.id})")
        msg = (f"training node lost: {'; '.join(names)} stopped heartbeating mid-training (the node died or "
               f"its process was killed), so the {nodes * ranks} ranks stopped. `draftline retry` this run: it "
               "resumes from the last checkpoint on the nodes there are then.")
        logger.error(msg)
        raise TrainError(msg + "\n" + str(exc)) from None
    errors = wait_children([(c, []) for c in claimed], store, {}, logger, stage="train")
    for e in errors:
        logger.warning(f"train: {e}")
    return ref


def lost_nodes(control: Any, spec: Any, claimed: list[Any]) -> list[Any]:
    """The child runs whose node stopped heartbeating on the control store (unchanged for NODE_LOST_AFTER
    seconds) while their run did not end: those nodes died (a node whose training failed ends its run)."""
    def beats() -> dict[Any, bytes | None]:
        out = {}
        for run in claimed:
            key = f"{spec.run_id}/beat/{run.id}"
            out[run.id] = control.get(key) if control.check([key]) else None
        return out

    first = beats()
    deadline = time.time() + NODE_LOST_AFTER
    lost: dict[Any, Any] = {}
    with get_client(sync_client=True) as client:
        while time.time() < deadline:
            stopping.wait(1.0, "telling a lost training node from a slow one")
            now = beats()
            for run in claimed:
                state = client.read_flow_run(run.id).state
                if now[run.id] == first[run.id] and (state is None or not state.is_final() or state.is_crashed()):
                    lost[run.id] = run
                else:
                    lost.pop(run.id, None)
    return list(lost.values())


def child_train_address(cfg: RunConfig, inputs: dict[str, Any], vocab: ArtifactRef, shards: list[ArtifactRef]) -> str:
    """The train address a child node's ranks commit at: computed here from the inputs the parent named (a flow
    run's parameters are not trusted to name a store path), and checked against the one the parent sent (absent
    from parents of earlier versions): a different one means the nodes run different draftline versions."""
    digest = digests.train(cfg, vocab, shards)
    sent = inputs.get("digest")
    if sent is not None and sent != digest:
        raise TrainError(f"train: the run's node sent train address {str(sent)[:80]!r}, this node computes {digest} "
                         "from the same inputs: the nodes run different draftline versions (or the run's parameters "
                         "were altered). Fix: install the run node's draftline version on this node, then "
                         "`draftline retry` the run")
    return digest


def train_child(cfg: RunConfig, store: Store, rendezvous: dict[str, Any], inputs: dict[str, Any], logger) -> dict:
    """One node of a run's training (the slice flow with stage=train): heartbeats on the run node's control
    store, waits for the node count there, then starts train.gpus ranks in the rendezvous."""

    from tasks.train.ranks import Rendezvous, launch_ranks, train_ranks

    spec = Rendezvous(**rendezvous)
    control = spec.store()
    stop = threading.Event()

    def beat() -> None:
        n = 0
        try:
            beat_store = spec.store()  # its own connection: the store client is not shared across threads
            while not stop.is_set():
                n += 1
                beat_store.set(f"{spec.run_id}/beat/{flow_run.id}", str(n))
                stop.wait(NODE_BEAT)
        except Exception as exc:  # noqa: BLE001 - the run's node is gone: its training fails this node's too
            logger.warning(f"train: no more heartbeats to the run's node ({spec.control}): {exc}")

    threading.Thread(target=beat, name="draftline-node-beat", daemon=True).start()
    try:
        nodes = int(control.get(f"{spec.run_id}/nodes"))
        vocab = ArtifactRef.model_validate(inputs["vocab"])
        shards = [ArtifactRef.model_validate(r) for r in inputs["extract"]]
        ranks = train_ranks(cfg.train)
        logger.info(f"train: this node runs {ranks} of the {nodes} nodes' ranks; rendezvous {spec.endpoint} "
                    f"(id {spec.label})")
        digest = child_train_address(cfg, inputs, vocab, shards)
        launch_ranks(cfg, store, vocab, shards, ranks, rendezvous=dataclasses.replace(spec, nodes=nodes), digest=digest)
    finally:
        stop.set()
    return {"stage": "train", "nodes": nodes, "ranks": ranks}
