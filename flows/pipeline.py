"""The draftline Prefect flow: prepare -> regenerate -> vocab -> extract[shards] -> train -> benchmark.

Each stage is a thin task around a plain function in tasks/. Tasks are keyed by
their artifact digest (flows/caching.py); the stage functions themselves also
return at once when their artifact is committed, so the store, not Prefect's
database, decides what runs.
"""

from __future__ import annotations

# The train and vocab stages are imported where used: they import torch, which is heavy (seconds),
# and a run that stops before them never needs them.

import re
import time
from typing import Any, Callable

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_table_artifact,
)
from prefect.client.orchestration import get_client
from prefect.futures import wait
from prefect.runtime import deployment, flow_run

from flows.caching import stage_options
from flows.flow_runs import EXTRACT_FLOW
from flows.interrupts import chain_into_flow
from flows.nodes import SHARDED, child_config, finish_sharded, run_nodes, train_child, train_nodes
from flows.preflight import check_head_layers, remote_code_problem
from flows.report_artifacts import Progress, publish_summary
from flows.run_record import RunRecord, announce, finish_stage
from tasks.address import digests
from tasks.benchmark.serve import run_serve
from tasks.benchmark.stage import load_report, run_benchmark
from tasks.core.config import ConfigError, HeadConfig, RunConfig, STAGES, check_until, head_config, load_config
from tasks.core.faults import fail_point
from tasks.data.prepare import run_prepare
from tasks.data.regenerate import SHARD_STAGE, assemble_regenerate, plan_regenerate, regenerate_shard
from tasks.engine.settings import EnginePool
from tasks.engine.target import load_hf_config, resolve_model
from tasks.engine.weights import WeightsError, pin_run
from tasks.extract.shards import extract_shards
from tasks.extract.stage import assemble_extract, extract_shard, plan_extract
from tasks.store.artifacts import ArtifactRef, Store
from tasks.train import TrainError


def as_ref(value: Any) -> ArtifactRef:
    """Task results are stored as JSON (never pickle); cached ones come back as dicts."""
    return value if isinstance(value, ArtifactRef) else ArtifactRef.model_validate(value)


# --------------------------------------------------------------------------- tasks

@task(name="prepare", task_run_name="prepare")
def prepare_task(cfg: RunConfig, digest: str) -> ArtifactRef:
    return run_prepare(cfg, Store.from_config(cfg.store))


@task(name="regenerate-shard", task_run_name="regenerate-shard-{shard}", retries=0)
def regenerate_shard_task(cfg: RunConfig, digest: str, shard: int, plan: Any, pool: Any) -> ArtifactRef:
    store = Store.from_config(cfg.store)

    def compute() -> ArtifactRef:
        with pool.engine() as engine:
            ref = regenerate_shard(cfg, store, plan, engine)
        st = ref.stats
        secs, gen = float(st.get("seconds") or 0.0), int(st.get("generated_tokens") or 0)
        get_run_logger().info(f"regenerate: shard {shard} on {st.get('engine')}: {st.get('samples')} samples, {gen} "
                              f"generated tokens in {secs:.0f}s" + (f", {gen / secs:.0f} tok/s" if secs > 0 else ""))
        return ref

    return store.found_or_compute(SHARD_STAGE, digest, compute)


@task(name="regenerate", task_run_name="regenerate")
def regenerate_task(cfg: RunConfig, digest: str, prepared: ArtifactRef, shards: list[ArtifactRef],
                    reused: int = 0, started: float | None = None) -> ArtifactRef:
    """The regenerate artifact from its shards' artifacts (tasks.data.regenerate.assemble_regenerate)."""
    store = Store.from_config(cfg.store)
    arts = [store.open(SHARD_STAGE, as_ref(x).digest) for x in shards]
    return assemble_regenerate(cfg, store, prepared, arts, started or time.time(), reused)


@task(name="vocab", task_run_name="vocab")
def vocab_task(cfg: RunConfig, digest: str, data: ArtifactRef) -> ArtifactRef:
    from tasks.data.vocab import run_vocab

    ref = run_vocab(cfg, Store.from_config(cfg.store), data)
    summary = ref.stats.get("summary_md")
    if summary:
        create_markdown_artifact(summary, key="draft-vocabulary", description="Draft vocabulary coverage")
    return ref


@task(name="extract-shard", task_run_name="extract-shard-{shard}", retries=0)
def extract_task(cfg: RunConfig, digest: str, shard: int, plan: Any, pool: Any) -> ArtifactRef:
    store = Store.from_config(cfg.store)

    def compute() -> ArtifactRef:
        fail_point("extract", shard, digest)  # DRAFTLINE_FAULT_EXTRACT_SHARDS: drills only (tasks/core/faults.py)
        with pool.engine() as engine:
            return extract_shard(cfg, store, plan, engine)

    return store.found_or_compute("extract", digest, compute)


@task(name="train", task_run_name="train")
def train_task(cfg: RunConfig, digest: str, vocab: ArtifactRef, extracted: ArtifactRef,
               children: dict[str, Any] | None = None) -> ArtifactRef:
    """CHILDREN: with train.nodes > 1, the run's config for the other nodes' child runs (flows/nodes.py)."""
    from tasks.train.stage import run_train

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
        ref = train_nodes(cfg, Store.from_config(cfg.store), children or {}, vocab, extracted, logger, on_metrics)
    else:
        ref = run_train(cfg, Store.from_config(cfg.store), vocab, extracted, on_metrics=on_metrics)
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
        return f"train: the {m['head']} head ({m.get('head_kind')}) exported after {m.get('steps')} steps"
    return None


@task(name="benchmark", task_run_name="benchmark")
def benchmark_task(cfg: RunConfig, digest: str, trained: ArtifactRef | list[tuple[str, ArtifactRef]],
                   data: ArtifactRef) -> ArtifactRef:
    # The report names the flow run that measured it (PREFECT__FLOW_RUN_ID is set only in deployed runs).
    ref = run_benchmark(cfg, Store.from_config(cfg.store), trained, data, flow_run_id=flow_run.id)
    return ref


# --------------------------------------------------------------------------- the flow

def _stop_after(until: str | None, stage: str) -> bool:
    return until is not None and STAGES.index(stage) >= STAGES.index(until)


@flow(name="draftline", log_prints=True, persist_result=False)
def pipeline(config_path: str | None = None, overrides: list[str] | None = None, until: str | None = None) -> dict:
    """Train an EAGLE-3 draft: parameters are a config file path plus `a.b=c` overrides."""
    chain_into_flow()  # SIGTERM (a worker cancelling, a node shutting down) stops engines and waits first
    overrides = list(overrides or [])
    cfg = load_config(config_path, overrides)
    check_until(until)
    store = Store.from_config(cfg.store)
    store.check()
    overrides = _pin_target(cfg, overrides)
    rec = announce(RunRecord(config_path=config_path, overrides=overrides, flow_run_id=str(flow_run.id or ""),
                             store=store.uri))
    logger = get_run_logger()
    allow_remote_code(cfg, logger)
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

    problem = remote_code_problem(True, deployment.name if deployment.id else None, tags)
    if problem:
        raise ConfigError(problem)
    logger.warning("target.trust_remote_code is ON: the target repository's own Python code will run")


def _run_stages(cfg: RunConfig, store: Store, rec: RunRecord, until: str | None, logger) -> None:
    def run_single(name: str, fn: Callable[[], ArtifactRef]) -> ArtifactRef:
        r = rec.stages[name]
        t0 = time.time()
        r.status = "running"
        try:
            ref = as_ref(fn())
        except Exception as exc:
            finish_stage(r, t0, [], failed=1)
            r.error = f"{type(exc).__name__}: {exc}"
            raise
        finish_stage(r, t0, [ref])
        r.artifact, r.stats = ref.uri, _brief(ref.stats)
        logger.info(f"{name}: {r.status} in {r.seconds}s -> {ref.uri}")
        return ref

    def skip_rest(after: str) -> None:
        for s in STAGES[STAGES.index(after) + 1:]:
            rec.stages[s].status = "skipped"

    opts = lambda stage: stage_options(stage, store, d)  # noqa: E731  (d: the digest computed just before)

    # prepare
    d = digests.prepare(cfg)
    prepared = run_single("prepare", lambda: prepare_task.with_options(**opts("prepare"))(cfg, d))
    if _stop_after(until, "prepare"):
        return skip_rest("prepare")

    # regenerate: one task per shard, fanned out over engine groups (and nodes), then one artifact
    data = prepared
    if cfg.regenerate.enabled:
        d = digests.regenerate(cfg, prepared)
        if store.find("regenerate", d) is not None:
            data = run_single("regenerate", lambda: regenerate_task.with_options(**opts("regenerate"))(
                cfg, d, prepared, []))
        else:
            data = _run_regenerate(cfg, store, rec, prepared, d, logger)
    else:
        rec.stages["regenerate"].status = "skipped"
    if _stop_after(until, "regenerate"):
        return skip_rest("regenerate")

    # vocab
    d = digests.vocab(cfg, data)
    vocab = run_single("vocab", lambda: vocab_task.with_options(**opts("vocab"))(cfg, d, data))
    if _stop_after(until, "vocab"):
        return skip_rest("vocab")

    # a head reading layers the extraction will not hold fails now, not after hours of extraction
    if until != "extract":
        try:
            check_head_layers(cfg)
        except TrainError as exc:
            rec.stages["train"].status, rec.stages["train"].error = "failed", str(exc)
            raise

    # extract: one task per shard, fanned out over GPU groups
    extracted = _run_extract(cfg, store, rec, data, logger)
    shards = extract_shards(store, extracted)
    if _stop_after(until, "extract"):
        return skip_rest("extract")

    # train: one cached task per head of train.heads, each at its own address (made of the shards), from the
    # extract stage's artifact

    heads: list[tuple[str, ArtifactRef]] = []
    t0 = time.time()
    children = child_config(rec) if cfg.train.nodes > 1 else None
    for head in cfg.train.heads:
        hcfg = head_config(cfg, head)
        d = digests.train(hcfg, vocab, shards)
        task_name = "train" if len(cfg.train.heads) == 1 else f"train-{head.label}"
        heads.append((head.label, run_single("train", lambda: train_task.with_options(
            **opts("train"), name=task_name, task_run_name=task_name)(hcfg, d, vocab, extracted, children))))
    if len(heads) > 1:
        r = rec.stages["train"]
        finish_stage(r, t0, [ref for _, ref in heads])
        r.stats = {"heads": ", ".join(f"{label} {ref.digest[:8]} ({ref.stats.get('steps')} steps)"
                                      for label, ref in heads)}
    trained = heads[0][1] if len(heads) == 1 else heads

    try:
        rec.serve = run_serve(head_config(cfg, cfg.train.heads[0]), store, heads[0][1])
    except Exception as exc:  # noqa: BLE001 - the draft is committed either way; `draftline export` prints it too
        logger.warning(f"could not build the draft's vllm serve line: {exc}")
    if _stop_after(until, "train"):
        return skip_rest("train")

    if not cfg.benchmark.enabled:
        rec.stages["benchmark"].status = "skipped"
        return
    d = digests.benchmark(cfg, trained, data)
    bench = run_single("benchmark", lambda: benchmark_task.with_options(**opts("benchmark"))(cfg, d, trained, data))

    report = load_report(store, bench)
    rec.benchmark = report.get("benchmark")
    if report.get("serve"):  # the settings it was measured at (a report from before they were kept: the config's)
        rec.serve = run_serve(cfg, store, heads[0][1], report)
    if len(report.get("heads") or {}) > 1:  # every head's rows, for --json and the terminal
        rec.stages["benchmark"].stats["heads"] = report.get("head_table")
    try:
        publish_summary(report)
    except Exception as exc:  # the figures are in the store either way
        logger.warning(f"could not publish benchmark artifacts to Prefect: {exc}")


def _run_regenerate(cfg: RunConfig, store: Store, rec: RunRecord, prepared: ArtifactRef, digest: str,
                    logger) -> ArtifactRef:
    """Regeneration's shards as tasks over this node's engine groups (and other nodes), then the stage
    artifact assembled from them; the run record counts shards, as extraction's does."""
    r = rec.stages["regenerate"]
    t0 = time.time()
    r.status = "running"
    shards = _run_sharded("regenerate", cfg, store, rec, prepared, resolve_model(cfg.target), logger)
    counts = dict(r.stats)
    try:
        ref = as_ref(regenerate_task.with_options(**stage_options("regenerate", store, digest))(
            cfg, digest, prepared, shards, r.cached, t0))
    except Exception as exc:
        r.status, r.error = "failed", f"{type(exc).__name__}: {exc}"
        raise
    r.seconds = round(time.time() - t0, 1)
    if ref.executed_here and r.status == "cached":
        r.status = "ran"  # every shard was on the store, the stage artifact was not
    r.artifact, r.stats = ref.uri, {**_brief(ref.stats), **counts}
    logger.info(f"regenerate: {r.status} in {r.seconds}s -> {ref.uri}")
    return ref


def _shard_plans(stage: str, cfg: RunConfig, data: ArtifactRef, model: str) -> list:
    """The shards of STAGE (`regenerate` or `extract`) that read DATA, each with its own address."""
    if stage == "regenerate":
        return plan_regenerate(cfg, data)

    return plan_extract(cfg, data, load_hf_config(cfg.target, model))


def _run_extract(cfg: RunConfig, store: Store, rec: RunRecord, data: ArtifactRef, logger) -> ArtifactRef:
    """Extraction's shards as tasks, then the stage's artifact naming them (the one input training takes)."""
    r = rec.stages["extract"]
    r.status = "running"
    t0 = time.time()
    shards = _run_sharded("extract", cfg, store, rec, data, resolve_model(cfg.target), logger)
    ref = assemble_extract(cfg, store, shards, t0, r.cached)
    r.artifact = ref.uri
    return ref


def _run_sharded(stage: str, cfg: RunConfig, store: Store, rec: RunRecord, data: ArtifactRef, model: str,
                 logger) -> list[ArtifactRef]:
    """STAGE's shards (regenerate or extract), one task each, over this node's engine groups and, with
    extract.nodes > 1, over other nodes (flows/nodes.py); the stage's record counts them. Raises when
    a shard failed: `draftline retry` runs only the shards not on the store."""
    kind = SHARDED[stage]
    t0 = time.time()
    plans = _shard_plans(stage, cfg, data, model)

    def here(mine: list, progress: Progress) -> tuple[list[ArtifactRef], list[str]]:
        return _shards_here(stage, cfg, store, model, mine, logger, progress)

    if cfg.extract.nodes > 1:
        return run_nodes(stage, cfg, store, rec, data, plans, logger, t0, here)
    refs, errors = here(plans, Progress(f"{stage}-progress", f"{kind.title}: 0/{len(plans)} shards"))
    return finish_sharded(stage, rec.stages[stage], store, plans, refs, errors, t0, logger)


def _shards_here(stage: str, cfg: RunConfig, store: Store, model: str, plans: list, logger,
                 progress: Progress) -> tuple[list[ArtifactRef], list[str]]:
    """One task per shard of PLANS in this flow run, fanned out over this node's engine groups."""
    kind = SHARDED[stage]
    shard_task = regenerate_shard_task if stage == "regenerate" else extract_task
    t0 = time.time()
    pool = EnginePool.for_purpose(cfg, model, stage)
    if len(pool.groups) > 1:
        logger.info(f"{stage}: {len(plans)} shards over {len(pool.groups)} engines side by side: "
                    + ", ".join(g.name for g in pool.groups))
    done = 0
    tokens = 0
    refs: list[ArtifactRef] = []
    errors: list[str] = []
    try:
        futures = [shard_task.with_options(**stage_options(kind.store_stage, store, p.digest)).submit(
            cfg, p.digest, p.shard, p, pool) for p in plans]
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
                    tokens += int(ref.stats.get(kind.tokens, 0))
                done += 1
            el = max(1e-6, time.time() - t0)
            progress.update(100.0 * done / max(1, len(plans)),
                            f"{kind.title}: {done}/{len(plans)} shards, {len(errors)} failed, "
                            f"{tokens / el:,.0f} {kind.rate} (incl. cached)")
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
    _pin_target(cfg, [])  # the parent pinned target.revision in the overrides: this records it
    logger = get_run_logger()
    allow_remote_code(cfg, logger)
    if stage == "train":
        if not rendezvous or not train_inputs:
            raise RuntimeError("stage=train: a training node needs the rendezvous and train_inputs parameters "
                               "its parent run sends")
        return train_child(cfg, store, rendezvous, train_inputs, logger)
    hit = store.find(data_stage, data_digest)
    if hit is None:
        raise RuntimeError(f"the data this slice reads ({data_stage}/{data_digest}) is not on {store.uri}: "
                           "the parent run and this node must share one s3:// store")
    model = resolve_model(cfg.target)
    want = set(shards or [])
    plans = [p for p in _shard_plans(stage, cfg, hit.ref(), model) if p.shard in want]
    if len(plans) != len(want):
        raise RuntimeError(f"shards {sorted(want - {p.shard for p in plans})} do not exist in {data_stage}/{data_digest}")
    progress = Progress(f"{stage}-progress", f"{SHARDED[stage].title} slice: 0/{len(plans)} shards")
    refs, errors = _shards_here(stage, cfg, store, model, plans, logger, progress)
    summary = {"stage": stage, "shards": sorted(want), "executed": sum(1 for x in refs if x.executed_here),
               "cached": sum(1 for x in refs if not x.executed_here), "failed": len(errors)}
    logger.info(f"{stage} slice: {summary}")
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(plans)} shards of this slice failed: {errors[0]}")
    return summary


def _pin_target(cfg: RunConfig, overrides: list[str]) -> list[str]:
    """The run's target pinned once (a hub id's commit) and recorded in every manifest (tasks/engine/weights.py)."""
    try:
        return pin_run(cfg, overrides)
    except WeightsError as exc:
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
