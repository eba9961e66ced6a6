"""Each benchmark engine's measurements, committed as soon as that engine closes: a benchmark killed after
the baseline and some heads (a node preempted, a start that ran out of memory) measures only the rest when it
runs again, and its report is the one it would have made (a Kimi-K2.5 engine takes ~12 minutes to start).

    address = engine_address(cfg, kwargs, measured, evals, draft)   # what determines the figures
    done = load_engine_run(store, address)                          # an EngineRun, or None
    commit_engine_run(store, address, EngineRun(results, controls, timing), name)

`EngineSession.serve` is that rule as the stage applies it to each engine it needs: reuse, or start, measure,
close and commit.

One small artifact per engine, `benchmark-engine/DIGEST/engine.json`: per eval and batch size the RunResult
(outputs, seconds, latencies, spec-decode counters, per-request steps), the baseline's control decodes, and the
engine's start and measure seconds. The address (tasks/address/digests.py `benchmark_engine`) holds the target,
the engine's arguments with the draft named by its address (the train artifact's digest, or a published draft's
content digest), the prompts, sampling, batch sizes and controls, the engine's environment, and the machine kind
and the vLLM/torch releases: figures from another machine or release are measured again, never compared. The
baseline is one engine for every head. An engine that failed is not committed: the next run tries it again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from typing import Any, Callable

from tasks.address import digests
from tasks.benchmark.identity import control_batch_sizes
from tasks.benchmark.measure import RunResult, SpecCounters, measure
from tasks.core.faults import kill_point
from tasks.engine.settings import engine_env
from tasks.store.artifacts import Store

# the terminal and the Prefect UI (PREFECT_LOGGING_EXTRA_LOGGERS gives "draftline" Prefect's API handler; the
# console is the root's, whose WARNING level would drop this INFO note unless the logger says INFO itself)
log = logging.getLogger("draftline.benchmark")
if log.level == logging.NOTSET:
    log.setLevel(logging.INFO)
ENGINE_FILE = "engine.json"
# the parts of the stage's machine description that make figures comparable (not its host name or load)
MACHINE_KEYS = ("cpu", "cpus", "gpus", "versions")


@dataclasses.dataclass
class EngineRun:
    """What one engine measured: {eval: {batch size: RunResult}}, the baseline's control decodes
    ({eval: {label: RunResult}}), and its seconds (start_s, measure_s, control_s)."""

    results: dict[str, dict[int, RunResult]]
    controls: dict[str, dict[str, RunResult]]
    timing: dict[str, float | None]
    uri: str = ""
    created: str = ""


def _run_json(r: RunResult) -> dict[str, Any]:
    return dataclasses.asdict(r)


def _run_of(d: dict[str, Any]) -> RunResult:
    spec = d.get("spec")
    return RunResult(**{**d, "spec": SpecCounters(**spec) if spec is not None else None})


def prompts_digest(evals: list[Any]) -> str:
    """sha256 of every eval's name and prompt token ids, in order (the warm-up prompt is the first one)."""
    blob = json.dumps([[ev.name, ev.prompts] for ev in evals], separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def draft_named(kwargs: dict[str, Any], draft: str | None) -> dict[str, Any]:
    """vllm.LLM arguments with speculative_config's local `model` folder (a fresh copy, gone after the run) replaced
    by `draft`, the draft's address: what addresses and reports record."""
    if not kwargs.get("speculative_config"):
        return kwargs
    return {**kwargs, "speculative_config": {**kwargs["speculative_config"], "model": draft}}


def engine_address(cfg: Any, kwargs: dict[str, Any], measured: dict[str, Any], evals: list[Any],
                   draft: str | None, machine: dict[str, Any]) -> str:
    """The address of one engine's measurements: `kwargs` its vllm.LLM arguments (speculative_config's local
    `model` folder replaced by `draft`, the draft's address), `measured` what it decoded besides the prompts
    (sampling, batch sizes, controls, environment), `machine` the stage's machine description."""
    engine = draft_named(json.loads(json.dumps(kwargs, default=str)), draft)
    measured = {**measured, "machine": {k: machine.get(k) for k in MACHINE_KEYS}}
    return digests.benchmark_engine(cfg, engine, measured, prompts_digest(evals), draft)


def load_engine_run(store: Store, address: str) -> EngineRun | None:
    """The committed measurements at `address`, or None (none committed, or unreadable: measured again)."""
    art = store.find(digests.BENCHMARK_ENGINE, address)
    if art is None:
        return None
    try:
        d = art.read_json(ENGINE_FILE)
        results = {ev: {int(bs): _run_of(r) for bs, r in by_bs.items()} for ev, by_bs in d["results"].items()}
        controls = {ev: {label: _run_of(r) for label, r in by_label.items()}
                    for ev, by_label in d["controls"].items()}
    except Exception:  # noqa: BLE001 - a file another release wrote differently: measure again
        return None
    return EngineRun(results, controls, dict(d.get("timing") or {}), art.uri, art.manifest.created)


def commit_engine_run(store: Store, address: str, run: EngineRun, name: str, draft: str | None) -> str:
    """Commit one engine's measurements at `address` (`name`: the engine's name in the report, `draft` the
    draft's address or None for the baseline); returns its uri."""
    body = {"engine": name, "timing": run.timing,
            "results": {ev: {str(bs): _run_json(r) for bs, r in by_bs.items()} for ev, by_bs in run.results.items()},
            "controls": {ev: {label: _run_json(r) for label, r in by_label.items()}
                         for ev, by_label in run.controls.items()}}
    inputs = {"draft": draft} if draft else {}
    with store.write(digests.BENCHMARK_ENGINE, address, digests.VERSIONS["benchmark"], inputs) as w:
        w.write_bytes(ENGINE_FILE, json.dumps(body, separators=(",", ":")).encode())
        art = w.commit(stats={"engine": name, **run.timing})
    return art.uri


class EngineSession:
    """The engines of one benchmark: each started (or its committed figures reused), warmed up, measured on every
    eval at every batch size (the baseline also its control decodes), closed and committed. It keeps what the
    report says of them: `engines` (why each ran and the vllm.LLM arguments it ran with), `timing`, `controls`."""

    def __init__(self, cfg: Any, store: Store, evals: list[Any], sampling: dict[str, Any],
                 factory: Callable[[str, dict], Any], measured_by: dict[str, Any], say: Callable[[str], None]):
        """SAY gets the one line a reused engine is noted with."""
        self.cfg, self.store, self.evals, self.sampling, self.factory = cfg, store, evals, sampling, factory
        self.measured_by, self.say = measured_by, say
        self.warmup = evals[0].prompts[0]
        self.timing: dict[str, Any] = {"engine_start_s": {}, "measure_s": {}}
        self.controls: dict[str, dict[str, RunResult]] = {}
        self.engines: dict[str, dict[str, Any]] = {}

    def serve(self, name: str, kwargs: dict, control: bool = False, why: str = "",
              draft: str | None = None) -> dict[str, dict[int, RunResult]]:
        """ENGINE NAME's figures per eval and batch size: measured now, or reused from a run that committed them
        (one killed later: its engine is not started again). DRAFT names the draft by its address."""
        b, timing = self.cfg.benchmark, self.timing
        measured = {"sampling": self.sampling, "batch_sizes": b.batch_sizes, "env": engine_env(self.cfg),
                    "controls": control and {ev.name: control_batch_sizes(b.batch_sizes, len(ev.prompts))
                                             for ev in self.evals}}
        address = engine_address(self.cfg, kwargs, measured, self.evals, draft, self.measured_by)
        done = load_engine_run(self.store, address)
        recorded = draft_named(kwargs, draft) if draft else kwargs  # the report names the draft by its address
        if done is not None:
            self.engines[name] = {"why": why, "args": recorded, "start_s": done.timing.get("start_s"),
                                  "reused": done.uri}
            timing["engine_start_s"][name] = done.timing.get("start_s")
            timing["measure_s"][name] = done.timing.get("measure_s")
            if control:
                self.controls.update(done.controls)
                timing["control_s"] = done.timing.get("control_s")
            self.say(f"benchmark: {name}: reused {done.uri} (measured {done.created}), no engine started")
            return done.results
        engine = self.factory(name, kwargs)
        self.engines[name] = {"why": why, "args": recorded}
        res, mine = self._measure(engine, name, control)
        commit_engine_run(self.store, address, EngineRun(res, mine, {
            "start_s": timing["engine_start_s"][name], "measure_s": timing["measure_s"][name],
            "control_s": timing.get("control_s") if control else None}), name, draft)
        kill_point("benchmark.engine-committed")
        return res

    def _measure(self, engine: Any, name: str, control: bool) -> tuple[dict, dict]:
        b, timing = self.cfg.benchmark, self.timing
        mine: dict[str, dict[str, RunResult]] = {}
        t0 = time.time()
        try:
            engine.start()
            timing["engine_start_s"][name] = self.engines[name]["start_s"] = round(time.time() - t0, 1)
            engine.generate([self.warmup], {"max_tokens": 8, "temperature": 0.0})  # first-call costs stay out
            t1 = time.time()
            res: dict[str, dict[int, RunResult]] = {}
            for ev in self.evals:
                res[ev.name] = {bs: measure(engine, ev.prompts, self.sampling, bs) for bs in b.batch_sizes}
            timing["measure_s"][name] = round(time.time() - t1, 1)
            if control:  # the same prompts again, on the same engine: the baseline's own divergence
                t1 = time.time()
                for ev in self.evals:
                    mine[ev.name] = {f"batch {bs} (repeat)" if bs in b.batch_sizes else f"batch {bs}":
                                     measure(engine, ev.prompts, self.sampling, bs)
                                     for bs in control_batch_sizes(b.batch_sizes, len(ev.prompts))}
                timing["control_s"] = round(time.time() - t1, 1)
                self.controls.update(mine)
        finally:
            engine.close()
        return res, mine

