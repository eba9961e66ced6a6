"""What a run shows in the Prefect UI besides its task runs: each stage's progress bar, and the
benchmark report as a table artifact and a markdown artifact with the plot.

`publish_summary(report)` takes report.json (as `tasks.benchmark.results.load_report` returns it),
so a cached benchmark publishes the same figures, with the run that measured them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from tasks.benchmark.report import plot_data_uri, report_markdown, report_table_rows
from tasks.benchmark.results import head_table

TABLE_KEY = "benchmark"
HEADS_KEY = "benchmark-heads"
MARKDOWN_KEY = "benchmark-report"
# the terminal and the Prefect UI (PREFECT_LOGGING_EXTRA_LOGGERS gives "draftline" Prefect's API handler)
log = logging.getLogger("draftline.ui")


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


def publish_summary(report: dict[str, Any]) -> dict[str, Any]:
    """Create the table and markdown artifacts for the current flow run; returns their ids."""
    mb = report.get("measured_by") or {}
    when = f"measured {mb.get('date', '?')}" + (f" by run {mb['flow_run_id']}" if mb.get("flow_run_id") else "")
    serve = (report.get("serve") or {}).get("lines") or []
    table_id = create_table_artifact(
        report_table_rows(report), key=TABLE_KEY,
        description=f"Draft vs baseline in vLLM per eval, k (0 = no draft) and batch size; {when}"
                    + ("\n\nServe the draft:\n\n```\n" + "\n".join(serve) + "\n```" if serve else ""))
    md_id = create_markdown_artifact(
        summary_markdown(report), key=MARKDOWN_KEY,
        description=f"Draft benchmark report ({when})")
    out = {"table": table_id, "markdown": md_id}
    heads = report.get("heads") or {}
    if len(heads) > 1:  # train.heads: every head against the same baseline, one row per head, eval, k, batch
        rows = [{k: (", ".join(f"{x:.3f}" for x in v) if isinstance(v, list) else v) for k, v in r.items()}
                for r in head_table(report)]
        out["heads"] = create_table_artifact(
            rows, key=HEADS_KEY, description=f"Draft heads ({', '.join(heads)}) against one baseline; {when}")
    return out


class Progress:
    """A Prefect progress artifact that tolerates running outside a flow."""

    def __init__(self, key: str, description: str):
        self.id = None
        self.key = key
        self.last = -1.0
        self.warned = False
        for attempt in range(3):  # a busy API may time out once; the bar is worth a second try, not a failed run
            try:
                self.id = create_progress_artifact(0.0, key=key, description=description)
                return
            except Exception as exc:  # noqa: BLE001 - the bar is the UI's view only; the run goes on without it
                from prefect.context import FlowRunContext  # heavy (prefect): only where a bar fails, to tell why

                if FlowRunContext.get() is None:  # outside a flow: no bar to make
                    return
                if attempt < 2:
                    time.sleep(1.0)
                else:
                    log.warning(f"progress bar {key!r} not created in the Prefect UI after 3 tries "
                                f"({type(exc).__name__}: {exc}); the run goes on without it")

    def update(self, pct: float, description: str | None = None) -> None:
        if self.id is None or (pct - self.last < 1.0 and pct < 100.0):
            return
        self.last = pct
        try:
            update_progress_artifact(self.id, min(100.0, pct), description=description)
        except Exception as exc:  # noqa: BLE001 - the bar is the UI's view only; said once, the run goes on
            if not self.warned:
                self.warned = True
                log.warning(f"progress bar {self.key!r} not updated in the Prefect UI ({type(exc).__name__}: {exc}); "
                            "the run goes on, the bar may lag")
