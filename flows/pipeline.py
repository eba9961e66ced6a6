"""The draftline Prefect flow: prepare -> regenerate -> vocab -> extract[shards] -> train -> benchmark.

The flow iterates the stages (STAGE_DEFS: each stage module's `STAGE_DEF`, tasks/store/stages.py says what
one is) with one generic task per stage (`stage_task`) and one per shard of a sharded stage (`shard_task`).
A task computes nothing twice: it asks the store's manifest at its artifact's address (flows/caching.py
`finished_or_run`): a committed artifact ends the task at once as Cached, otherwise it computes under the
address's lock. The store, not Prefect's database, decides what runs. The loop over the stages tests no
stage's name: what differs between stages (a stage's variants, what it shows, the keywords its run takes, its
checks, running over nodes) is data on its stage object, and a stage's inputs are found as `resolve` finds
them (tasks/store/resolve.py `inputs_of`, `combine`). Two things name one: the run's `vllm serve` line is the
trained draft's (`_serve_line`), and the slice flow's `stage` parameter says what a node does (shards, train).
"""

from __future__ import annotations

import logging

import time
from typing import Any

from prefect.exceptions import MissingContextError
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.client.orchestration import get_client
from prefect.futures import wait
from prefect.runtime import deployment, flow_run

from flows.caching import TASK_OPTIONS, as_ref, finished_or_run
from flows.flow_runs import EXTRACT_FLOW
from flows.interrupts import chain_into_flow
from flows.nodes import child_config
from flows.shard_nodes import SHARDED, finish_sharded, run_nodes
from flows.started_runs import record_started
from flows.report_artifacts import Progress, show
from flows.run_record import RunRecord, announce, finish_stage
from flows.train_nodes import train_child, train_nodes
from tasks.benchmark.serve import run_serve
from tasks.core.arenas import bound_arenas
from tasks.core.config import RunConfig, STAGES
from tasks.core.config_load import load_config
from tasks.core.errors import ConfigError
from tasks.core.stages import check_until
from tasks.core.stages import task_name
from tasks.core.faults import fail_point
from tasks.engine.settings import EnginePool
from tasks.engine.target import resolve_model
from tasks.address.data import DataIdentityError, pin_data
from tasks.engine.weights import WeightsError, pin_run
from tasks.store.artifacts import ArtifactRef, Store
from tasks.store.resolve import combine, inputs_of, resolve
from tasks.store.stages import ShardedStage, Stage, as_variants, stage_defs
from tasks.train.preflight import remote_code_problem

# Prefect is imported at the top: whoever imports this module runs the flow (a Prefect worker's flow run,
# `draftline run` via cli/local_run.py). The stage modules import torch only where they compute (a head
# trained, the vocabulary's maps read). No command but `draftline deploy` imports this module
# (tests/repo/test_layout.py: `--help`, `deploy --help` and `ls` load neither Prefect nor torch).

# the stages in the order the flow runs them: the registry's (tasks/core/stages.py; STAGES, the names `--until` takes)
STAGE_DEFS: tuple[Stage | ShardedStage, ...] = stage_defs()
BY_NAME = {s.name: s for s in STAGE_DEFS}


# --------------------------------------------------------------------------- tasks

def named(fn: Any, name: str) -> Any:
    """Task FN as the Prefect UI shows it: NAME (prepare, extract-shard-3, train-eagle3, ...)."""
    return fn.with_options(name=name, task_run_name=name)


@task(name="stage", **TASK_OPTIONS)
def stage_task(stage: str, cfg: RunConfig, digest: str, inputs: list[Any], extra: dict[str, Any] | None = None
               ) -> ArtifactRef:
    """STAGE's artifact at DIGEST from INPUTS (a sharded stage's: its data, its shards' artifacts, when the
    stage began, how many shards were reused). EXTRA: with a stage over several nodes, the run's config for
    the other nodes' child runs (flows/train_nodes.py)."""
    st = BY_NAME[stage]
    store = Store.from_config(cfg.store)
    if isinstance(st, ShardedStage):
        data, shards, started, reused = inputs
        return finished_or_run(st.store_stage, store, digest, lambda: st.assemble(
            cfg, store, as_ref(data), [as_ref(x) for x in shards], started, reused, digest=digest))
    bar: list[Progress] = []  # made when the stage computes (a found artifact shows no bar)
    # taken here, in the task's thread: several ranks' records arrive on the thread that follows their metrics
    # file (tasks/train/ranks.py), which has no Prefect run context of its own to look a logger up in
    logger = _run_logger()

    def on_progress(m: dict[str, Any]) -> None:
        """The stage's records, as its `tick` says the bar and the log show them."""
        t = st.tick(m)
        if t.percent is not None and bar:
            bar[0].update(t.percent, t.message)
        for line in t.log:
            logger.info(line)
        for line in t.warnings:
            logger.warning(line)

    context = {"on_metrics": on_progress, "flow_run_id": flow_run.id}  # what a stage's `context` may name
    kwargs = {k: context[k] for k in st.context}

    def compute() -> ArtifactRef:
        if st.tick is not None:
            bar.append(Progress(f"{stage}-progress", f"{stage}: progress"))
        if st.nodes(cfg) > 1:
            ref = train_nodes(cfg, store, (extra or {}).get("children") or {}, *inputs, digest, logger, on_progress)
        else:
            ref = st.run(cfg, store, *inputs, digest=digest, **kwargs)
        for b in bar:
            b.update(100.0)
        return ref

    return finished_or_run(stage, store, digest, compute)


def _run_logger() -> Any:
    """The run's logger, or outside a Prefect run (the stage task's body called as a function) the process's."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("draftline.flow")


@task(name="shard", retries=0, **TASK_OPTIONS)
def shard_task(stage: str, cfg: RunConfig, digest: str, shard: int, plan: Any, pool: Any) -> ArtifactRef:
    """Shard SHARD of STAGE (its PLAN) at DIGEST, on an engine of POOL started only when it is not stored."""
    st = SHARDED[stage]
    store = Store.from_config(cfg.store)

    def compute() -> ArtifactRef:
        fail_point(stage, shard, digest)  # DRAFTLINE_FAULT_<STAGE>_SHARDS: drills only (tasks/core/faults.py)
        with pool.engine() as engine:
            ref = st.shard(cfg, store, plan, engine)
        s = ref.stats
        secs, n = float(s.get("seconds") or 0.0), int(s.get(st.tokens) or 0)
        get_run_logger().info(f"{stage}: shard {shard} on {s.get('engine')}: {s.get('samples')} samples, {n} "
                              f"{st.tokens.replace('_', ' ')} in {secs:.0f}s"
                              + (f", {n / secs:.0f} {st.rate}" if secs > 0 else ""))
        return ref

    return finished_or_run(st.shard_stage, store, digest, compute)


# --------------------------------------------------------------------------- the flow

def _as_a_flow_process() -> None:
    """First thing in each flow body (the pipeline and a node's slice), whoever started the process."""
    chain_into_flow()  # SIGTERM (a worker cancelling, a node shutting down) stops engines and waits first
    bound_arenas()  # the flow's resident memory does not grow with the shards it runs (tasks/core/arenas.py)


def _stop_after(until: str | None, stage: str) -> bool:
    return until is not None and STAGES.index(stage) >= STAGES.index(until)


@flow(name="draftline", log_prints=True, persist_result=False)
def pipeline(config_path: str | None = None, overrides: list[str] | None = None, until: str | None = None) -> dict:
    """Train an EAGLE-3 draft: parameters are a config file path plus `a.b=c` overrides."""
    _as_a_flow_process()
    overrides = list(overrides or [])
    if not deployment.id and flow_run.id:  # a run this machine starts itself: `draftline retry` may re-run it here
        try:
            record_started(flow_run.id, {"config_path": config_path, "overrides": overrides, "until": until})
        except OSError as exc:  # the run goes on; only a local retry of it will be refused
            get_run_logger().warning(f"could not record this run in draftline's folder ({exc}): `draftline retry` "
                                     "will not re-run it here")
    cfg = load_config(config_path, overrides)
    check_until(until)
    store = Store.from_config(cfg.store)
    store.check()
    logger = _run_logger()
    allow_remote_code(cfg, logger)  # before pinning: pinning fetches the target's small files (with its code)
    overrides = _pin_target(cfg, overrides)
    rec = announce(RunRecord(config_path=config_path, overrides=overrides, flow_run_id=str(flow_run.id or ""),
                             store=store.uri))
    try:
        _run_stages(cfg, store, rec, until, logger)
    except BaseException as exc:
        rec.state = "FAILED"
        _publish_summary(rec)
        raise exc
    rec.state = "FAILED" if any(r.status in ("failed", "partial") for r in rec.stages.values()) else "COMPLETED"
    _publish_summary(rec)
    if rec.state != "COMPLETED":
        failed = [n for n, r in rec.stages.items() if r.status in ("failed", "partial")]
        raise RuntimeError(f"stages failed: {', '.join(failed)}; fix the cause and `draftline retry` the run "
                           "(finished work is reused)")
    return rec.to_json()


def allow_remote_code(cfg: RunConfig, logger) -> None:
    """Refuse target.trust_remote_code in a deployment's run that does not allow it; warn when it is on."""
    if not cfg.target.trust_remote_code:
        return

    tags: list[str] = []
    if deployment.id:
        with get_client(sync_client=True) as client:
            tags = list(client.read_deployment(deployment.id).tags or [])

    problem = remote_code_problem(True, deployment.name if deployment.id else None, tags, cfg.target.model)
    if problem:
        raise ConfigError(problem)
    logger.warning("target.trust_remote_code is ON: the target repository's own Python code will run")


def _run_stages(cfg: RunConfig, store: Store, rec: RunRecord, until: str | None, logger) -> None:
    """Each stage in turn, from the artifacts the stages before it made (`made`, by stage), until UNTIL, with
    what each shows once done (its `show`); then the trained draft's `vllm serve` line, as far as it got."""
    made: dict[str, Any] = {}
    checked = False
    try:
        for i, st in enumerate(STAGE_DEFS):
            if not st.enabled(cfg):
                rec.stages[st.name].status = "skipped"
            else:
                inputs = inputs_of(st, made)
                if inputs is None:  # a registry line whose inputs name a stage that is not before it, or is off
                    raise RuntimeError(f"{st.name} takes {', '.join(st.inputs)}, not all made by the stages before "
                                       "it in this run: fix the stage's `inputs` or its registry line's place")
                if isinstance(st, ShardedStage):
                    checked = checked or until == st.name or _check_later(cfg, rec, STAGE_DEFS[i + 1:], until)
                    made[st.name] = _run_sharded_stage(st, cfg, store, rec, inputs[0], logger)
                else:
                    made[st.name] = _run_variants(st, cfg, store, rec, inputs, logger)
                try:
                    show(st.show(cfg, store, made), rec.stages[st.name], logger, rec)
                except Exception as exc:  # noqa: BLE001 - the artifact is committed either way
                    logger.warning(f"{st.name}: could not show its results: {type(exc).__name__}: {exc}")
            if _stop_after(until, st.name):
                for later in STAGES[STAGES.index(st.name) + 1:]:
                    rec.stages[later].status = "skipped"
                return
    finally:
        _serve_line(cfg, store, rec, made, logger)


def _check_later(cfg: RunConfig, rec: RunRecord, later: tuple[Stage | ShardedStage, ...], until: str | None) -> bool:
    """The `check` of each stage after a long (sharded) one, up to UNTIL: a head reading layers the extraction
    will not hold fails now, not after hours of extraction. The failing stage's record says why."""
    for st in later:
        if st.check is not None and st.enabled(cfg):
            try:
                st.check(cfg)
            except Exception as exc:
                rec.stages[st.name].status, rec.stages[st.name].error = "failed", str(exc)
                raise
        if until == st.name:
            break
    return True


def _run_variants(st: Stage, cfg: RunConfig, store: Store, rec: RunRecord, inputs: list[Any], logger
                  ) -> ArtifactRef | list[tuple[str, ArtifactRef]]:
    """One cached task per variant of ST (each head of train.heads), each at its own address, from the same
    inputs. Returns the one artifact, or (label, artifact) per variant."""
    variants = st.variants(cfg)
    t0 = time.time()
    extra = {"children": child_config(rec)} if st.nodes(cfg) > 1 else None
    made = []
    for label, vcfg in variants:
        name = task_name(st.name, variant=label if len(variants) > 1 else None)
        made.append((label, _run_stage(st, vcfg, store, rec, inputs, logger, extra, name)))
    if len(made) > 1:
        r = rec.stages[st.name]
        finish_stage(r, t0, [ref for _, ref in made])
        r.stats = {}
    return combine(made)


def _run_stage(st: Stage, cfg: RunConfig, store: Store, rec: RunRecord, inputs: list[Any], logger,
               extra: dict[str, Any] | None = None, name: str | None = None) -> ArtifactRef:
    """One task for stage ST (named NAME, default the stage's), recorded in the run's record."""
    r = rec.stages[st.name]
    t0 = time.time()
    r.status = "running"
    digest, _ = st.locate(cfg, store, inputs)
    try:
        ref = as_ref(named(stage_task, name or st.name)(st.name, cfg, digest, inputs, extra))
    except Exception as exc:
        finish_stage(r, t0, [], failed=1)
        r.error = f"{type(exc).__name__}: {exc}"
        raise
    finish_stage(r, t0, [ref])
    r.artifact, r.stats = ref.uri, _brief(ref.stats)
    logger.info(f"{st.name}: {r.status} in {r.seconds}s -> {ref.uri}")
    return ref


def _serve_line(cfg: RunConfig, store: Store, rec: RunRecord, made: dict[str, Any], logger) -> None:
    """The trained draft's `vllm serve` line at the config's settings, unless a stage's `show` set the measured
    one (the benchmark's)."""
    if rec.serve is not None or "train" not in made:
        return
    try:
        rec.serve = run_serve(BY_NAME["train"].variants(cfg)[0][1], store, as_variants(made["train"])[0][1])
    except Exception as exc:  # noqa: BLE001 - the draft is committed either way; `draftline export` prints it too
        logger.warning(f"could not build the draft's vllm serve line: {exc}")


def _run_sharded_stage(st: ShardedStage, cfg: RunConfig, store: Store, rec: RunRecord, data: ArtifactRef,
                       logger) -> ArtifactRef:
    """A sharded stage: its shards as tasks over this node's engine groups (and other nodes), then its own
    artifact from them, as one more task. A stage whose artifact copies its shards and is committed runs no
    shard; one that names its shards checks them all (each found or run). The record counts shards."""
    r = rec.stages[st.name]
    t0 = time.time()
    r.status = "running"
    digest, plans = st.locate(cfg, store, [data])
    counts: dict[str, Any] = {}
    shards: list[ArtifactRef] = []
    if not (st.copies_shards and store.find(st.store_stage, digest) is not None):
        shards = _run_shards(st, cfg, store, rec, data, plans, logger)
        counts = dict(r.stats)
    try:
        ref = as_ref(named(stage_task, st.name)(st.name, cfg, digest, [data, shards, t0, r.cached]))
    except Exception as exc:
        if not shards:
            finish_stage(r, t0, [], failed=1)
        r.status, r.error = "failed", f"{type(exc).__name__}: {exc}"
        raise
    if not shards:
        finish_stage(r, t0, [ref])
    r.seconds = round(time.time() - t0, 1)
    if ref.executed_here and r.status == "cached":
        r.status = "ran"  # every shard was on the store, the stage artifact was not
    r.artifact, r.stats = ref.uri, {**_brief(ref.stats), **counts}
    logger.info(f"{st.name}: {r.status} in {r.seconds}s -> {ref.uri}")
    return ref


def _run_shards(st: ShardedStage, cfg: RunConfig, store: Store, rec: RunRecord, data: ArtifactRef, plans: list,
                logger) -> list[ArtifactRef]:
    """ST's shards (PLANS), one task each, over this node's engine groups and, with extract.nodes > 1, over
    other nodes (flows/shard_nodes.py); the stage's record counts them. Raises when a shard failed: `draftline
    retry` runs only the shards not on the store."""
    t0 = time.time()
    model = resolve_model(cfg.target)

    def here(mine: list, progress: Progress) -> tuple[list[ArtifactRef], list[str]]:
        return _shards_here(st, cfg, store, model, mine, logger, progress)

    if cfg.extract.nodes > 1:
        return run_nodes(st.name, cfg, store, rec, data, plans, logger, t0, here)
    refs, errors = here(plans, Progress(f"{st.name}-progress", f"{st.title}: 0/{len(plans)} shards"))
    return finish_sharded(st.name, rec.stages[st.name], store, plans, refs, errors, t0, logger)


def _shards_here(st: ShardedStage, cfg: RunConfig, store: Store, model: str, plans: list, logger,
                 progress: Progress) -> tuple[list[ArtifactRef], list[str]]:
    """One task per shard of PLANS in this flow run, fanned out over this node's engine groups."""
    t0 = time.time()
    pool = EnginePool.for_purpose(cfg, model, st.name)
    if len(pool.groups) > 1:
        logger.info(f"{st.name}: {len(plans)} shards over {len(pool.groups)} engines side by side: "
                    + ", ".join(g.name for g in pool.groups))
    done = 0
    tokens = 0
    refs: list[ArtifactRef] = []
    errors: list[str] = []
    try:
        futures = [named(shard_task, task_name(st.name, shard=p.shard)).submit(
            st.name, cfg, p.digest, p.shard, p, pool) for p in plans]
        pending = set(futures)
        while pending:
            finished, pending = wait(list(pending), timeout=5)
            for fut in finished:
                # result() waits for the final state; inspecting fut.state here can race with it.
                try:
                    ref = as_ref(fut.result())
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
                else:
                    refs.append(ref)
                    tokens += int(ref.stats.get(st.tokens, 0))
                done += 1
            el = max(1e-6, time.time() - t0)
            progress.update(100.0 * done / max(1, len(plans)),
                            f"{st.title}: {done}/{len(plans)} shards, {len(errors)} failed, "
                            f"{tokens / el:,.0f} {st.rate} (incl. cached)")
    finally:
        pool.close()
    refs.sort(key=lambda x: int(x.stats.get("shard", 0)))
    return refs, errors


@flow(name=EXTRACT_FLOW, log_prints=True, persist_result=False)
def extract_slice(config_path: str | None = None, overrides: list[str] | None = None, data_stage: str = "prepare",
                  data_digest: str = "", shards: list[int] | None = None, stage: str = "extract",
                  rendezvous: dict[str, Any] | None = None, train_inputs: dict[str, Any] | None = None) -> dict:
    """A slice of a run's regeneration or extraction shards (STAGE) on one node, started by the run with
    extract.nodes > 1 (flows/shard_nodes.py); the node resolves its shards on the store (tasks/store/resolve.py)
    and checks them against the data the parent named (`data_*`). With stage=train (train.nodes > 1): one node
    of the run's training, joining RENDEZVOUS; the train address in TRAIN_INPUTS picks the head
    (flows/train_nodes.py)."""
    _as_a_flow_process()
    if stage not in SHARDED and stage != "train":
        raise RuntimeError(f"stage={stage!r}: a slice runs the shards of one of {', '.join(SHARDED)}, or train")
    cfg = load_config(config_path, list(overrides or []))
    store = Store.from_config(cfg.store)
    store.check()
    logger = _run_logger()
    allow_remote_code(cfg, logger)  # before pinning: pinning fetches the target's small files (with its code)
    _pin_target(cfg, [])  # the parent pinned target.revision in the overrides: this records it
    if stage == "train":
        if not rendezvous or not train_inputs:
            raise RuntimeError("stage=train: a training node needs the rendezvous and train_inputs parameters "
                               "its parent run sends")
        return train_child(cfg, store, rendezvous, train_inputs, logger)
    st = SHARDED[stage]
    model = resolve_model(cfg.target)
    want = set(shards or [])
    plans = [p for p in _slice_plans(cfg, store, st, data_stage, data_digest) if p.shard in want]
    if len(plans) != len(want):
        raise RuntimeError(f"shards {sorted(want - {p.shard for p in plans})} do not exist in {data_stage}/{data_digest}")
    progress = Progress(f"{stage}-progress", f"{st.title} slice: 0/{len(plans)} shards")
    refs, errors = _shards_here(st, cfg, store, model, plans, logger, progress)
    summary = {"stage": stage, "shards": sorted(want), "executed": sum(1 for x in refs if x.executed_here),
               "cached": sum(1 for x in refs if not x.executed_here), "failed": len(errors)}
    logger.info(f"{stage} slice: {summary}")
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(plans)} shards of this slice failed: {errors[0]}")
    return summary


def _slice_plans(cfg: RunConfig, store: Store, st: ShardedStage, data_stage: str, data_digest: str) -> list[Any]:
    """ST's shard plans as this node resolves its config on the store (tasks/store/resolve.py: a flow run's
    parameters name no store path), checked against the data the parent run named (DATA_STAGE/DATA_DIGEST)."""
    found = resolve(cfg, store, until=st.name)
    at, data = found.of(st.name), found.ref(st.inputs[0])
    if at is None or data is None:
        raise RuntimeError(f"the data this slice reads ({data_stage}/{data_digest}) is not on {store.uri}: "
                           "the parent run and this node must share one s3:// store")
    if data_digest and (data.stage, data.digest) != (data_stage, data_digest):
        raise RuntimeError(f"the run's node sent {data_stage}/{data_digest} as the data of its {st.name} shards, this "
                           f"node resolves {data.stage}/{data.digest} from the same config: the nodes run different "
                           "draftline versions (or the run's parameters were altered). Fix: install the run node's "
                           "draftline version on this node, then `draftline retry` the run")
    return at.plans


def _pin_target(cfg: RunConfig, overrides: list[str]) -> list[str]:
    """The run's target pinned once (a hub id's commit) and recorded in every manifest (tasks/engine/weights.py), and
    its hub datasets pinned the same way (tasks/address/data.py)."""
    try:
        return pin_data(cfg, pin_run(cfg, overrides))
    except (WeightsError, DataIdentityError) as exc:
        get_run_logger().error(str(exc))
        raise


def _brief(stats: dict[str, Any]) -> dict[str, Any]:
    """Small scalar stats for the summary (no tables or markdown)."""
    out = {}
    for k, v in stats.items():
        if isinstance(v, (int, float, str, bool)) and not (isinstance(v, str) and len(v) > 80):
            out[k] = v
    return out


def _publish_summary(rec: RunRecord) -> None:
    rows = []
    for name, r in rec.stages.items():
        rows.append({"stage": name, "status": r.status, "ran": r.executed, "cached": r.cached,
                     "failed": r.failed, "seconds": r.seconds, "artifact": r.artifact or ""})
    try:
        create_table_artifact(rows, key="run-summary", description=f"draftline run: {rec.state}")
    except Exception as exc:  # noqa: BLE001 - the UI's view only; the run's record holds the same rows
        get_run_logger().warning(f"the run-summary table was not published to the Prefect UI "
                                 f"({type(exc).__name__}: {exc}); `draftline status` shows the same stages")
