"""The benchmark stage: the target in vLLM without and with the trained draft.

    ref = run_benchmark(cfg, store, trained, data)     # report.json, report.md, report.png on the store
    report = load_report(store, ref)                   # the figures, with the run that measured them

One session on one machine measures everything that is compared: a baseline
engine (no draft) and one engine per `num_speculative_tokens` k, each serving
every eval and batch size before it is closed (a CPU engine costs 30-40 s to
start; a 1T target many minutes). Per eval, k and batch size:

- mean acceptance length = 1 + accepted / drafts, from the deltas of vLLM's
  spec-decode counters around the measured requests (warm-up excluded);
- per-position acceptance = accepted at position i / drafts (the share of
  drafts whose first i+1 tokens were all accepted), and the draft acceptance
  rate = accepted / draft tokens;
- output tokens/s = output tokens / wall time of the generate calls (at batch
  size 1 that is one stream's speed; batched, the engine's throughput);
- TTFT and TPOT per request from vLLM's own histograms (deltas), with a
  client-side fallback for engines without them;
- speedup = tokens/s with the draft / baseline tokens/s at the same batch size,
  in the same session: reported as measured, also when it is below 1;
- greedy identity with a control: at temperature 0 the outputs must equal the baseline's. The engine
  is not bit-stable across batch shapes itself (vLLM's CPU bf16 decode of a lone sequence rounds
  differently from a batched one), so the baseline engine decodes the same prompts once more (a
  repeat, and another batch shape when only one is measured) and each speculative run is judged
  against that floor: identical, within the engine's own numeric noise, or beyond it (likely a bug).

Beside the measured acceptance length sits the offline estimate from the train
artifact's `val_acc_per_pos` (see `simulated_acceptance_length`); a relative gap
beyond `benchmark.mismatch_threshold` becomes a warning with the usual causes.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import platform
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from tasks import digest as digests
from tasks.acceptance import simulated_acceptance_length
from tasks.benchmark_identity import (
    BEYOND_NOISE,
    IDENTICAL,
    WITHIN_NOISE,
    baseline_floor,
    control_batch_sizes,
    describe_floor,
    identical,
    identity_sentence,
    judge_identity,
)
from tasks.benchmark_replay import offline_replay
from tasks.benchmark_report import MISMATCH_CAUSES, plot_report, report_markdown
from tasks.engine_settings import engine_env, vllm_kwargs
from tasks.config import EvalConfig, RunConfig
from tasks.faults import kill_point
from tasks.store import Artifact, ArtifactRef, Store

STAGE = "benchmark"
SCHEMA = "draftline.benchmark/1"

M_DRAFTS = "vllm:spec_decode_num_drafts"
M_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
M_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
M_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
M_TTFT = "vllm:time_to_first_token_seconds"
M_TPOT = "vllm:request_time_per_output_token_seconds"

DRAFT_FILES = ("draft/config.json", "draft/model.safetensors")
# speculators_model_type of a draft -> the `method` of vLLM's speculative_config that decodes it
VLLM_METHODS = {"eagle3": "eagle3", "dflash": "dflash"}


class BenchmarkError(ValueError):
    """The benchmark cannot run as configured; the message says what to change."""


# =========================================================================== pure math

@dataclass
class SpecCounters:
    """vLLM's cumulative spec-decode counters (or a difference of two snapshots)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)

    @classmethod
    def from_metrics(cls, m: dict[str, Any]) -> "SpecCounters":
        return cls(int(m.get(M_DRAFTS, 0) or 0), int(m.get(M_DRAFT_TOKENS, 0) or 0),
                   int(m.get(M_ACCEPTED, 0) or 0), [int(v) for v in (m.get(M_PER_POS) or [])])

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        n = max(len(self.per_pos), len(other.per_pos))
        a = self.per_pos + [0] * (n - len(self.per_pos))
        b = other.per_pos + [0] * (n - len(other.per_pos))
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted - other.accepted, [x - y for x, y in zip(a, b)])


def acceptance_figures(delta: SpecCounters, k: int) -> dict[str, Any]:
    """Acceptance figures from counter deltas over a measured run with k speculative tokens."""
    if delta.drafts <= 0:
        raise BenchmarkError(
            f"vLLM reported no speculative drafts (k={k}) during the measured requests: the draft was not "
            "used. Check that the engine was started with speculative_config and disable_log_stats=False"
        )
    per_pos = (delta.per_pos + [0] * k)[:k]
    cumulative = [p / delta.drafts for p in per_pos]
    conditional = []
    prev = delta.drafts
    for p in per_pos:
        conditional.append(p / prev if prev > 0 else 0.0)
        prev = p
    return {
        "mean_acceptance_length": 1.0 + delta.accepted / delta.drafts,
        "per_position_acceptance": cumulative,
        "per_position_conditional": conditional,
        "draft_acceptance_rate": delta.accepted / delta.draft_tokens if delta.draft_tokens > 0 else 0.0,
        "drafts": delta.drafts,
        "draft_tokens": delta.draft_tokens,
        "accepted_tokens": delta.accepted,
    }


def histogram_delta(before: dict[str, Any], after: dict[str, Any], name: str) -> tuple[int, float] | None:
    """(count, sum) observed between two metric snapshots, or None when the engine has no such histogram."""
    a, b = after.get(name), before.get(name) or {"count": 0, "sum": 0.0}
    if not isinstance(a, dict):
        return None
    return int(a["count"]) - int(b["count"]), float(a["sum"]) - float(b["sum"])


def relative_difference(measured: float, simulated: float) -> float:
    return (measured - simulated) / simulated if simulated else math.inf


def select_evenly(available: int, want: int) -> list[int]:
    """`want` indices spread evenly over `available` items (MT-Bench is ordered by category)."""
    if want >= available:
        return list(range(available))
    return [(i * available) // want for i in range(want)]


# =========================================================================== prompts

@dataclass
class EvalPrompts:
    name: str
    source: str
    prompts: list[list[int]]
    sample_ids: list[str]
    available: int
    too_long: int = 0
    requested: int = 0

    def summary(self) -> dict[str, Any]:
        lens = [len(p) for p in self.prompts]
        return {"source": self.source, "prompts": len(self.prompts), "requested": self.requested,
                "available": self.available,
                "dropped_too_long": self.too_long,
                "prompt_tokens_mean": round(sum(lens) / max(1, len(lens)), 1), "sample_ids": self.sample_ids}


def first_turn(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The system message (if any) and the first user turn: what every eval asks the target."""
    out = []
    for m in messages:
        if m["role"] == "system" and not out:
            out.append(m)
        elif m["role"] == "user":
            out.append(m)
            return out
    return []


def load_eval_prompts(cfg: RunConfig, store: Store, data: ArtifactRef, ev: EvalConfig,
                      render: Callable[[list[dict]], list[int]]) -> EvalPrompts:
    """Token ids of the first user turn of `ev.num_prompts` conversations, chat-templated with the
    generation prompt. 'heldout' reads the data artifact's heldout.parquet; a source is loaded like
    training data (prompt-only rows allowed)."""
    convs: list[tuple[str, list[dict]]]
    if ev.source == "heldout":
        from tasks.samples import read_samples

        art = store.open(data.stage, data.digest)
        if "heldout.parquet" not in art.files():
            raise BenchmarkError(f"eval {ev.name!r}: {art.uri} has no heldout.parquet; set data.heldout > 0 "
                                 "or drop the 'heldout' eval from benchmark.evals")
        convs = [(s.sample_id, s.messages) for s in read_samples(art, "heldout.parquet")]
        label = f"heldout of {data.stage}/{data.digest[:8]}"
        if not convs:
            raise BenchmarkError(f"eval {ev.name!r}: heldout.parquet is empty; set data.heldout > 0 "
                                 "or drop the 'heldout' eval from benchmark.evals")
    else:
        from tasks.data_sources import load_source

        loaded = load_source(ev.source, keep_thinking=cfg.data.keep_thinking, require_assistant=False,
                             system_prompt=cfg.data.system_prompt, seen=None)
        convs = [(c.sample_id, c.messages) for c in loaded.conversations]
        label = ev.source.label
    limit = cfg.target.max_model_len - cfg.benchmark.max_tokens
    usable: list[tuple[str, list[int]]] = []
    too_long = 0
    for sid, messages in convs:
        turn = first_turn(messages)
        if not turn:
            continue
        ids = render(turn)
        if len(ids) > limit:
            too_long += 1
            continue
        usable.append((sid, ids))
    if not usable:
        raise BenchmarkError(
            f"eval {ev.name!r}: none of {len(convs)} conversations gives a usable prompt ({too_long} longer than "
            f"target.max_model_len - benchmark.max_tokens = {limit} tokens)")
    picked = [usable[i] for i in select_evenly(len(usable), ev.num_prompts)]
    return EvalPrompts(ev.name, label, [p for _, p in picked], [s for s, _ in picked], len(usable), too_long,
                       ev.num_prompts)


# =========================================================================== measuring

@dataclass
class RunResult:
    """One eval at one batch size on one engine."""

    batch_size: int
    outputs: list[list[int]]
    seconds: float
    ttft_ms: float | None
    tpot_ms: float | None
    spec: SpecCounters | None = None

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    def throughput(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "requests": len(self.outputs), "output_tokens": self.output_tokens,
                "seconds": round(self.seconds, 3),
                "output_tokens_per_s": self.output_tokens / self.seconds if self.seconds > 0 else 0.0,
                "tpot_ms": self.tpot_ms, "ttft_ms": self.ttft_ms}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def measure(engine: Any, prompts: list[list[int]], sampling: dict, batch_size: int) -> RunResult:
    """Generate for every prompt, `batch_size` requests per engine call, and time it.

    TTFT/TPOT come from vLLM's per-request histograms (deltas around the run; at batch size 1 one
    request per delta); engines without them get client-side figures (TTFT unknown, TPOT = latency
    per output token).
    """
    outputs: list[list[int]] = []
    wall = 0.0
    ttfts: list[float] = []
    tpots: list[float] = []
    first = engine.metrics()
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        before = engine.metrics() if i else first
        t0 = time.perf_counter()
        outs = engine.generate(chunk, sampling)
        dt_s = time.perf_counter() - t0
        after = engine.metrics()
        wall += dt_s
        got = [list(o["token_ids"]) for o in outs]
        outputs.extend(got)
        ttft = histogram_delta(before, after, M_TTFT)
        tpot = histogram_delta(before, after, M_TPOT)
        if ttft and ttft[0] > 0:
            ttfts.append(1000.0 * ttft[1] / ttft[0])
        if tpot and tpot[0] > 0:
            tpots.append(1000.0 * tpot[1] / tpot[0])
        elif tpot is None:
            n = max(g for g in map(len, got)) if got else 0
            if n:
                tpots.append(1000.0 * dt_s / n)
    last = engine.metrics()
    spec = SpecCounters.from_metrics(last) - SpecCounters.from_metrics(first)
    return RunResult(batch_size, outputs, wall, _mean(ttfts), _mean(tpots), spec)


def spec_figures(run: RunResult, base: RunResult, k: int, temperature: float,
                 simulated: float | None) -> dict[str, Any]:
    """Everything the report says about one eval, k and batch size."""
    out = run.throughput()
    out.update(acceptance_figures(run.spec or SpecCounters(), k))
    b = base.throughput()
    out["baseline_output_tokens_per_s"] = b["output_tokens_per_s"]
    out["baseline_tpot_ms"] = b["tpot_ms"]
    out["baseline_ttft_ms"] = b["ttft_ms"]
    out["speedup"] = out["output_tokens_per_s"] / b["output_tokens_per_s"] if b["output_tokens_per_s"] else None
    if temperature == 0:
        same, firsts = identical(run.outputs, base.outputs)
        out["token_identical"] = same == len(run.outputs) == len(base.outputs)
        out["identical_requests"] = same
        diverged = [f for f in firsts if f is not None]
        out["first_divergence"] = min(diverged) if diverged else None
    else:
        out["token_identical"] = None  # sampling: outputs are not expected to match
        out["identical_requests"] = None
    out["simulated_acceptance_length"] = simulated
    return out


# =========================================================================== greedy identity, with a control


# =========================================================================== engines and the draft

def engine_kwargs(cfg: RunConfig, speculative: dict | None, model_path: str | None = None) -> dict[str, Any]:
    """The decoding engines' settings: the target's (tasks/engine_settings.py), plus the draft."""
    from tasks.target import resolve_model

    extra: dict[str, Any] = {"disable_log_stats": False}  # the spec-decode counters and latency histograms
    if speculative is not None:
        extra["speculative_config"] = speculative
    return vllm_kwargs(cfg, model_path or resolve_model(cfg.target), **extra)


EngineFactory = Callable[[str, dict], Any]  # (name, llm_kwargs) -> an unstarted EngineProcess


def default_engine_factory(cfg: RunConfig, model: str) -> EngineFactory:
    from tasks.engine import EngineProcess

    def make(name: str, llm_kwargs: dict) -> Any:
        return EngineProcess(kind="vllm", model=model, llm_kwargs=llm_kwargs, env=engine_env(cfg), name=name)

    return make


@contextlib.contextmanager
def draft_folder(art: Artifact) -> Iterator[str]:
    """A local folder holding the train artifact's draft/ (verified; a temp copy when the store is remote)."""
    missing = [f for f in DRAFT_FILES if f not in art.files()]
    if missing:
        raise BenchmarkError(f"{art.uri} has no {', '.join(missing)}: not a finished train artifact "
                             "(re-run the train stage)")
    names = art.files("draft/")
    if art.store.is_local:
        for n in names:
            art.verify_file(n)
        yield os.path.dirname(art._key("draft/config.json"))
        return
    with tempfile.TemporaryDirectory(prefix="draftline-draft-") as tmp:
        for n in names:
            dest = Path(tmp, n)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(art.read_bytes(n))
        yield str(Path(tmp, "draft"))


def check_draft(draft_dir: str, target_hf_config: Any) -> dict[str, Any]:
    """The draft's identity, and a clear error when it cannot serve this target."""
    from tasks.target import text_config

    conf = json.loads(Path(draft_dir, "config.json").read_text())
    algo = conf.get("speculators_model_type")
    if algo not in VLLM_METHODS:
        raise BenchmarkError(f"{draft_dir}/config.json is not an EAGLE-3 or DFlash draft "
                             f"(speculators_model_type={algo!r})")
    text = text_config(target_hf_config)
    layer = conf.get("transformer_layer_config") or {}
    if layer.get("hidden_size") not in (None, text.hidden_size):
        raise BenchmarkError(f"the draft was trained for hidden size {layer.get('hidden_size')}, the target has "
                             f"{text.hidden_size}: it belongs to another target (check target.model)")
    if layer.get("vocab_size") not in (None, text.vocab_size):
        raise BenchmarkError(f"the draft maps a {layer.get('vocab_size')}-token vocabulary, the target has "
                             f"{text.vocab_size}: it belongs to another target (check target.model)")
    proposals = (conf.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return {
        "kind": "dflash" if algo == "dflash" else "eagle3.1" if conf.get("fc_norm") else "eagle3",
        "vllm_method": VLLM_METHODS[algo],
        "draft_vocab_size": conf.get("draft_vocab_size"),
        "layer_ids": conf.get("eagle_aux_hidden_state_layer_ids") or conf.get("aux_hidden_state_layer_ids"),
        "block_size": conf.get("block_size"),
        "mask_token_id": conf.get("mask_token_id"),
        "num_layers": layer.get("num_hidden_layers"),
        "trained_speculative_tokens": proposals[0].get("speculative_tokens"),
        "norm_before_residual": conf.get("norm_before_residual"),
        # EAGLE-3.1's options: one norm over the concatenated layers, or one per layer, before the fc;
        # the normed output fed back across steps. vLLM reads them from this config.json.
        "norm_before_fc": conf.get("norm_before_fc"),
        "fc_norm": conf.get("fc_norm"),
        "norm_output": conf.get("norm_output"),
    }


# =========================================================================== offline replay


# =========================================================================== the stage

def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 0
    gpus: list[str] = []
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    load = None
    with contextlib.suppress(OSError, AttributeError):
        load = round(os.getloadavg()[0], 2)
    desc = f"{platform.node()}: {cores} x {cpu}" + (f", {len(gpus)} x {gpus[0]}" if gpus else ", no GPU")
    versions = {}
    for mod in ("vllm", "torch", "speculators"):
        with contextlib.suppress(Exception):
            versions[mod] = __import__(mod).__version__
    return {"machine": desc, "hostname": platform.node(), "cpu": cpu, "cpus": cores, "gpus": gpus,
            "load_avg_1m": load, "versions": versions}


def _log(log: Callable[[str], None] | None, msg: str) -> None:
    if log is not None:
        log(msg)


def engine_error_text(exc: BaseException) -> str:
    """An engine failure as the report shows it: the message, and the root cause from the engine's log
    (the last exception line of vLLM's traceback), verbatim."""
    text = str(exc)
    head = text.split("\n--- engine log", 1)[0].strip()
    tail = getattr(exc, "log_tail", "") or ""
    causes = [ln.strip() for ln in tail.splitlines()
              if re.match(r"^(\(\w+ pid=\d+\) )?[\w.]*(Error|Exception)\b", ln.strip())]
    cause = causes[-1] if causes else ""
    return f"{type(exc).__name__}: {head}" + (f" | root cause: {cause}" if cause and cause not in head else "")


def run_benchmark(cfg: RunConfig, store: Store, trained: ArtifactRef | list[tuple[str, ArtifactRef]],
                  data: ArtifactRef, *, engine_factory: EngineFactory | None = None, flow_run_id: str | None = None,
                  log: Callable[[str], None] | None = None) -> ArtifactRef:
    """Measure the draft(s) against the baseline in vLLM and commit report.json/.md/.png.

    `trained`: the train artifact of the one head, or (label, artifact) per head of train.heads. The first
    head is the report's main draft (`benchmark`, the replay, the warnings); every head gets its rows in
    `heads` and the heads table, measured in the same session against the same baseline. A head whose
    engine vLLM cannot start or run keeps its offline figures, marked offline-only, with the exact error.

    Returns at once when the benchmark for these inputs is already committed. `flow_run_id`
    (default: env PREFECT__FLOW_RUN_ID / DRAFTLINE_FLOW_RUN_ID) is recorded as the run that measured.
    """
    digest = digests.benchmark(cfg, trained, data)
    heads = list(trained) if isinstance(trained, (list, tuple)) else [(cfg.train.heads[0].label, trained)]
    label, trained = heads[0]
    hit = store.find(STAGE, digest)
    if hit is not None:
        return hit.ref()
    from tasks.target import load_hf_config, resolve_model

    b = cfg.benchmark
    if not b.evals:
        raise BenchmarkError("benchmark.evals is empty: add e.g. {name: mtbench, source: {preset: mtbench}}")
    names = [e.name for e in b.evals]
    if len(set(names)) != len(names):
        raise BenchmarkError(f"benchmark.evals names must be unique, got {names}")
    started = time.time()
    measured_by = {"flow_run_id": flow_run_id or os.environ.get("PREFECT__FLOW_RUN_ID")
                   or os.environ.get("DRAFTLINE_FLOW_RUN_ID"),
                   "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **_machine()}
    model = resolve_model(cfg.target)
    hf_config = load_hf_config(cfg.target, model)
    train_art = store.open("train", trained.digest)

    from tasks.chat import make_masker

    # Render prompts exactly as the training answers were asked for (regenerate passes enable_thinking).
    masker = make_masker(cfg, template_kwargs={"enable_thinking": bool(cfg.regenerate.thinking)}
                         if cfg.regenerate.enabled else None)
    evals = [load_eval_prompts(cfg, store, data, ev, masker.prompt_ids) for ev in b.evals]
    for ev in evals:
        _log(log, f"benchmark: eval {ev.name}: {len(ev.prompts)} prompts from {ev.source}")
    sampling = {"max_tokens": b.max_tokens, "temperature": b.temperature, "seed": cfg.data.seed}
    factory = engine_factory or default_engine_factory(cfg, model)
    warmup = evals[0].prompts[0]
    timing: dict[str, Any] = {"engine_start_s": {}, "measure_s": {}}
    controls: dict[str, dict[str, RunResult]] = {}

    def serve(name: str, kwargs: dict, control: bool = False) -> dict[str, dict[int, RunResult]]:
        engine = factory(name, kwargs)
        t0 = time.time()
        try:
            engine.start()
            timing["engine_start_s"][name] = round(time.time() - t0, 1)
            engine.generate([warmup], {"max_tokens": 8, "temperature": 0.0})  # first-call costs stay out
            t1 = time.time()
            res: dict[str, dict[int, RunResult]] = {}
            for ev in evals:
                res[ev.name] = {bs: measure(engine, ev.prompts, sampling, bs) for bs in b.batch_sizes}
            timing["measure_s"][name] = round(time.time() - t1, 1)
            if control:  # the same prompts again, on the same engine: the baseline's own divergence
                t1 = time.time()
                for ev in evals:
                    controls[ev.name] = {f"batch {bs} (repeat)" if bs in b.batch_sizes else f"batch {bs}":
                                         measure(engine, ev.prompts, sampling, bs)
                                         for bs in control_batch_sizes(b.batch_sizes, len(ev.prompts))}
                timing["control_s"] = round(time.time() - t1, 1)
            return res
        finally:
            engine.close()

    with draft_folder(train_art) as draft_dir:
        draft_info = check_draft(draft_dir, hf_config)
        from tasks.target import resolve_layer_ids, text_config

        draft_info["target_num_layers"] = int(text_config(hf_config).num_hidden_layers)
        draft_info["extract_layer_ids"] = resolve_layer_ids(cfg, hf_config)
        _log(log, "benchmark: baseline engine (no draft)")
        baseline = serve("baseline", engine_kwargs(cfg, None, model), control=b.temperature == 0)
        kill_point("benchmark.baseline-measured")
        spec: dict[int, dict[str, dict[int, RunResult]]] = {}
        method = draft_info["vllm_method"]
        for k in b.num_speculative_tokens:
            _log(log, f"benchmark: {label} engine ({method}), k={k}")
            spec[k] = serve(f"{label}-k{k}", engine_kwargs(
                cfg, {"method": method, "model": draft_dir, "num_speculative_tokens": k}, model))
        replayed: dict[str, Any] | None = None
        if b.offline_replay and b.temperature == 0 and method == "eagle3":
            smallest = min(b.batch_sizes)
            t1 = time.time()
            try:
                replayed = offline_replay(cfg, model, draft_dir, draft_info, evals,
                                          {ev.name: baseline[ev.name][smallest].outputs for ev in evals}, log)
                replayed["batch_size"] = smallest
            except Exception as exc:  # a diagnosis must not cost the measured figures
                replayed = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            timing["replay_s"] = round(time.time() - t1, 1)
    others: list[dict[str, Any]] = []
    for other_label, ref in heads[1:]:
        art = store.open("train", ref.digest)
        entry: dict[str, Any] = {"label": other_label, "ref": ref, "train_stats": art.stats, "spec": {},
                                 "errors": {}, "draft": {}}
        others.append(entry)
        with draft_folder(art) as other_dir:
            entry["draft"] = info = check_draft(other_dir, hf_config)
            for k in b.num_speculative_tokens:
                _log(log, f"benchmark: {other_label} engine ({info['vllm_method']}), k={k}")
                try:
                    entry["spec"][k] = serve(f"{other_label}-k{k}", engine_kwargs(
                        cfg, {"method": info["vllm_method"], "model": other_dir, "num_speculative_tokens": k}, model))
                except Exception as exc:  # noqa: BLE001 - vLLM cannot decode this head: keep the error, go on
                    entry["errors"][k] = engine_error_text(exc)
                    _log(log, f"benchmark: {other_label} k={k} could not be measured in vLLM: {entry['errors'][k]}")
    timing["total_s"] = round(time.time() - started, 1)
    with contextlib.suppress(OSError, AttributeError):
        timing["load_avg_1m_end"] = round(os.getloadavg()[0], 2)

    report = assemble_report(cfg, evals, baseline, spec, train_art.stats, draft_info, measured_by, timing,
                             replayed, controls)
    report["heads"] = {label: head_entry(report, label, trained, train_art.stats, draft_info)}
    for entry in others:
        report["heads"][entry["label"]] = other_head(cfg, evals, baseline, controls, entry)
    report["head_table"] = head_table(report)
    for other, h in list(report["heads"].items())[1:]:
        for k, e in h["errors"].items():
            report["warnings"].append(f"{other} ({h['kind']}) k={k}: not measured in vLLM, its figures are offline-only: "
                                      f"{e}")
    report.update({"digest": digest, "uri": store.uri_of(STAGE, digest),
                   "target": {"model": cfg.target.model, "path": model},
                   "draft": {"train_digest": trained.digest, "uri": trained.uri, **draft_info},
                   "data": {"stage": data.stage, "digest": data.digest, "uri": data.uri}})
    png = plot_report(report)
    md = report_markdown(report)
    inputs = {"train": trained.digest, "data": data.digest}
    with store.write(STAGE, digest, digests.VERSIONS[STAGE], inputs,
                     config=json.loads(cfg.benchmark.model_dump_json())) as w:
        w.write_bytes("report.json", json.dumps(report, indent=2, sort_keys=False).encode())
        w.write_bytes("report.md", md.encode())
        w.write_bytes("report.png", png)
        art = w.commit(stats=report_stats(report), run={"flow_run_id": measured_by["flow_run_id"]})
    _log(log, f"benchmark: committed {art.uri} in {timing['total_s']}s")
    return art.ref()


def assemble_report(cfg: RunConfig, evals: list[EvalPrompts], baseline: dict[str, dict[int, RunResult]],
                    spec: dict[int, dict[str, dict[int, RunResult]]], train_stats: dict[str, Any],
                    draft_info: dict[str, Any], measured_by: dict[str, Any],
                    timing: dict[str, Any], replayed: dict[str, Any] | None = None,
                    controls: dict[str, dict[str, RunResult]] | None = None) -> dict[str, Any]:
    """report.json without the addresses (pure: runs on fabricated RunResults in tests).

    `controls`: per eval, extra baseline decodes of the same prompts (label -> run), beside the measured
    batch sizes: together they are the floor the greedy-identity verdicts are judged against."""
    b = cfg.benchmark
    acc = train_stats.get("val_acc_per_pos") or None
    trained_sim = train_stats.get("simulated_acceptance_length")
    if trained_sim is None and acc:
        trained_sim = simulated_acceptance_length(acc)
    sim_by_k = {str(k): simulated_acceptance_length(acc, k) for k in b.num_speculative_tokens} if acc else {}
    extrapolated = [k for k in b.num_speculative_tokens if acc and k > len(acc)]
    largest = max(b.batch_sizes)
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "measured_by": measured_by,
        "settings": {"temperature": b.temperature, "max_tokens": b.max_tokens, "batch_sizes": b.batch_sizes,
                     "num_speculative_tokens": b.num_speculative_tokens,
                     "mismatch_threshold": b.mismatch_threshold},
        "evals": {ev.name: ev.summary() for ev in evals},
        "simulated_acceptance_length": trained_sim,
        "simulated": {"val_acc_per_pos": acc, "by_k": sim_by_k, "extrapolated_k": extrapolated,
                      "formula": "1 + sum_{j=1..k} prod_{i<=j} val_acc_per_pos[i]"},
        "baseline": {},
        "benchmark": {},
        "timing": timing,
    }
    for ev in evals:
        by_bs = {str(bs): baseline[ev.name][bs].throughput() for bs in b.batch_sizes}
        report["baseline"][ev.name] = {**by_bs[str(largest)], "by_batch_size": by_bs}
        report["benchmark"][ev.name] = {}
        for k in b.num_speculative_tokens:
            sim = sim_by_k.get(str(k))
            figs = {str(bs): spec_figures(spec[k][ev.name][bs], baseline[ev.name][bs], k, b.temperature, sim)
                    for bs in b.batch_sizes}
            report["benchmark"][ev.name][str(k)] = {**figs[str(largest)], "by_batch_size": figs}
    if b.temperature == 0:
        report["greedy_identity"] = greedy_identity(cfg, evals, baseline, spec, controls or {})
        for ev, ks in report["greedy_identity"]["verdicts"].items():
            for k, by_bs in ks.items():
                fig = report["benchmark"][ev][k]
                for bs, j in by_bs.items():
                    fig["by_batch_size"][bs]["greedy_identity"] = j["verdict"]
                fig["greedy_identity"] = fig["by_batch_size"][str(largest)]["greedy_identity"]
    if replayed is not None:
        report["replay"] = replayed
    report["draft_checks"] = draft_checks(cfg, draft_info)
    report["comparison"], report["warnings"] = compare(report)
    report["notes"] = notes(report)
    return report


def greedy_identity(cfg: RunConfig, evals: list[EvalPrompts], baseline: dict[str, dict[int, RunResult]],
                    spec: dict[int, dict[str, dict[int, RunResult]]],
                    controls: dict[str, dict[str, RunResult]]) -> dict[str, Any]:
    """Per eval: the baseline's own divergence (every measured batch size and the control decodes), and
    the verdict on each speculative run (each k in `spec`) against the baseline at its batch size with
    that floor."""
    b = cfg.benchmark.model_copy(update={"num_speculative_tokens": [k for k in cfg.benchmark.num_speculative_tokens
                                                                     if k in spec]})
    out: dict[str, Any] = {"control": {}, "verdicts": {}, "lines": []}
    for ev in evals:
        decodes = {f"batch {bs}": baseline[ev.name][bs].outputs for bs in b.batch_sizes}
        decodes.update({label: r.outputs for label, r in (controls.get(ev.name) or {}).items()})
        floor = baseline_floor(decodes)
        out["control"][ev.name] = {**floor, "summary": describe_floor(floor)}
        out["verdicts"][ev.name] = {}
        for k in b.num_speculative_tokens:
            out["verdicts"][ev.name][str(k)] = {}
            for bs in b.batch_sizes:
                j = judge_identity(spec[k][ev.name][bs].outputs, f"batch {bs}", decodes, floor)
                j["sentence"] = identity_sentence(j, floor)
                out["verdicts"][ev.name][str(k)][str(bs)] = j
                out["lines"].append(f"{ev.name} k={k} batch {bs}: {j['sentence']}")
    return out


# =========================================================================== several heads


def head_entry(report: dict[str, Any], label: str, ref: ArtifactRef, train_stats: dict[str, Any],
               info: dict[str, Any]) -> dict[str, Any]:
    """report['heads'][label] of the main head: its figures are the report's own."""
    return {"kind": info.get("kind"), "vllm_method": info.get("vllm_method"), "train_digest": ref.digest,
            "uri": ref.uri, "measured": "vllm", "layer_ids": info.get("layer_ids"), "block_size": info.get("block_size"),
            "steps": train_stats.get("steps"), "val_acc_per_pos": train_stats.get("val_acc_per_pos"),
            "simulated_acceptance_length": report.get("simulated_acceptance_length"),
            "simulated_by_k": (report.get("simulated") or {}).get("by_k") or {}, "errors": {},
            "benchmark": report["benchmark"]}


def other_head(cfg: RunConfig, evals: list[EvalPrompts], baseline: dict[str, dict[int, RunResult]],
               controls: dict[str, dict[str, RunResult]], entry: dict[str, Any]) -> dict[str, Any]:
    """report['heads'][label] of a further head: the same figures against the same baseline for each k vLLM
    ran; for a k it could not run, the error and the offline estimate only."""
    b = cfg.benchmark
    largest = max(b.batch_sizes)
    st, info = entry["train_stats"], entry["draft"]
    acc = st.get("val_acc_per_pos") or None
    sim_by_k = {str(k): simulated_acceptance_length(acc, k) for k in b.num_speculative_tokens} if acc else {}
    errors = {str(k): e for k, e in entry["errors"].items()}
    bench: dict[str, Any] = {ev.name: {} for ev in evals}
    for k, runs in entry["spec"].items():
        try:
            for ev in evals:
                figs = {str(bs): spec_figures(runs[ev.name][bs], baseline[ev.name][bs], k, b.temperature,
                                              sim_by_k.get(str(k))) for bs in b.batch_sizes}
                bench[ev.name][str(k)] = {**figs[str(largest)], "by_batch_size": figs}
        except BenchmarkError as exc:  # vLLM ran it but drafted nothing: as good as not decoding it
            errors[str(k)] = f"BenchmarkError: {exc}"
            for ev in evals:
                bench[ev.name].pop(str(k), None)
    measured = {k: runs for k, runs in entry["spec"].items() if str(k) not in errors}
    if b.temperature == 0 and measured:
        gi = greedy_identity(cfg, evals, baseline, measured, controls)
        for ev, ks in gi["verdicts"].items():
            for k, by_bs in ks.items():
                fig = bench[ev][k]
                for bs, j in by_bs.items():
                    fig["by_batch_size"][bs]["greedy_identity"] = j["verdict"]
                fig["greedy_identity"] = fig["by_batch_size"][str(largest)]["greedy_identity"]
    ref = entry["ref"]
    return {"kind": info.get("kind"), "vllm_method": info.get("vllm_method"), "train_digest": ref.digest,
            "uri": ref.uri, "measured": "vllm" if measured and not errors else "partly" if measured else "offline only",
            "layer_ids": info.get("layer_ids"), "block_size": info.get("block_size"), "steps": st.get("steps"),
            "val_acc_per_pos": acc, "simulated_acceptance_length": st.get("simulated_acceptance_length"),
            "simulated_by_k": sim_by_k, "errors": errors, "benchmark": bench}


def head_table(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per head, eval, k and batch size, every head against the same baseline: what a user picks a
    head from. A k vLLM could not decode with a head gives one row per eval, measured_in 'offline only',
    with the offline estimate and the error."""
    rows = []
    for label, h in (report.get("heads") or {}).items():
        for ev in report.get("evals", {}):
            for k in report["settings"]["num_speculative_tokens"]:
                fig = h["benchmark"].get(ev, {}).get(str(k))
                base = {"head": label, "kind": h["kind"], "eval": ev, "k": int(k),
                        "simulated": h["simulated_by_k"].get(str(k))}
                if fig is None:
                    rows.append({**base, "batch_size": None, "measured_in": "offline only", "acceptance_length": None,
                                 "output_tokens_per_s": None, "speedup": None, "greedy_identity": None,
                                 "error": h["errors"].get(str(k), "not measured")})
                    continue
                for bs, f in fig["by_batch_size"].items():
                    rows.append({**base, "batch_size": int(bs), "measured_in": "vllm",
                                 "acceptance_length": f["mean_acceptance_length"],
                                 "per_position_acceptance": f["per_position_acceptance"],
                                 "output_tokens_per_s": f["output_tokens_per_s"], "speedup": f.get("speedup"),
                                 "greedy_identity": f.get("greedy_identity"), "error": None})
    return rows


def draft_checks(cfg: RunConfig, info: dict[str, Any]) -> list[str]:
    """Problems visible in the draft's config alone."""
    out = []
    ids, want = info.get("layer_ids"), info.get("extract_layer_ids")
    if ids and want and not set(ids) <= set(want[:-1]):
        out.append(f"the draft reads target layers {ids} but the extract stage is configured for {want[:-1]} "
                   f"(+ {want[-1]}): vLLM feeds the draft the layers in ITS config, so a draft trained on other "
                   "layers sees the wrong hidden states; re-export the draft with the extract stage's layer ids")
    n, m = info.get("num_layers"), info.get("target_num_layers")
    if n and m and n > 1 and 2 * n >= m:
        out.append(f"the draft has {n} decoder layers for a {m}-layer target: a draft that deep costs about as much "
                   "as the target per token, so speculation cannot pay off (EAGLE-3 drafts have 1 layer)")
    return out


def compare(report: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Measured vs simulated acceptance per eval/k/batch size, plus the warnings the report must carry."""
    threshold = report["settings"]["mismatch_threshold"]
    extrapolated = set(report["simulated"].get("extrapolated_k") or [])
    rows: list[dict[str, Any]] = []
    warnings: list[str] = []
    mismatched: list[str] = []
    for ev, ks in report["benchmark"].items():
        for k, fig in ks.items():
            sim = fig.get("simulated_acceptance_length")
            for bs, f in fig["by_batch_size"].items():
                meas = f["mean_acceptance_length"]
                row = {"eval": ev, "k": int(k), "batch_size": int(bs), "measured": meas, "simulated": sim,
                       "relative_difference": None, "mismatch": False, "extrapolated": int(k) in extrapolated}
                if sim is not None:
                    rel = relative_difference(meas, sim)
                    row["relative_difference"] = rel
                    row["mismatch"] = abs(rel) > threshold and not row["extrapolated"]
                rows.append(row)
            bad = [r for r in rows if r["eval"] == ev and r["k"] == int(k) and r["mismatch"]]
            if bad:
                got = ", ".join(f"{r['measured']:.2f} at batch {r['batch_size']}" for r in bad)
                mismatched.append(f"{ev} k={k}: measured {got} vs simulated {sim:.2f} "
                                  f"({bad[0]['relative_difference']:+.0%})")
            verdicts = ((report.get("greedy_identity") or {}).get("verdicts") or {}).get(ev, {}).get(k, {})
            beyond = [f"batch {bs}: {j['sentence']}" for bs, j in verdicts.items() if j["verdict"] == BEYOND_NOISE]
            if beyond:
                warnings.append(
                    f"{ev} k={k}: greedy outputs with the draft differ from the baseline's ({'; '.join(beyond)}). "
                    "Speculative decoding must not change greedy outputs beyond the engine's own numeric noise")
    replayed = report.get("replay") or {}
    if replayed.get("error"):
        warnings.append(f"the offline replay (diagnosis only) failed: {replayed['error']}")
    engine_gap = []
    for ev, ks in (replayed.get("by_eval") or {}).items():
        for k, r in ks.items():
            f = report["benchmark"].get(ev, {}).get(k, {}).get("by_batch_size", {}).get(str(replayed["batch_size"]))
            if f and r.get("replayed"):
                rel = relative_difference(f["mean_acceptance_length"], r["replayed"])
                if abs(rel) > threshold:
                    engine_gap.append(f"{ev} k={k}: vLLM {f['mean_acceptance_length']:.2f} vs replay "
                                      f"{r['replayed']:.2f} ({rel:+.0%})")
    if engine_gap:
        warnings.append("vLLM's acceptance differs from the same draft replayed offline on the same greedy outputs: "
                        + "; ".join(engine_gap) + ". That gap is in the engine integration, not in training: check "
                        "the draft's layer ids, norm flags and d2t against what training used")
    warnings.extend(report.get("draft_checks") or [])
    if mismatched:
        warnings.insert(0, f"measured acceptance length differs from the offline estimate by more than "
                           f"{threshold:.0%}: " + "; ".join(mismatched)
                        + ". Usual causes: " + "; ".join(c.split(":")[0] for c in MISMATCH_CAUSES)
                        + " (see report.md)")
    for name, ev in report.get("evals", {}).items():
        if ev.get("dropped_too_long"):
            warnings.append(f"eval {name}: {ev['dropped_too_long']} prompt(s) longer than target.max_model_len - "
                            "benchmark.max_tokens were skipped")
        if ev.get("requested") and ev["prompts"] < ev["requested"]:
            warnings.append(f"eval {name}: asked for {ev['requested']} prompts, only {ev['prompts']} usable")
    return rows, warnings


def notes(report: dict[str, Any]) -> list[str]:
    """Plain statements about the measured speed (no dressing up)."""
    out = []
    for ev, ks in report["benchmark"].items():
        parts = []
        for k, fig in ks.items():
            for bs, f in fig["by_batch_size"].items():
                if f.get("speedup") is not None:
                    parts.append(f"k={k} batch {bs}: {f['speedup']:.2f}x")
        slower = [p for p in parts if float(p.rsplit(" ", 1)[1][:-1]) < 1.0]
        if slower and len(slower) == len(parts):
            out.append(f"{ev}: speculation was SLOWER than plain decoding in every configuration ("
                       + ", ".join(parts) + "). Expected on a CPU, where decoding is compute-bound and "
                       "verifying k+1 tokens costs about k+1 times one token; the same draft pays off on a GPU, "
                       "where decoding is memory-bound.")
        elif parts:
            out.append(f"{ev}: speedup " + ", ".join(parts) + ".")
    return out


def report_stats(report: dict[str, Any]) -> dict[str, Any]:
    """Small per-eval/k figures for the manifest (the full report is report.json)."""
    out: dict[str, Any] = {"simulated_acceptance_length": report.get("simulated_acceptance_length"),
                           "warnings": len(report.get("warnings", []))}
    for ev, ks in report["benchmark"].items():
        for k, f in ks.items():
            out[f"{ev}_k{k}_acceptance_length"] = round(f["mean_acceptance_length"], 4)
            out[f"{ev}_k{k}_tokens_per_s"] = round(f["output_tokens_per_s"], 2)
            if f.get("speedup") is not None:
                out[f"{ev}_k{k}_speedup"] = round(f["speedup"], 4)
    for label, h in list((report.get("heads") or {}).items())[1:]:
        for ev, ks in h["benchmark"].items():
            for k, f in ks.items():
                out[f"{label}_{ev}_k{k}_acceptance_length"] = round(f["mean_acceptance_length"], 4)
        if h["errors"]:
            out[f"{label}_measured"] = h["measured"]
    verdicts = [j["verdict"] for ks in ((report.get("greedy_identity") or {}).get("verdicts") or {}).values()
                for by_bs in ks.values() for j in by_bs.values()]
    if verdicts:  # the worst verdict of the run
        out["greedy_identity"] = max(verdicts, key=[IDENTICAL, WITHIN_NOISE, BEYOND_NOISE].index)
    return out


# =========================================================================== reading reports

def load_report(store: Store, ref: ArtifactRef | str) -> dict[str, Any]:
    """report.json of a committed benchmark artifact (a ref or a digest)."""
    digest = ref if isinstance(ref, str) else ref.digest
    art = store.open(STAGE, digest)
    return art.read_json("report.json")


def find_report(store: Store, target: str) -> dict[str, Any] | None:
    """The report for a benchmark digest (or a unique prefix of one), an artifact URI, or the
    flow run id that measured it; None when there is none."""
    target = target.strip().rstrip("/")
    if "://" in target or "/" in target:
        parts = target.split("/")
        if len(parts) >= 2 and parts[-2] == STAGE:
            target = parts[-1]
        else:
            return None
    with contextlib.suppress(ValueError):
        m = store.manifest(STAGE, target)
        if m is not None:
            return load_report(store, target)
    manifests = store.list(STAGE)
    by_prefix = [m for m in manifests if len(target) >= 6 and m.digest.startswith(target)]
    if len(by_prefix) == 1:
        return load_report(store, by_prefix[0].digest)
    for m in sorted(manifests, key=lambda m: m.created, reverse=True):
        if (m.run or {}).get("flow_run_id") == target:
            return load_report(store, m.digest)
    for m in sorted(manifests, key=lambda m: m.created, reverse=True):
        with contextlib.suppress(Exception):
            rep = load_report(store, m.digest)
            if (rep.get("measured_by") or {}).get("flow_run_id") == target:
                return rep
    return None


# =========================================================================== rendering


