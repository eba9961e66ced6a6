"""What the flow shows of a benchmark (tasks/store/stages.py `Shown`): the report as a table and a markdown
artifact with the plot, every head's rows when there are several, and the run's figures and `vllm serve` line
for its record. Data only: flows/report_artifacts.py `publish` makes the Prefect artifacts. Built from
report.json (`load_report`), so a cached benchmark shows the same figures, with the run that measured them."""

from __future__ import annotations

from typing import Any

from tasks.benchmark.report import plot_data_uri, report_markdown, report_table_rows
from tasks.benchmark.results import head_table, load_report
from tasks.benchmark.serve import run_serve
from tasks.core.config import RunConfig
from tasks.store.artifacts import Store
from tasks.store.stages import Shown, as_variants

TABLE_KEY = "benchmark"
HEADS_KEY = "benchmark-heads"
MARKDOWN_KEY = "benchmark-report"


def summary_markdown(report: dict[str, Any], embed_plot: bool = True) -> str:
    """report.md with the plot on top: embedded as a data: URI, plus the store path of report.png."""
    md = report_markdown(report)
    head, _, rest = md.partition("\n")  # keep the title first
    plot = ""
    uri = report.get("uri")
    if embed_plot:
        plot += f"\n![acceptance per position and speedup]({plot_data_uri(report)})\n"
    if uri:
        plot += f"\nPlot and full report on the store: `{uri}/` (report.png, report.json, report.md)\n"
    return head + "\n" + plot + rest


def report_shown(report: dict[str, Any]) -> Shown:
    """The report's table and markdown artifacts, and with several heads every head's rows."""
    mb = report.get("measured_by") or {}
    when = f"measured {mb.get('date', '?')}" + (f" by run {mb['flow_run_id']}" if mb.get("flow_run_id") else "")
    serve = (report.get("serve") or {}).get("lines") or []
    out = Shown(
        tables=[(TABLE_KEY, f"Draft vs baseline in vLLM per eval, k (0 = no draft) and batch size; {when}"
                 + ("\n\nServe the draft:\n\n```\n" + "\n".join(serve) + "\n```" if serve else ""),
                 report_table_rows(report))],
        markdown=[(MARKDOWN_KEY, f"Draft benchmark report ({when})", summary_markdown(report))])
    heads = report.get("heads") or {}
    if len(heads) > 1:  # train.heads: every head against the same baseline, one row per head, eval, k, batch
        rows = [{k: (", ".join(f"{x:.3f}" for x in v) if isinstance(v, list) else v) for k, v in r.items()}
                for r in head_table(report)]
        out.tables.append((HEADS_KEY, f"Draft heads ({', '.join(heads)}) against one baseline; {when}", rows))
    return out


def show_benchmark(cfg: RunConfig, store: Store, made: dict[str, Any]) -> Shown:
    """The benchmark stage's `show`: the report in the UI, its figures and the `vllm serve` line at the settings
    it measured (a report from before they were kept: the config's) in the run's record."""
    report = load_report(store, made["benchmark"])
    out = report_shown(report)
    out.record["benchmark"] = report.get("benchmark")
    if report.get("serve"):
        out.record["serve"] = run_serve(cfg, store, as_variants(made["train"])[0][1], report)
    if len(report.get("heads") or {}) > 1:  # every head's rows, for --json and the terminal
        out.stats["heads"] = report.get("head_table")
    return out
