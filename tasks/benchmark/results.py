"""The benchmark's report as data: the measured runs assembled into report.json, the draft heads'
table, and the comparisons, notes and summary stats it carries."""

from __future__ import annotations

import contextlib
from typing import Any

from tasks.formats.acceptance import simulated_acceptance_length
from tasks.benchmark.identity import (
    BEYOND_NOISE,
    IDENTICAL,
    WITHIN_NOISE,
    baseline_floor,
    describe_floor,
    identity_sentence,
    judge_identity,
)
from tasks.benchmark.measure import RunResult, relative_difference, spec_figures
from tasks.benchmark.prompts import EvalPrompts
from tasks.benchmark.report import MISMATCH_CAUSES
from tasks.benchmark import STAGE
from tasks.core.config import RunConfig
from tasks.store.artifacts import ArtifactRef, Store

SCHEMA = "draftline.benchmark/1"


def counting(cfg: RunConfig, draft_info: dict[str, Any]) -> dict[str, Any]:
    """How the report counts, so that a figure can be set beside a published one number for number: acceptance
    length includes the bonus token (the target's own token at every verify step), k, the block size of a block
    head, temperature, thinking on or off in the prompts' chat template, and the batch sizes."""
    thinking = (("on" if cfg.regenerate.thinking else "off") if cfg.regenerate.enabled
                else "the chat template's default (no enable_thinking passed)")
    return {"acceptance_length": "1 + accepted / drafts: vLLM's spec_decode_num_accepted_tokens over "
                                 "spec_decode_num_drafts, plus 1 for the bonus token (included)",
            "bonus_token_included": True, "num_speculative_tokens": cfg.benchmark.num_speculative_tokens,
            "block_size": draft_info.get("block_size"), "temperature": cfg.benchmark.temperature,
            "thinking": thinking, "batch_sizes": cfg.benchmark.batch_sizes}


def assemble_report(cfg: RunConfig, evals: list[EvalPrompts], baseline: dict[str, dict[int, RunResult]],
                    spec: dict[int, dict[str, dict[int, RunResult]]], train_stats: dict[str, Any],
                    draft_info: dict[str, Any], measured_by: dict[str, Any],
                    timing: dict[str, Any], replayed: dict[str, Any] | None = None,
                    controls: dict[str, dict[str, RunResult]] | None = None,
                    data_stats: dict[str, Any] | None = None,
                    vocab_coverage: dict[str, float] | None = None) -> dict[str, Any]:
    """report.json without the addresses (pure: runs on fabricated RunResults in tests).

    `controls`: per eval, extra baseline decodes of the same prompts (label -> run), beside the measured
    batch sizes: together they are the floor the greedy-identity verdicts are judged against.
    `data_stats`: the training data artifact's stats (its length distribution: `training_lengths`);
    `vocab_coverage`: per eval, the share of the target's greedy output tokens inside the draft vocabulary."""
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
                     "num_speculative_tokens": b.num_speculative_tokens, "length_buckets": b.length_buckets,
                     "mismatch_threshold": b.mismatch_threshold, "counting": counting(cfg, draft_info)},
        "evals": {ev.name: {**ev.summary(), "in_distribution": in_distribution(cfg, ev.name),
                            **({"draft_vocab_coverage": vocab_coverage[ev.name]}
                               if vocab_coverage and ev.name in vocab_coverage else {})} for ev in evals},
        "training_lengths": training_lengths(data_stats),
        "simulated_acceptance_length": trained_sim,
        "simulated": {"val_acc_per_pos": acc, "by_k": sim_by_k, "extrapolated_k": extrapolated,
                      "formula": "1 + sum_{j=1..k} prod_{i<=j} val_acc_per_pos[i]",
                      # the same estimate per context-length bucket of the held-out tokens (train stats'
                      # val_by_length; absent from drafts trained before it existed)
                      "by_length": {lb: {"val_tokens": v.get("val_tokens"), "by_k": {
                          str(k): simulated_acceptance_length(v["val_acc_per_pos"], k)
                          for k in b.num_speculative_tokens}} for lb, v in
                          (train_stats.get("val_by_length") or {}).items() if v.get("val_acc_per_pos")}},
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
            figs = {str(bs): spec_figures(spec[k][ev.name][bs], baseline[ev.name][bs], k, b.temperature, sim,
                                          b.length_buckets) for bs in b.batch_sizes}
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


def in_distribution(cfg: RunConfig, eval_name: str) -> bool:
    """Whether an eval is drawn from the training distribution: the held-out samples of the training mix, or
    prompts from one of data.sources. The offline estimate (validation accuracy) is made on that distribution,
    so only such evals can check it; elsewhere a gap is distribution shift, not a bug."""
    ev = next((e for e in cfg.benchmark.evals if e.name == eval_name), None)
    if ev is None:
        return False
    if ev.source == "heldout":
        return True

    def origin(s: Any) -> tuple:
        return (s.preset, s.path, s.hub, s.subset, s.split)

    return any(origin(ev.source) == origin(src) for src in cfg.data.sources)


def head_entry(report: dict[str, Any], label: str, ref: ArtifactRef, train_stats: dict[str, Any],
               info: dict[str, Any]) -> dict[str, Any]:
    """report['heads'][label] of the main head: its figures are the report's own."""
    return {"kind": info.get("kind"), "vllm_method": info.get("vllm_method"), "train_digest": ref.digest,
            "origin": "trained", "uri": ref.uri, "measured": "vllm", "layer_ids": info.get("layer_ids"), "block_size": info.get("block_size"),
            "steps": train_stats.get("steps"), "val_acc_per_pos": train_stats.get("val_acc_per_pos"),
            "simulated_acceptance_length": report.get("simulated_acceptance_length"),
            "simulated_by_k": (report.get("simulated") or {}).get("by_k") or {}, "errors": {},
            "benchmark": report["benchmark"]}


def head_table(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per head, eval, k and batch size, every head against the same baseline: what a user picks a
    head from. A k vLLM could not decode with a head gives one row per eval, measured_in 'offline only',
    with the offline estimate and the error."""
    rows = []
    for label, h in (report.get("heads") or {}).items():
        for ev in report.get("evals", {}):
            for k in report["settings"]["num_speculative_tokens"]:
                fig = h["benchmark"].get(ev, {}).get(str(k))
                base = {"head": label, "origin": h.get("origin", "trained"), "kind": h["kind"], "eval": ev, "k": int(k),
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
    shifted: list[str] = []
    for ev, ks in report["benchmark"].items():
        # reports written before evals carried the flag: only the held-out eval was known to be in distribution
        inside = (report.get("evals", {}).get(ev) or {}).get("in_distribution", ev == "heldout")
        for k, fig in ks.items():
            sim = fig.get("simulated_acceptance_length")
            for bs, f in fig["by_batch_size"].items():
                meas = f["mean_acceptance_length"]
                row = {"eval": ev, "k": int(k), "batch_size": int(bs), "measured": meas, "simulated": sim,
                       "relative_difference": None, "mismatch": False, "extrapolated": int(k) in extrapolated,
                       "in_distribution": inside, "distribution_shift": False}
                if sim is not None:
                    rel = relative_difference(meas, sim)
                    row["relative_difference"] = rel
                    beyond = abs(rel) > threshold and not row["extrapolated"]
                    row["mismatch"], row["distribution_shift"] = beyond and inside, beyond and not inside
                rows.append(row)
            mine = [r for r in rows if r["eval"] == ev and r["k"] == int(k)]
            for flag, out in (("mismatch", mismatched), ("distribution_shift", shifted)):
                bad = [r for r in mine if r[flag]]
                if bad:
                    got = ", ".join(f"{r['measured']:.2f} at batch {r['batch_size']}" for r in bad)
                    out.append(f"{ev} k={k}: measured {got} vs simulated {sim:.2f} "
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
    if shifted:
        inside = [n for n, e in report.get("evals", {}).items() if e.get("in_distribution")]
        warnings.append(
            "out of the training distribution, measured acceptance differs from the offline estimate: "
            + "; ".join(shifted) + ". The estimate comes from held-out samples of the training data, so this gap "
            "is the draft meeting text unlike its training data (distribution shift), expected and no sign of a defect; "
            + (f"the in-distribution eval(s) {', '.join(inside)} check the estimate"
               + (" and differ too (see the warning above)" if mismatched else " and agree with it")
               if inside else "no eval here is drawn from the training data (add {name: heldout, source: heldout} "
               "to benchmark.evals to check the estimate)")
            + ". To raise it, train on text like the eval's (data.sources)")
    for name, ev in report.get("evals", {}).items():
        served = served_length(report, name)
        gap = length_gap(report.get("training_lengths"), served, f"eval {name}'s contexts")
        if gap:
            warnings.append(gap + ": " + LENGTH_FIX)
        if ev.get("short_of_context"):
            warnings.append(f"eval {name}: {ev['short_of_context']} prompt(s) stayed under context_tokens (the "
                            "source ran out of conversations, or target.max_model_len - benchmark.max_tokens is lower)")
        if ev.get("dropped_too_long"):
            warnings.append(f"eval {name}: {ev['dropped_too_long']} prompt(s) longer than target.max_model_len - "
                            "benchmark.max_tokens were skipped")
        if ev.get("requested") and ev["prompts"] < ev["requested"]:
            warnings.append(f"eval {name}: asked for {ev['requested']} prompts, only {ev['prompts']} usable")
    return rows, warnings


LENGTH_FIX = ("train on samples as long as the contexts served: raise data.max_length (and target.max_model_len above it) "
              "and add a source of long conversations, or expect less acceptance at those lengths")


def training_lengths(data_stats: dict[str, Any] | None) -> dict[str, Any] | None:
    """The training data's length distribution from its artifact's stats: samples per context-length bucket and
    the longest sample (stats written before they were recorded: data.max_length as the only bound known)."""
    if not data_stats:
        return None
    return {"length_buckets": data_stats.get("length_buckets"), "longest": data_stats.get("longest"),
            "max_length": data_stats.get("max_length"), "samples": data_stats.get("samples")}


def served_length(report: dict[str, Any], eval_name: str) -> int:
    """The longest context an eval served: its longest prompt plus benchmark.max_tokens."""
    ev = (report.get("evals") or {}).get(eval_name) or {}
    prompt = int(ev.get("prompt_tokens_max") or ev.get("prompt_tokens_mean") or 0)
    return prompt + int((report.get("settings") or {}).get("max_tokens") or 0)


def length_gap(train: dict[str, Any] | None, served: int, what: str) -> str | None:
    """A sentence when contexts of up to `served` tokens reach past every training sample; None when training
    covered them, or nothing is known of its lengths."""
    from tasks.formats.acceptance import LENGTH_BUCKETS, bucket_rank, length_bucket

    if not train:
        return None
    longest = int(train.get("longest") or 0)
    bound = longest or int(train.get("max_length") or 0)
    if not bound or served <= bound:
        return None
    have = train.get("length_buckets") or {}
    empty = [lb for _, lb in LENGTH_BUCKETS[bucket_rank(length_bucket(bound)):bucket_rank(length_bucket(served)) + 1]
             if not have.get(lb)]
    return (f"{what} reach {served:,} tokens, past the longest training sample "
            + (f"({longest:,} tokens" if longest else f"(data.max_length {bound:,}")
            + (f"; no training sample in {', '.join(empty)}" if empty and have else "") + ")")


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
