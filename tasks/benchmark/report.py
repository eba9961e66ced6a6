"""A benchmark report shown: report.md, the PNG plot, the terminal table and headline, and the rows of
Prefect's table artifact. Measuring is tasks/benchmark/stage.py; this module only renders the JSON report it
commits.
"""

from __future__ import annotations

import base64
import io
import math
from typing import Any

from tasks.formats.acceptance import accepted_up_to
from tasks.benchmark.identity import BEYOND_NOISE, IDENTICAL, WITHIN_NOISE

MISMATCH_CAUSES = [
    "layer ids: the draft must be fed the auxiliary layers it was trained on (vLLM id k = output of "
    "decoder layer k-1; the last slot is the final layer BEFORE the norm)",
    "norms: the verifier norm applied to the last hidden state in training must be the one vLLM applies "
    "(norm_before_residual / norm_before_fc / fc_norm / norm_output in the draft's config.json)",
    "vocabulary map: d2t/t2d must come from the same vocab artifact; in training the target is the best "
    "token INSIDE the draft vocabulary, while in vLLM a target token outside it can never be accepted "
    "(see the vocab stage's coverage on eval-like text)",
    "chat template: benchmark prompts and training data must be rendered with the same template "
    "(system prompt, generation prompt, thinking flags)",
    "distribution shift: validation tokens come from the training distribution (e.g. regenerated "
    "chitchat, every assistant turn of long conversations); eval prompts (MT-Bench first turns) differ",
    "teacher forcing and draft-start sampling: held-out accuracy is measured with the true previous tokens "
    "at EVERY position and averaged (an arithmetic mean of the local acceptance length), while vLLM starts a "
    "draft only after each accepted run plus its bonus token, so its figure (tokens / drafts) is a "
    "token-weighted harmonic mean: lower whenever easy and hard stretches alternate, with no bug anywhere. "
    "The offline replay table in report.md measures this part",
]


def _f(x: Any, fmt: str = ".2f", none: str = "-") -> str:
    if x is None:
        return none
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, fmt)


def report_table_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One flat row per eval, k and batch size (plus the baseline rows): for tables and CSV."""
    rows = []
    for ev, base in report.get("baseline", {}).items():
        for bs, f in base["by_batch_size"].items():
            rows.append({"eval": ev, "k": 0, "batch_size": int(bs), "acceptance_length": None,
                         "simulated_acceptance_length": None, "per_position_acceptance": "",
                         "draft_acceptance_rate": None,
                         "output_tokens_per_s": round(f["output_tokens_per_s"], 1), "speedup": 1.0,
                         "tpot_ms": _round(f["tpot_ms"], 2), "ttft_ms": _round(f["ttft_ms"], 1),
                         "token_identical": None, "greedy_identity": None})
    for ev, ks in report.get("benchmark", {}).items():
        for k, fig in ks.items():
            for bs, f in fig["by_batch_size"].items():
                rows.append({
                    "eval": ev, "k": int(k), "batch_size": int(bs),
                    "acceptance_length": round(f["mean_acceptance_length"], 3),
                    "simulated_acceptance_length": _round(f.get("simulated_acceptance_length"), 3),
                    "per_position_acceptance": " ".join(f"{p:.2f}" for p in f["per_position_acceptance"]),
                    "draft_acceptance_rate": round(f["draft_acceptance_rate"], 3),
                    "output_tokens_per_s": round(f["output_tokens_per_s"], 1),
                    "speedup": _round(f.get("speedup"), 3),
                    "tpot_ms": _round(f["tpot_ms"], 2), "ttft_ms": _round(f["ttft_ms"], 1),
                    "token_identical": f.get("token_identical"),
                    "greedy_identity": f.get("greedy_identity"),
                })
    rows.sort(key=lambda r: (r["eval"], r["k"], r["batch_size"]))
    return rows


def _round(x: Any, n: int) -> Any:
    return None if x is None else round(float(x), n)


def counting_line(c: dict[str, Any]) -> str:
    """One sentence of `counting` for report.md and the terminal."""
    if not c:
        return "Counting: not recorded (a report from before it was)."
    block = f", block size {c['block_size']}" if c.get("block_size") else ""
    return (f"Counting: acceptance length = {c['acceptance_length']}; k = {c['num_speculative_tokens']}{block}, "
            f"temperature {c['temperature']}, thinking {c['thinking']}, batch sizes {c['batch_sizes']}.")


def report_markdown(report: dict[str, Any]) -> str:
    """A self-contained markdown report (tables only; the PNG sits beside it as report.png)."""
    mb = report.get("measured_by", {})
    s = report.get("settings", {})
    lines = ["# Draft benchmark", ""]
    lines.append(f"Measured {mb.get('date', '?')} on {mb.get('machine', '?')}"
                 + (f" (1-min load {mb['load_avg_1m']})" if mb.get("load_avg_1m") is not None else "")
                 + (f", flow run `{mb['flow_run_id']}`" if mb.get("flow_run_id") else "") + ".")
    tgt = report.get("target", {}).get("model")
    dr = report.get("draft", {})
    if tgt:
        norms = [n for n in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output") if dr.get(n)]
        lines.append(f"Target `{tgt}`; draft `{dr.get('uri', '?')}` (draft vocabulary {dr.get('draft_vocab_size')}, "
                     f"layer ids {dr.get('layer_ids')}, norms: {', '.join(norms) or 'none'}).")
    lines.append(f"Temperature {s.get('temperature')}, max {s.get('max_tokens')} new tokens, batch sizes "
                 f"{s.get('batch_sizes')}, speculative tokens {s.get('num_speculative_tokens')}.")
    lines.append(counting_line(s.get("counting") or {}))
    lines += serve_markdown(report)
    lines.append("")
    for name, ev in report.get("evals", {}).items():
        cover = ev.get("draft_vocab_coverage")
        lines.append(f"- **{name}**: {ev['prompts']} prompts from {ev['source']} "
                     f"(mean {ev['prompt_tokens_mean']} prompt tokens)"
                     + (f"; the draft vocabulary holds {cover:.1%} of the target's output tokens here (a token "
                        "outside it is never proposed)" if cover is not None else ""))
    lines.append("")
    sim = report.get("simulated_acceptance_length")
    acc = (report.get("simulated") or {}).get("val_acc_per_pos")
    if sim is not None:
        lines.append(f"Offline estimate from training validation: acceptance length **{sim:.2f}** "
                     f"(val accuracy per position {', '.join(f'{a:.3f}' for a in acc or [])}; "
                     f"formula {report['simulated']['formula']}).")
        lines.append("")
    lines += ["## Results", "",
              "| eval | k | batch | accept len | simulated | per-position acceptance | draft accept rate "
              "| tok/s | baseline tok/s | speedup | TPOT ms | TTFT ms | identical |",
              "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    extrap = set((report.get("simulated") or {}).get("extrapolated_k") or [])
    for ev, ks in report.get("benchmark", {}).items():
        for k, fig in ks.items():
            for bs, f in fig["by_batch_size"].items():
                simv = _f(f.get("simulated_acceptance_length")) + ("*" if int(k) in extrap else "")
                ident = identity_cell(f)
                lines.append(
                    f"| {ev} | {k} | {bs} | {f['mean_acceptance_length']:.2f} | {simv} | "
                    f"{' '.join(f'{p:.2f}' for p in f['per_position_acceptance'])} | "
                    f"{f['draft_acceptance_rate']:.2f} | {f['output_tokens_per_s']:.1f} | "
                    f"{f['baseline_output_tokens_per_s']:.1f} | {_f(f.get('speedup'))}x | {_f(f['tpot_ms'], '.1f')} | "
                    f"{_f(f['ttft_ms'], '.1f')} | {ident} |")
    if extrap:
        lines += ["", "\\* k beyond the trained positions: the last position's accuracy is repeated (extrapolated)."]
    lines += lengths_markdown(report)
    lines += heads_markdown(report)
    lines += ["", "## Baseline (no draft)", "", "| eval | batch | tok/s | TPOT ms | TTFT ms | output tokens |",
              "|---|---:|---:|---:|---:|---:|"]
    for ev, base in report.get("baseline", {}).items():
        for bs, f in base["by_batch_size"].items():
            lines.append(f"| {ev} | {bs} | {f['output_tokens_per_s']:.1f} | {_f(f['tpot_ms'], '.1f')} | "
                         f"{_f(f['ttft_ms'], '.1f')} | {f['output_tokens']} |")
    lines += identity_markdown(report)
    lines += replay_markdown(report)
    if report.get("notes"):
        lines += ["", "## Speed", ""] + [f"- {n}" for n in report["notes"]]
    if report.get("warnings"):
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in report["warnings"]]
    if any(r.get("mismatch") for r in report.get("comparison", [])):
        lines += ["", "## Why measured and simulated acceptance differ", "",
                  "The offline estimate multiplies per-position validation accuracies; vLLM measures chained "
                  "acceptance on the eval prompts. Check, in this order:", ""]
        lines += [f"{i}. {c}" for i, c in enumerate(MISMATCH_CAUSES, 1)]
    t = report.get("timing") or {}
    if t:
        reused = {n for n, e in (report.get("engines") or {}).items() if e.get("reused")}
        starts = ", ".join(f"{k} {v}s" + (" (an earlier run's, reused)" if k in reused else "")
                           for k, v in (t.get("engine_start_s") or {}).items())
        lines += ["", f"Benchmark wall time {t.get('total_s')}s (engine starts: {starts}"
                  + (f"; greedy-identity control decodes {t['control_s']}s" if t.get("control_s") is not None else "")
                  + (f"; offline replay {t['replay_s']}s" if t.get("replay_s") is not None else "") + ")."]
    lines += ["", "## How these figures are measured", "", METHOD, ""]
    return "\n".join(lines)


def lengths_markdown(report: dict[str, Any]) -> list[str]:
    """'## Acceptance by context length': vLLM's per-request steps bucketed by the context at each draft
    (benchmark.length_buckets, else the shared buckets), every head's rows, only the buckets that hold drafts, each
    with its requests; beside the main head's, the training samples in the same bucket and the training estimate of
    that bucket's held-out tokens (the one figure over all lengths where the held-out split has no token in the
    bucket, marked *). Buckets other than the training data's have neither ('-')."""
    heads = report.get("heads") or {}
    main = next(iter(heads), "-")
    runs = [(main, report.get("benchmark") or {})] + [(label, h.get("benchmark") or {})
                                                      for label, h in list(heads.items())[1:]]
    rows = [(head, ev, k, f) for head, bench in runs for ev, ks in bench.items() for k, f in ks.items()
            if f.get("by_length")]
    if not rows:
        return []
    from tasks.formats.acceptance import LENGTH_BUCKETS

    shared = {lb for _, lb in LENGTH_BUCKETS}
    train = report.get("training_lengths") or {}
    have = train.get("length_buckets") or {}
    custom = (report.get("settings") or {}).get("length_buckets")
    lines = ["", "## Acceptance by context length", "",
             "Context = prompt + tokens generated when the draft was made; vLLM's own per-request accepted tokens per "
             f"verify step (batch {rows[0][3].get('batch_size')})"
             + (f", in the buckets of benchmark.length_buckets {custom}" if custom else "")
             + "; requests: those that drafted in the bucket (a long answer can span two). Training samples per "
             "bucket from the data artifact" + (f" (longest {train['longest']:,} tokens)" if train.get("longest") else "")
             + "; the training estimate is the held-out split's tokens of the same bucket (* none there: the "
             "estimate over every length); both for the main head, in the training data's buckets only.", "",
             "| head | eval | k | context | accept len | drafts | requests | training samples | simulated |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    sim_by_length = (report.get("simulated") or {}).get("by_length") or {}
    for head, ev, k, f in rows:
        for bucket, m in f["by_length"].items():
            ours = head == main and bucket in shared
            sim = (sim_by_length.get(bucket) or {}).get("by_k", {}).get(str(k))
            sim_text = (_f(sim) if sim is not None else f"{_f(f.get('simulated_acceptance_length'))}*") if ours else "-"
            samples = (have.get(bucket, 0) if have else "?") if ours else "-"
            lines.append(f"| {head} | {ev} | {k} | {bucket} | {m['mean_acceptance_length']:.2f} | {m['drafts']} | "
                         f"{m.get('requests', '-')} | {samples} | {sim_text} |")
    return lines


def serve_markdown(report: dict[str, Any]) -> list[str]:
    """'## Serve this draft': the exact `vllm serve` line (tasks/benchmark/serve.py builds it), at the measured settings."""
    serve = report.get("serve")
    if not serve or not serve.get("lines"):
        return []
    return ["", "## Serve this draft", "",
            f"With the settings it was measured at (k = {serve['k']}, the best speedup measured; the engine "
            "settings of the benchmark's engines):", "", "```", *serve["lines"], "```"]


def heads_markdown(report: dict[str, Any]) -> list[str]:
    """'## Draft heads': every head of train.heads side by side (with one head, nothing: Results is it)."""
    heads = report.get("heads") or {}
    if len(heads) < 2:
        return []
    lines = ["", "## Draft heads", "",
             "Every head trained from the same stored hidden states, and every draft of benchmark.drafts (origin "
             "`benchmark.drafts`: published or exported elsewhere, no offline estimate), measured in this session "
             "against the same baseline. `offline only`: vLLM could not decode with that head; the error is quoted.",
             "", "| head | origin | kind | vLLM method | block size | trained steps | layer ids | simulated AL (train) | "
             "draft |", "|---|---|---|---|---:|---:|---|---:|---|"]
    for label, h in heads.items():
        lines.append(f"| {label} | {h.get('origin', 'trained')} | {h['kind']} | {h.get('vllm_method')} | "
                     f"{h.get('block_size') or '-'} | "
                     f"{_f(h.get('steps'), 'd')} | {h.get('layer_ids')} | {_f(h.get('simulated_acceptance_length'))} | "
                     f"`{h.get('uri')}` |")
    lines += ["", "| head | kind | eval | k | batch | measured in | accept len | per-position acceptance | simulated "
              "| tok/s | speedup | identical |", "|---|---|---|---:|---:|---|---:|---|---:|---:|---:|---|"]
    for r in report.get("head_table") or []:
        same = {IDENTICAL: "yes", WITHIN_NOISE: "noise", BEYOND_NOISE: "NO"}.get(r.get("greedy_identity"), "-")
        per_pos = " ".join(f"{p:.2f}" for p in r.get("per_position_acceptance") or []) or "-"
        lines.append(f"| {r['head']} | {r['kind']} | {r['eval']} | {r['k']} | {r['batch_size'] or '-'} | "
                     f"{r['measured_in']} | {_f(r['acceptance_length'])} | {per_pos} | {_f(r['simulated'])} | "
                     f"{_f(r['output_tokens_per_s'], '.1f')} | {_f(r['speedup'])}x | {same} |")
    errors = [(r["head"], r["k"], r["error"]) for r in report.get("head_table") or [] if r.get("error")]
    for head, k, e in dict.fromkeys(errors):
        lines.append(f"\n- {head} k={k}, vLLM's error: `{e}`")
    return lines


def render_heads(report: dict[str, Any], console: Any) -> None:
    """The heads table in the terminal (with several heads)."""
    from rich.table import Table

    if len(report.get("heads") or {}) < 2:
        return
    table = Table(title="draft heads, one benchmark (same baseline, same session)",
                  caption="AL = mean acceptance length measured in vLLM; sim = offline estimate from training; "
                          "offline only = vLLM could not decode with the head (error below)")
    rows = report.get("head_table") or []
    origin = any(r.get("origin", "trained") != "trained" for r in rows)  # benchmark.drafts beside the heads
    cols = ("head",) + (("origin",) if origin else ()) + ("kind", "eval", "k", "batch", "measured in", "AL", "sim",
                                                          "tok/s", "speedup")
    for col in cols:
        table.add_column(col, justify="left" if col in ("head", "origin", "kind", "eval", "measured in") else "right",
                         no_wrap=col == "head")
    for r in rows:
        where = "[green]vllm[/]" if r["measured_in"] == "vllm" else "[red]offline only[/]"
        table.add_row(r["head"], *([r.get("origin", "trained")] if origin else []), r["kind"], r["eval"], str(r["k"]),
                      str(r["batch_size"] or "-"), where, _f(r["acceptance_length"]), _f(r["simulated"]),
                      _f(r["output_tokens_per_s"], ".1f"), f"{_f(r['speedup'])}x")
    console.print(table)
    errors = [(r["head"], r["k"], r["error"]) for r in report.get("head_table") or [] if r.get("error")]
    for head, k, e in dict.fromkeys(errors):
        console.print(f"[red]{head}[/] k={k}: vLLM could not decode it: {e}")


def identity_cell(f: dict[str, Any]) -> str:
    """The 'identical' column: yes / noise (n/N same) / NO (n/N same), or n/a when sampling."""
    v = f.get("greedy_identity")
    same = f"{f.get('identical_requests')}/{f['requests']} same"
    if v == IDENTICAL or (v is None and f.get("token_identical") is True):
        return "yes"
    if v == WITHIN_NOISE:
        return f"noise ({same})"
    if v == BEYOND_NOISE or f.get("token_identical") is False:
        return f"NO ({same})"
    return "n/a"


def identity_brief(gi: dict[str, Any]) -> list[str]:
    """Terminal lines: per eval, the verdicts that are not 'identical' and the control they rest on."""
    out = []
    for ev, ks in (gi.get("verdicts") or {}).items():
        odd = [(k, bs, j) for k, by_bs in ks.items() for bs, j in by_bs.items() if j["verdict"] != IDENTICAL]
        if not odd:
            out.append(f"greedy identity, {ev}: identical to the baseline everywhere")
            continue
        parts = []
        for k, bs, j in odd:
            what = "within the engine's own noise" if j["verdict"] == WITHIN_NOISE else "[red]BEYOND it: likely a bug[/]"
            parts.append(f"k={k} batch {bs}: {j['differing']} of {j['requests']} differ, {what}")
        out.append(f"greedy identity, {ev}: " + "; ".join(parts) + f" (control: {gi['control'][ev]['summary']})")
    return out


IDENTITY_EXPLAINED = (
    "At temperature 0 speculative decoding must reproduce the target's greedy outputs. The engine itself is not "
    "bit-stable across batch shapes (a different kernel path, different bf16 rounding, a different argmax at a "
    "near-tie), so the baseline decodes the same prompts at every measured batch size and again as a control; "
    "every pair of those decodes is compared below. A speculative output that differs from the baseline at its "
    "batch size is *within the engine's own numeric noise* when it equals the baseline's output at another batch "
    "shape, or parts from every baseline decode only at or after the token where the baseline's own decodes part; "
    "otherwise it *differs beyond it*, which is likely a bug."
)


def identity_markdown(report: dict[str, Any]) -> list[str]:
    gi = report.get("greedy_identity")
    if not gi:
        return []
    lines = ["", "## Greedy identity (temperature 0), against the baseline's own divergence", "", IDENTITY_EXPLAINED,
             "", "The control: the baseline against itself.", "",
             "| eval | baseline decode | against | differing prompts | first divergence (token) |",
             "|---|---|---|---:|---:|"]
    for ev, floor in gi["control"].items():
        for p in floor["pairs"]:
            lines.append(f"| {ev} | {p['a']} | {p['b']} | {p['differing']} of {p['requests']} | "
                         f"{_f(p['first_divergence'], 'd')} |")
    lines += ["", "The verdicts:", ""] + [f"- {line}" for line in gi["lines"]]
    return lines


METHOD = (
    "One engine per configuration (no draft; the draft with k speculative tokens), each serving every eval "
    "and batch size after a warm-up request. Acceptance length = 1 + accepted / drafts from vLLM's "
    "spec-decode counters over the measured requests; per-position acceptance = drafts whose first i tokens "
    "were all accepted / drafts; draft acceptance rate = accepted / drafted tokens. Tokens/s = output tokens "
    "/ wall time of the generate calls (batch 1: one stream; larger batches: throughput). TTFT and TPOT are "
    "vLLM's per-request means. Speedup = tokens/s with the draft / without, same eval, batch size and "
    "session. Timings are only as quiet as the machine: see the load average above."
)


REPLAY_EXPLAINED = (
    "The draft was replayed offline on the baseline's own greedy outputs, with the extract stage's hidden "
    "states. *Every position* starts a draft at each output token: the quantity a validation accuracy "
    "averages. *vLLM's starts* starts one only where vLLM does: at the first output token, then after each "
    "accepted run and its bonus token. Reading the columns left to right: validation -> every position is the "
    "distribution shift between training text and eval text; every position -> vLLM's starts is draft-start "
    "sampling (acceptance per draft is a token-weighted HARMONIC mean of the local acceptance length, the "
    "position average an ARITHMETIC one, so it is lower whenever easy and hard stretches alternate); "
    "vLLM's starts -> measured is the engine (numerics, integration). The last column compares them request by "
    "request (those whose text equals the baseline's): vLLM's own accepted tokens per draft against the replay's; "
    "all of them agree when the served draft proposes what the training-side model proposes (a near-tie decided "
    "otherwise by bf16 numerics can part one)."
)


def replay_markdown(report: dict[str, Any]) -> list[str]:
    rep = report.get("replay")
    if not rep:
        return []
    if rep.get("error"):
        return ["", "## Offline replay", "", f"The offline replay failed: {rep['error']}"]
    sim = (report.get("simulated") or {}).get("by_k") or {}
    bs = str(rep.get("batch_size"))
    lines = ["", "## Where the acceptance goes (offline replay)", "", REPLAY_EXPLAINED, "",
             f"| eval | k | validation estimate | eval text, every position | eval text, vLLM's starts "
             f"| vLLM measured (batch {bs}) | requests vLLM accepted draft by draft as replayed |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for ev, ks in rep.get("by_eval", {}).items():
        for k, r in ks.items():
            meas = report["benchmark"].get(ev, {}).get(k, {}).get("by_batch_size", {}).get(bs, {})
            same = f"{r['same_steps_as_vllm']} of {r['compared']}" if r.get("compared") else "-"
            lines.append(f"| {ev} | {k} | {_f(sim.get(k))} | {_f(r.get('position_average'))} | "
                         f"{_f(r.get('replayed'))} | {_f(meas.get('mean_acceptance_length'))} | {same} |")
    return lines


def plot_report(report: dict[str, Any], dpi: int = 80) -> bytes:
    """PNG: acceptance per position per k (left), speedup per k per batch size (right)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    bench = report.get("benchmark", {})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=dpi)
    styles = ["-", "--", ":", "-."]
    for i, (ev, ks) in enumerate(bench.items()):
        for k, f in ks.items():
            pp = f["per_position_acceptance"]
            ax1.plot(range(1, len(pp) + 1), pp, styles[i % len(styles)], marker="o",
                     label=f"{ev} k={k} (AL {f['mean_acceptance_length']:.2f})")
    acc = (report.get("simulated") or {}).get("val_acc_per_pos")
    if acc:
        cum = accepted_up_to(acc)
        ax1.plot(range(1, len(cum) + 1), cum, "k:", marker="x", label="simulated (validation)")
    kmax = max([len(f["per_position_acceptance"]) for ks in bench.values() for f in ks.values()] + [len(acc or [])])
    ax1.set_xticks(range(1, kmax + 1))
    ax1.set_xlabel("draft position")
    ax1.set_ylabel("share of drafts accepted up to here")
    ax1.set_ylim(0, 1)
    ax1.set_title("Acceptance per position (largest batch)")
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    batch_sizes = [str(b) for b in report.get("settings", {}).get("batch_sizes", [])]
    groups = [(ev, k) for ev, ks in bench.items() for k in ks]
    width = 0.8 / max(1, len(batch_sizes))
    for j, bs in enumerate(batch_sizes):
        vals = [bench[ev][k]["by_batch_size"].get(bs, {}).get("speedup") or 0.0 for ev, k in groups]
        ax2.bar([g + j * width for g in range(len(groups))], vals, width, label=f"batch {bs}")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_xticks([g + width * (len(batch_sizes) - 1) / 2 for g in range(len(groups))])
    ax2.set_xticklabels([f"{ev}\nk={k}" for ev, k in groups], fontsize=7)
    ax2.set_ylabel("tokens/s vs no draft")
    ax2.set_title("Speedup (1.0 = no draft)")
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def plot_data_uri(report: dict[str, Any]) -> str:
    return "data:image/png;base64," + base64.b64encode(plot_report(report, dpi=64)).decode()


def headline(benchmark: dict[str, Any]) -> list[str]:
    """One line per eval: its measured mean acceptance length at each k, at batch size 1 (and batched)."""
    out = []
    for ev, ks in benchmark.items():
        parts = []
        for k, fig in ks.items():
            by_bs = fig.get("by_batch_size") or {str(fig.get("batch_size", "?")): fig}
            als = "/".join(f"{f['mean_acceptance_length']:.2f}" for f in by_bs.values())
            parts.append(f"k={k}: {als}")
        sizes = "/".join(next(iter(ks.values()), {}).get("by_batch_size", {}) or ["?"])
        out.append(f"{ev}: mean acceptance length {', '.join(parts)} (batch size {sizes}, measured in vLLM)"
                   if parts else f"{ev}: no figures")
    return out


def render_terminal(benchmark: dict[str, Any], console: Any, report: dict[str, Any] | None = None) -> None:
    """A rich table of the figures (`benchmark` = report['benchmark']), warnings underneath."""
    from rich.table import Table

    title = "draft benchmark"
    if report and report.get("measured_by"):
        mb = report["measured_by"]
        title += f" (measured {mb.get('date', '?')}" + (f", run {mb['flow_run_id']}" if mb.get("flow_run_id") else "") + ")"
    # A narrow terminal (make, CI, an 80-column ssh) gets the columns that matter, not ellipses.
    wide = (getattr(console, "width", 200) or 200) >= 132
    cols = ["eval", "k", "batch", "AL", "sim", "per position", "tok/s", "base", "speedup", "TPOT ms", "TTFT ms",
            "same"] if wide else ["eval", "k", "batch", "AL", "sim", "tok/s", "base", "speedup", "same"]
    caption = ("AL = mean acceptance length measured in vLLM (sim = offline estimate from training); "
               + ("per position = share of drafts accepted up to each position; " if wide else "")
               + "tok/s vs base(line) = speedup; same = greedy outputs identical to the baseline's (noise = "
               "they differ only as much as the baseline differs from itself across batch shapes)")
    if report:
        caption += ". " + counting_line((report.get("settings") or {}).get("counting") or {})
    table = Table(title=title, caption=caption)
    for col in cols:
        table.add_column(col, justify="left" if col in ("eval", "per position") else "right",
                         no_wrap=col in ("eval", "per position", "speedup"))
    for ev, ks in benchmark.items():
        for k, fig in ks.items():
            by_bs = fig.get("by_batch_size") or {str(fig.get("batch_size", "?")): fig}
            for bs, f in by_bs.items():
                sp = f.get("speedup")
                color = "green" if sp and sp >= 1 else "red"
                ident = identity_cell(f).split(" ")[0]
                ident = {"yes": "[green]yes[/]", "noise": "[yellow]noise[/]", "NO": "[red]NO[/]"}.get(ident, ident)
                cells = {"eval": ev, "k": str(k), "batch": str(bs), "AL": f"{f['mean_acceptance_length']:.2f}",
                         "sim": _f(f.get("simulated_acceptance_length")),
                         "per position": "/".join(f"{p:.2f}" for p in f.get("per_position_acceptance", [])),
                         "tok/s": f"{f['output_tokens_per_s']:.1f}", "base": f"{f['baseline_output_tokens_per_s']:.1f}",
                         "speedup": f"[{color}]{_f(sp)}x[/]", "TPOT ms": _f(f.get("tpot_ms"), ".1f"),
                         "TTFT ms": _f(f.get("ttft_ms"), ".0f"), "same": ident}
                table.add_row(*(cells[c] for c in cols))
    console.print(table)
    for line in headline(benchmark):
        console.print(line)
    if report:
        render_heads(report, console)
        serve = report.get("serve") or {}
        if serve.get("lines"):
            console.print(f"serve this draft (k={serve['k']}, the best speedup measured, at the measured engine "
                          "settings):")
            for line in serve["lines"]:
                console.print(line, markup=False, highlight=False, soft_wrap=True)
        for line in identity_brief(report.get("greedy_identity") or {}):
            console.print(line)
        for w in report.get("warnings", []):
            console.print(f"[yellow]warning[/]: {w}")
        for n in report.get("notes", []):
            console.print(f"[dim]{n}[/]")
