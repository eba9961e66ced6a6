"""The draftline Prefect flow: prepare -> regenerate -> vocab -> extract[shards] -> train -> benchmark.

Each stage is a thin task around a plain function in tasks/. Tasks are keyed by
their artifact digest (flows/caching.py); the stage functions themselves also
return at once when their artifact is committed, so the store, not Prefect's
database, decides what runs.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.futures import wait
from prefect.task_runners import ThreadPoolTaskRunner

from flows.caching import stage_options
from tasks import stopping
from tasks.config import STAGES, RunConfig, load_config
from tasks.store import ArtifactRef, Store


# --------------------------------------------------------------------------- run record

@dataclass
class StageRecord:
    status: str = "pending"          # pending | ran | cached | partial | failed | skipped
    artifact: str | None = None
    executed: int = 0
    cached: int = 0
    failed: int = 0
    seconds: float = 0.0
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunRecord:
    config_path: str | None
    overrides: list[str]
    flow_run_id: str | None = None
    state: str = "RUNNING"
    stages: dict[str, StageRecord] = field(default_factory=lambda: {s: StageRecord() for s in STAGES})
    benchmark: dict[str, Any] | None = None
    store: str = ""
    started: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        out = {
            "flow_run_id": self.flow_run_id,
            "state": self.state,
            "store": self.store,
            "seconds": round(time.time() - self.started, 1),
            "stages": {
                name: {k: v for k, v in vars(r).items() if k != "stats" or v}
                for name, r in self.stages.items()
            },
        }
        if self.benchmark is not None:
            out["benchmark"] = self.benchmark
        return out


# The CLI reads the record of the run it just started (same process).
LAST_RUN: RunRecord | None = None


def as_ref(value: Any) -> ArtifactRef:
    """Task results are stored as JSON (never pickle); cached ones come back as dicts."""
    return value if isinstance(value, ArtifactRef) else ArtifactRef.model_validate(value)


def _count(record: StageRecord, refs: list[ArtifactRef]) -> None:
    record.executed = sum(1 for r in refs if r.executed_here)
    record.cached = len(refs) - record.executed


def _finish(record: StageRecord, t0: float, refs: list[ArtifactRef], failed: int = 0) -> None:
    _count(record, refs)
    record.failed = failed
    record.seconds = round(time.time() - t0, 1)
    if failed:
        record.status = "failed" if not refs else "partial"
    else:
        record.status = "ran" if record.executed else "cached"


# --------------------------------------------------------------------------- tasks

@task(name="prepare", task_run_name="prepare")
def prepare_task(cfg: RunConfig, digest: str) -> ArtifactRef:
    from tasks.prepare import run_prepare

    return run_prepare(cfg, Store.from_config(cfg.store))


@task(name="regenerate", task_run_name="regenerate")
def regenerate_task(cfg: RunConfig, digest: str, prepared: ArtifactRef) -> ArtifactRef:
    from tasks.engine import EngineProcess
    from tasks.regenerate import run_regenerate
    from tasks.target import resolve_model

    model = resolve_model(cfg.target)

    def engine_factory() -> EngineProcess:
        return regenerate_engine(cfg, model)

    logger = get_run_logger()
    progress = _Progress("regenerate-progress", "Regenerate: shards answered by the target")

    def on_shard(done: int, total: int, stats: dict[str, Any], reused: bool) -> None:
        progress.update(100.0 * done / max(1, total), description=f"{done}/{total} shards")
        if reused:
            logger.info(f"regenerate: shard {done}/{total} reused from the store")
        else:
            secs = float(stats.get("seconds") or 0.0)
            gen = int(stats.get("generated_tokens") or 0)
            rate = f", {gen / secs:.0f} generated tok/s" if secs > 0 else ""
            logger.info(f"regenerate: shard {done}/{total} done: {stats.get('samples', '?')} samples, "
                        f"{gen} generated tokens in {secs:.0f}s{rate}")

    return run_regenerate(cfg, Store.from_config(cfg.store), prepared, engine_factory, on_shard=on_shard)


@task(name="vocab", task_run_name="vocab")
def vocab_task(cfg: RunConfig, digest: str, data: ArtifactRef) -> ArtifactRef:
    from tasks.vocab import run_vocab

    ref = run_vocab(cfg, Store.from_config(cfg.store), data)
    summary = ref.stats.get("summary_md")
    if summary:
        create_markdown_artifact(summary, key="draft-vocabulary", description="Draft vocabulary coverage")
    return ref


@task(name="extract-shard", task_run_name="extract-shard-{shard}", retries=0)
def extract_task(cfg: RunConfig, digest: str, shard: int, plan: Any, pool: "EnginePool") -> ArtifactRef:
    from tasks.extract import extract_shard

    store = Store.from_config(cfg.store)
    hit = store.find("extract", digest)
    if hit is not None:
        return hit.ref()  # never pay for a finished shard twice, even without Prefect's record
    # Fault injection, for tests and recovery drills only (docs/DEPLOY.md): with
    # DRAFTLINE_FAULT_EXTRACT_SHARDS=1,3 those shards raise on their first attempt, for real, before
    # any work; a marker per shard digest (in DRAFTLINE_FAULT_DIR, default the temp folder) lets the
    # next attempt through.
    faulty = os.environ.get("DRAFTLINE_FAULT_EXTRACT_SHARDS", "")
    if str(shard) in {s.strip() for s in faulty.split(",")}:
        import tempfile
        from pathlib import Path

        marker = Path(os.environ.get("DRAFTLINE_FAULT_DIR") or tempfile.gettempdir()) / f"draftline-fault-extract-{digest}"
        if not marker.exists():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
            raise RuntimeError(f"injected fault in extraction shard {shard} (DRAFTLINE_FAULT_EXTRACT_SHARDS={faulty}); "
                               "a retry of the run succeeds")
    with pool.engine() as engine:
        return extract_shard(cfg, store, plan, engine)


@task(name="train", task_run_name="train")
def train_task(cfg: RunConfig, digest: str, vocab: ArtifactRef, shards: list[ArtifactRef]) -> ArtifactRef:
    from tasks.train import run_train

    logger = get_run_logger()
    progress = _Progress("train-progress", "Training steps")

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

    ref = run_train(cfg, Store.from_config(cfg.store), vocab, shards, on_metrics=on_metrics)
    progress.update(100.0)
    acc = ref.stats.get("val_acc_per_pos")
    if acc:
        create_table_artifact(
            [{"position": i + 1, "accuracy": round(a, 4)} for i, a in enumerate(acc)],
            key="train-heldout-accuracy", description="Draft accuracy per TTT position on held-out data")
    return ref


def _train_log_line(m: dict[str, Any]) -> str | None:
    """A log line for a training record: start, every ~5% of the steps, checkpoints, evaluation."""
    kind = m.get("kind")
    if kind == "start":
        resumed = f", resumed from the checkpoint of step {m['resumed_from']}" if m.get("resumed_from") is not None else ""
        return (f"train: {m.get('world_size', 1)} rank(s) on {m.get('device')}, {m.get('attn_impl')} attention, "
                f"{m.get('precision')}, step {m.get('step')}/{m.get('max_steps')}{resumed}")
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
    return None


@task(name="benchmark", task_run_name="benchmark")
def benchmark_task(cfg: RunConfig, digest: str, trained: ArtifactRef, data: ArtifactRef) -> ArtifactRef:
    from prefect.runtime import flow_run

    from tasks.benchmark import run_benchmark

    # The report names the flow run that measured it (PREFECT__FLOW_RUN_ID is set only in deployed runs).
    ref = run_benchmark(cfg, Store.from_config(cfg.store), trained, data, flow_run_id=flow_run.id)
    return ref


# --------------------------------------------------------------------------- engines

def regenerate_engine(cfg: RunConfig, model: str):
    """The engine that answers the prompts (tasks/engine_settings.py: the same rules as every engine)."""
    from tasks.engine_settings import vllm_engine

    return vllm_engine(cfg, model, "regenerate")


class EnginePool:
    """One extraction engine per GPU group, started on first use, shared by shard tasks.

    A shard borrows a group's engine; if the engine died (killed, OOM), the shard
    that was using it fails and the next borrower gets a fresh engine.
    """

    def __init__(self, factory: Callable[[list[int]], Any], groups: list[list[int]]):
        self.factory = factory
        self.groups = groups
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(len(groups)):
            self._free.put(i)
        self._engines: dict[int, Any] = {}
        self._lock = threading.Lock()

    def engine(self):
        pool = self

        class _Borrow:
            def __enter__(self_inner):
                while True:  # every group busy: wait for one, but not past a stop request
                    stopping.check("waiting for a free engine group")
                    try:
                        self_inner.idx = pool._free.get(timeout=0.5)
                        break
                    except queue.Empty:
                        continue
                try:
                    eng = pool._engines.get(self_inner.idx)
                    if eng is None or not eng.alive:
                        if eng is not None:
                            eng.close()
                        eng = pool.factory(pool.groups[self_inner.idx])
                        eng.start()
                        pool._engines[self_inner.idx] = eng
                    return eng
                except BaseException:
                    pool._free.put(self_inner.idx)
                    raise

            def __exit__(self_inner, *exc):
                pool._free.put(self_inner.idx)
                return False

        return _Borrow()

    def close(self) -> None:
        for eng in self._engines.values():
            try:
                eng.close()
            except Exception:
                pass
        self._engines.clear()


class _Progress:
    """A Prefect progress artifact that tolerates running outside a flow."""

    def __init__(self, key: str, description: str):
        self.id = None
        self.last = -1.0
        try:
            self.id = create_progress_artifact(0.0, key=key, description=description)
        except Exception:
            pass

    def update(self, pct: float, description: str | None = None) -> None:
        if self.id is None or (pct - self.last < 1.0 and pct < 100.0):
            return
        self.last = pct
        try:
            update_progress_artifact(self.id, min(100.0, pct), description=description)
        except Exception:
            pass


# --------------------------------------------------------------------------- the flow

def _stop_after(until: str | None, stage: str) -> bool:
    return until is not None and STAGES.index(stage) >= STAGES.index(until)


@flow(name="draftline", log_prints=True, persist_result=False)
def pipeline(config_path: str | None = None, overrides: list[str] | None = None, until: str | None = None) -> dict:
    """Train an EAGLE-3 draft: parameters are a config file path plus `a.b=c` overrides."""
    global LAST_RUN
    from prefect.runtime import flow_run

    from flows.interrupts import chain_into_flow

    chain_into_flow()  # SIGTERM (a worker cancelling, a node shutting down) stops engines and waits first
    overrides = list(overrides or [])
    cfg = load_config(config_path, overrides)
    if until is not None and until not in STAGES:
        raise ValueError(f"--until {until!r}: use one of {', '.join(STAGES)}")
    store = Store.from_config(cfg.store)
    store.check()
    rec = LAST_RUN = RunRecord(config_path=config_path, overrides=overrides, flow_run_id=str(flow_run.id or ""),
                               store=store.uri)
    logger = get_run_logger()
    if cfg.target.trust_remote_code:
        logger.warning("target.trust_remote_code is ON: the target repository's own Python code will run")
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


def _run_stages(cfg: RunConfig, store: Store, rec: RunRecord, until: str | None, logger) -> None:
    from tasks import digest as digests

    def run_single(name: str, fn: Callable[[], ArtifactRef]) -> ArtifactRef:
        r = rec.stages[name]
        t0 = time.time()
        r.status = "running"
        try:
            ref = as_ref(fn())
        except Exception as exc:
            r.status, r.failed, r.error = "failed", 1, f"{type(exc).__name__}: {exc}"
            r.seconds = round(time.time() - t0, 1)
            raise
        _finish(r, t0, [ref])
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

    # regenerate
    data = prepared
    if cfg.regenerate.enabled:
        d = digests.regenerate(cfg, prepared)
        data = run_single("regenerate", lambda: regenerate_task.with_options(**opts("regenerate"))(cfg, d, prepared))
    else:
        rec.stages["regenerate"].status = "skipped"
    if _stop_after(until, "regenerate"):
        return skip_rest("regenerate")

    # vocab
    d = digests.vocab(cfg, data)
    vocab = run_single("vocab", lambda: vocab_task.with_options(**opts("vocab"))(cfg, d, data))
    if _stop_after(until, "vocab"):
        return skip_rest("vocab")

    # extract: one task per shard, fanned out over GPU groups
    shards = _run_extract(cfg, store, rec, data, logger)
    if _stop_after(until, "extract"):
        return skip_rest("extract")

    d = digests.train(cfg, vocab, shards)
    trained = run_single("train", lambda: train_task.with_options(**opts("train"))(cfg, d, vocab, shards))
    if _stop_after(until, "train"):
        return skip_rest("train")

    if not cfg.benchmark.enabled:
        rec.stages["benchmark"].status = "skipped"
        return
    d = digests.benchmark(cfg, trained, data)
    bench = run_single("benchmark", lambda: benchmark_task.with_options(**opts("benchmark"))(cfg, d, trained, data))
    from flows.report_artifacts import publish_summary
    from tasks.benchmark import load_report

    report = load_report(store, bench)
    rec.benchmark = report.get("benchmark")
    try:
        publish_summary(report)
    except Exception as exc:  # the figures are in the store either way
        logger.warning(f"could not publish benchmark artifacts to Prefect: {exc}")


def _run_extract(cfg: RunConfig, store: Store, rec: RunRecord, data: ArtifactRef, logger) -> list[ArtifactRef]:
    from tasks.extract import engine_for_group, engine_groups, plan_extract
    from tasks.target import load_hf_config, resolve_model

    r = rec.stages["extract"]
    t0 = time.time()
    r.status = "running"
    model = resolve_model(cfg.target)
    plans = plan_extract(cfg, data, load_hf_config(cfg.target, model))
    groups = engine_groups(cfg)
    pool = EnginePool(lambda group: engine_for_group(cfg, model, group), groups)
    if len(groups) > 1:
        logger.info(f"extract: {len(plans)} shards over {len(groups)} engines side by side: "
                    + ", ".join(g.name for g in groups))
    progress = _Progress("extract-progress", f"Extraction: 0/{len(plans)} shards")
    done = 0
    tokens = 0
    refs: list[ArtifactRef] = []
    errors: list[str] = []
    try:
        futures = [extract_task.with_options(**stage_options("extract", store, p.digest)).submit(cfg, p.digest, p.shard, p, pool)
                   for p in plans]
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
                    tokens += int(ref.stats.get("tokens", 0))
                done += 1
            el = max(1e-6, time.time() - t0)
            progress.update(100.0 * done / len(plans),
                            f"Extraction: {done}/{len(plans)} shards, {len(errors)} failed, "
                            f"{tokens / el:,.0f} tok/s (incl. cached)")
    finally:
        pool.close()
    refs.sort(key=lambda x: int(x.stats.get("shard", 0)))
    _finish(r, t0, refs, failed=len(errors))
    r.artifact = f"{store.uri}/extract/"
    r.stats = {"shards": len(plans), "tokens": sum(int(x.stats.get("tokens", 0)) for x in refs)}
    if errors:
        r.error = errors[0]
        logger.error(f"extract: {len(errors)} of {len(plans)} shards failed; first error: {errors[0]}")
        raise RuntimeError(f"{len(errors)} of {len(plans)} extraction shards failed (retry runs only those): {errors[0]}")
    logger.info(f"extract: {r.executed} shards ran, {r.cached} cached, in {r.seconds}s")
    return refs


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
