"""The draftline Prefect flow: prepare -> regenerate -> vocab -> extract[shards] -> train -> benchmark.

The flow iterates the stages (STAGE_DEFS: each stage module's `STAGE_DEF`, tasks/store/stages.py says what
one is) with one generic task per stage (`stage_task`) and one per shard of a sharded stage (`shard_task`).
A task computes nothing twice: it asks the store's manifest at its artifact's address (flows/caching.py
`finished_or_run`): a committed artifact ends the task at once as Cached, otherwise it computes under the
address's lock. The store, not Prefect's database, decides what runs.
"""

from __future__ import annotations

import re
import time
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_table_artifact,
)
from prefect.client.orchestration import get_client
from prefect.futures import wait
from prefect.runtime import deployment, flow_run

from flows.caching import TASK_OPTIONS, as_ref, finished_or_run
from flows.flow_runs import EXTRACT_FLOW
from flows.interrupts import chain_into_flow
from flows.nodes import SHARDED, child_config, finish_sharded, run_nodes, train_child, train_nodes
from tasks.train.preflight import check_head_layers, remote_code_problem
from flows.started_runs import record_started
from flows.report_artifacts import Progress, publish_summary
from flows.run_record import RunRecord, announce, finish_stage
from tasks.benchmark.serve import run_serve
from tasks.benchmark.stage import STAGE_DEF as BENCHMARK, load_report
from tasks.core.config import ConfigError, HeadConfig, RunConfig, STAGES, check_until, head_config, load_config
from tasks.core.stages import task_name
from tasks.core.faults import fail_point
from tasks.data.vocab import STAGE_DEF as VOCAB
from tasks.engine.settings import EnginePool
from tasks.engine.target import resolve_model
from tasks.address.data import DataIdentityError, pin_data
from tasks.engine.weights import WeightsError, pin_run
from tasks.extract.stage import STAGE_DEF as EXTRACT
from tasks.store.artifacts import ArtifactRef, Store
from tasks.store.stages import ShardedStage, Stage, stage_defs
from tasks.train import TrainError
from tasks.train.stage import STAGE_DEF as TRAIN

# The stages are imported at the top, torch with them (tasks.data.vocab's maps, tasks.train.stage): whoever
# imports this module runs the flow (a Prefect worker's flow run, `draftline run` via cli/local_run.py), and
# vocab and train need torch there. The one reader that does not, `prefect deploy` (under `draftline deploy`)
# reading the flows' parameters, pays ~1.2 s once; no other command imports this module
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
    stage began, how many shards were reused), with what the Prefect UI shows of it."""
    st = BY_NAME[stage]
    store = Store.from_config(cfg.store)
    if isinstance(st, ShardedStage):
        data, shards, started, reused = inputs
        return finished_or_run(st.store_stage, store, digest, lambda: st.assemble(
            cfg, store, as_ref(data), [as_ref(x) for x in shards], started, reused, digest=digest))
    run = {"vocab": _vocab, "train": _train, "benchmark": _benchmark}.get(stage)
    return finished_or_run(stage, store, digest, lambda: run(cfg, store, inputs, digest, extra or {}) if run
                           else st.run(cfg, store, *inputs, digest=digest))


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


def _vocab(cfg: RunConfig, store: Store, inputs: list[Any], digest: str, extra: dict[str, Any]) -> ArtifactRef:
    ref = VOCAB.run(cfg, store, *inputs, digest=digest)
    summary = ref.stats.get("summary_md")
    if summary:
        create_markdown_artifact(summary, key="draft-vocabulary", description="Draft vocabulary coverage")
    return ref


def _benchmark(cfg: RunConfig, store: Store, inputs: list[Any], digest: str, extra: dict[str, Any]) -> ArtifactRef:
    # The report names the flow run that measured it (PREFECT__FLOW_RUN_ID is set only in deployed runs).
    return BENCHMARK.run(cfg, store, *inputs, flow_run_id=flow_run.id, digest=digest)


def _train(cfg: RunConfig, store: Store, inputs: list[Any], digest: str, extra: dict[str, Any]) -> ArtifactRef:
    """EXTRA's `children`: with train.nodes > 1, the run's config for the other nodes' child runs (flows/nodes.py)."""
    vocab, extracted = inputs
    logger = get_run_logger()
    progress = Progress("train-progress", "Training steps")

    def on_metrics(m: dict[str, Any]) -> None:
        """Rank 0's records, from this process or (several ranks) from the launched ranks as they train."""
        if "step" in m and "max_steps" in m:
            progress.update(100.0 * m["step"] / max(1, m["max_steps"]),
                            f"step {m['step']}/{m['max_steps']}" + (f", loss {m['loss']:.4f}" if "loss" in m else ""))
        line = _train_log_line(m)
        if line:
            logger.info(line)
        if m.get("attn_fallback"):
            logger.warning(f"train: {m['attn_fallback']}; training with sdpa")

    if cfg.train.nodes > 1:
        ref = train_nodes(cfg, store, extra.get("children") or {}, vocab, extracted, digest, logger, on_metrics)
    else:
        ref = TRAIN.run(cfg, store, vocab, extracted, on_metrics=on_metrics, digest=digest)
    progress.update(100.0)
    acc = ref.stats.get("val_acc_per_pos")
    if acc:
        create_table_artifact(
            [{"position": i + 1, "accuracy": round(a, 4)} for i, a in enumerate(acc)],
            key=f"train{_head_key(cfg)}-heldout-accuracy",
            description=f"Draft accuracy per TTT position on held-out data ({cfg.train.head.label})")
    return ref


def _head_key(cfg: RunConfig) -> str:
    """'' for the default EAGLE-3 head, else '-' + its label as a Prefect artifact key allows."""
    head = cfg.train.head
    return "" if head == HeadConfig() else "-" + re.sub(r"[^a-z0-9-]+", "-", head.label.lower())


def _train_log_line(m: dict[str, Any]) -> str | None:
    """A log line for a training record: start, every ~5% of the steps, checkpoints, evaluation."""
    kind = m.get("kind")
    if kind == "start":
        resumed = f", resumed from the checkpoint of step {m['resumed_from']}" if m.get("resumed_from") is not None else ""
        warm = f"; warm start from {m['init_from']['source']}: {m['init_from']['note']}" if m.get("init_from") else ""
        return (f"train: {m.get('world_size', 1)} rank(s) on {m.get('device')}, {m.get('attn_impl')} attention, "
                f"{m.get('precision')}, step {m.get('step')}/{m.get('max_steps')}{resumed}{warm}")
    if kind == "train":
        step, total = int(m["step"]), int(m["max_steps"])
        if step == 1 or step == total or step % max(1, total // 20) == 0:
            return (f"train step {step}/{total}: loss {m['loss']:.4f}, acc {m.get('acc_per_pos')}, "
                    f"{m.get('tokens_per_s', 0):.0f} tok/s, data wait {m.get('data_wait_s', 0):.3f}s")
        return None
    if kind == "checkpoint":
        return f"train: checkpoint at step {m['step']} ({m.get('digest')})"
    if kind == "eval":
        return (f"train: held-out accuracy per position {m.get('val_acc_per_pos')}, simulated acceptance length "
                f"{m.get('simulated_acceptance_length')}")
    if kind == "done" and m.get("head"):
        return f"train: the {m['head']} head ({m.get('head_kind')}) saved after {m.get('steps')} steps"
    return None


# --------------------------------------------------------------------------- the flow

def _stop_after(until: str | None, stage: str) -> bool:
    return until is not None and STAGES.index(stage) >= STAGES.index(until)


@flow(name="draftline", log_prints=True, persist_result=False)
def pipeline(config_path: str | None = None, overrides: list[str] | None = None, until: str | None = None) -> dict:
    """Train an EAGLE-3 draft: parameters are a config file path plus `a.b=c` overrides."""
    chain_into_flow()  # SIGTERM (a worker cancelling, a node shutting down) stops engines and waits first
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
    logger = get_run_logger()
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
    """Each stage in turn, from the artifacts the stages before it made (`made`, by stage; `data`: the
    regenerate artifact when regeneration ran, else prepare's), until UNTIL."""
    made: dict[str, Any] = {}
    for st in STAGE_DEFS:
        if not st.enabled(cfg):
            rec.stages[st.name].status = "skipped"
        else:
            if st is EXTRACT and until != "extract":
                _check_heads(cfg, rec)
            inputs = [made[name] for name in st.inputs]
            if isinstance(st, ShardedStage):
                made[st.name] = _run_sharded_stage(st, cfg, store, rec, inputs[0], logger)
            elif st is TRAIN:
                made[st.name] = _run_heads(cfg, store, rec, inputs, logger)
            else:
                made[st.name] = _run_stage(st, cfg, store, rec, inputs, logger)
        made["data"] = made.get("regenerate") or made.get("prepare")
        if st is BENCHMARK and st.name in made:
            _after_benchmark(cfg, store, rec, made, logger)
        if _stop_after(until, st.name):
            for later in STAGES[STAGES.index(st.name) + 1:]:
                rec.stages[later].status = "skipped"
            return


def _run_stage(st: Stage, cfg: RunConfig, store: Store, rec: RunRecord, inputs: list[Any], logger,
               extra: dict[str, Any] | None = None, name: str | None = None) -> ArtifactRef:
    """One task for stage ST (named NAME, default the stage's), recorded in the run's record."""
    r = rec.stages[st.name]
    t0 = time.time()
    r.status = "running"
    digest = st.address(cfg, store, *inputs)
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


def _check_heads(cfg: RunConfig, rec: RunRecord) -> None:
    """A head reading layers the extraction will not hold fails now, not after hours of extraction."""
    try:
        check_head_layers(cfg)
    except TrainError as exc:
        rec.stages["train"].status, rec.stages["train"].error = "failed", str(exc)
        raise


def _run_heads(cfg: RunConfig, store: Store, rec: RunRecord, inputs: list[Any], logger
               ) -> ArtifactRef | list[tuple[str, ArtifactRef]]:
    """One cached train task per head of train.heads, each at its own address, from the same inputs; the
    draft's `vllm serve` line. Returns the one head's artifact, or (label, artifact) per head."""
    heads: list[tuple[str, ArtifactRef]] = []
    t0 = time.time()
    extra = {"children": child_config(rec)} if cfg.train.nodes > 1 else None
    for head in cfg.train.heads:
        name = task_name(TRAIN.name, variant=head.label if len(cfg.train.heads) > 1 else None)
        heads.append((head.label, _run_stage(TRAIN, head_config(cfg, head), store, rec, inputs, logger, extra, name)))
    if len(heads) > 1:
        r = rec.stages["train"]
        finish_stage(r, t0, [ref for _, ref in heads])
        r.stats = {"heads": ", ".join(f"{label} {ref.digest[:8]} ({ref.stats.get('steps')} steps)"
                                      for label, ref in heads)}
    try:
        rec.serve = run_serve(head_config(cfg, cfg.train.heads[0]), store, heads[0][1])
    except Exception as exc:  # noqa: BLE001 - the draft is committed either way; `draftline export` prints it too
        logger.warning(f"could not build the draft's vllm serve line: {exc}")
    return heads[0][1] if len(heads) == 1 else heads


def _after_benchmark(cfg: RunConfig, store: Store, rec: RunRecord, made: dict[str, Any], logger) -> None:
    """The run's figures and `vllm serve` line from the benchmark's report, and the report in the UI."""
    report = load_report(store, made["benchmark"])
    rec.benchmark = report.get("benchmark")
    trained = made["train"]
    first = trained if isinstance(trained, ArtifactRef) else trained[0][1]
    if report.get("serve"):  # the settings it was measured at (a report from before they were kept: the config's)
        rec.serve = run_serve(cfg, store, first, report)
    if len(report.get("heads") or {}) > 1:  # every head's rows, for --json and the terminal
        rec.stages["benchmark"].stats["heads"] = report.get("head_table")
    try:
        publish_summary(report)
    except Exception as exc:  # the figures are in the store either way
        logger.warning(f"could not publish benchmark artifacts to Prefect: {exc}")


def _run_sharded_stage(st: ShardedStage, cfg: RunConfig, store: Store, rec: RunRecord, data: ArtifactRef,
                       logger) -> ArtifactRef:
    """A sharded stage: its shards as tasks over this node's engine groups (and other nodes), then its own
    artifact from them, as one more task. A stage whose artifact copies its shards and is committed runs no
    shard; one that names its shards checks them all (each found or run). The record counts shards."""
    r = rec.stages[st.name]
    t0 = time.time()
    r.status = "running"
    plans = st.plan(cfg, data)
    digest = st.address(cfg, data, plans)
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
    other nodes (flows/nodes.py); the stage's record counts them. Raises when a shard failed: `draftline
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
    extract.nodes > 1 (flows/nodes.py); `data_*` name the artifact the shards read. With stage=train
    (train.nodes > 1): one node of the run's training, joining RENDEZVOUS with TRAIN_INPUTS."""
    chain_into_flow()
    if stage not in SHARDED and stage != "train":
        raise RuntimeError(f"stage={stage!r}: a slice runs the shards of one of {', '.join(SHARDED)}, or train")
    cfg = load_config(config_path, list(overrides or []))
    store = Store.from_config(cfg.store)
    store.check()
    logger = get_run_logger()
    allow_remote_code(cfg, logger)  # before pinning: pinning fetches the target's small files (with its code)
    _pin_target(cfg, [])  # the parent pinned target.revision in the overrides: this records it
    if stage == "train":
        if not rendezvous or not train_inputs:
            raise RuntimeError("stage=train: a training node needs the rendezvous and train_inputs parameters "
                               "its parent run sends")
        return train_child(cfg, store, rendezvous, train_inputs, logger)
    hit = store.find(data_stage, data_digest)
    if hit is None:
        raise RuntimeError(f"the data this slice reads ({data_stage}/{data_digest}) is not on {store.uri}: "
                           "the parent run and this node must share one s3:// store")
    st = SHARDED[stage]
    model = resolve_model(cfg.target)
    want = set(shards or [])
    plans = [p for p in st.plan(cfg, hit.ref()) if p.shard in want]
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
    except Exception:
        pass
