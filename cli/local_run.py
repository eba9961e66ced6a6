"""A pipeline run in this process, as `draftline run` and a local `draftline retry` start it: the flow
runs here, Ctrl-C / SIGTERM stop it within seconds (flows/interrupts.py), and what it did is printed
as a table (or one JSON object), with the benchmark's figures when it measured any.

Exit status: 0 when every stage finished, 1 when one failed, 130 / 143 when stopped by SIGINT / SIGTERM.
"""

from __future__ import annotations

import json
import signal as sig
import time
from typing import Any

import typer
from rich.table import Table

from cli.console import console, err
from flows import interrupts
from flows.run_record import RunRecord, recording
from tasks.benchmark.report import render_terminal
from tasks.benchmark.results import find_report
from tasks.core.config_load import load_config
from tasks.extract.verify import summary_line
from tasks.store.artifacts import Store


def run_here(config_path: str | None, overrides: list[str], until: str | None, *, as_json: bool) -> None:
    """Run the flow with these parameters in this process and print its summary; exits non-zero unless
    it completed."""
    # here, not at the top: the flow imports Prefect, which takes seconds (`run --help` must not wait)
    from flows import pipeline as pl

    t0 = time.monotonic()
    state = None
    with interrupts.stop_on_signals(lambda m: err.print(f"[yellow]{m}[/]")), recording() as runs:
        try:
            state = pl.pipeline(config_path=config_path, overrides=overrides, until=until, return_state=True)
        except BaseException as exc:  # Ctrl-C / SIGTERM (our handler or Prefect's bridge), or a crash
            if interrupts.stop_signal() is None and not isinstance(exc, KeyboardInterrupt):
                raise
    rec = runs[-1] if runs else None
    signum = interrupts.stop_signal()
    if signum is not None or state is None:
        stopped(rec, signum, time.monotonic() - t0, as_json)
    summary = rec.to_json() if rec is not None else {"state": "FAILED", "stages": {}}
    summary["state"] = "COMPLETED" if state.is_completed() else "FAILED"
    if not summary.get("flow_run_id"):
        summary["flow_run_id"] = str(state.state_details.flow_run_id or "")
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        print_summary(summary)
        if summary.get("benchmark"):
            print_benchmark(summary, config_path, overrides)
    if summary["state"] != "COMPLETED":
        if not as_json:
            err.print(f"[bold red]run failed[/]: {state.message or ''}")
        raise typer.Exit(1)


def print_benchmark(summary: dict[str, Any], config_path: str | None, overrides: list[str]) -> None:
    """The benchmark's figures; the stored report names the run that measured them (a cached stage's
    figures are older than this run)."""
    rep = None
    art = (summary.get("stages", {}).get("benchmark") or {}).get("artifact")
    if art:
        try:
            rep = find_report(Store.from_config(load_config(config_path, list(overrides)).store), art)
        except Exception:  # noqa: BLE001 - the figures are printed either way
            rep = None
    render_terminal(summary["benchmark"], console, rep)


def stopped(rec: RunRecord | None, signum: int | None, seconds: float, as_json: bool) -> None:
    """The end of a run stopped by a signal: what was kept, and a clean exit (no process left)."""
    name = sig.Signals(signum).name if signum else "SIGINT"
    left = interrupts.kill_descendants(spare_prefect_server=True)
    summary = rec.to_json() if rec is not None else {"stages": {}}
    summary["state"] = "STOPPED"
    for r in summary["stages"].values():
        if r.get("status") == "running":
            r["status"] = "stopped"
    summary["stopped_by"] = name
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        print_summary(summary)
    err.print(f"[bold yellow]stopped[/] by {name} after {seconds:.1f} s"
              + (f" ({left} leftover process(es) killed)" if left else "")
              + ": committed stages and shards are kept and will be reused; run the same command again to resume")
    raise typer.Exit(interrupts.exit_code(signum or sig.SIGINT))


def print_summary(summary: dict[str, Any]) -> None:
    store = summary.get("store", "")
    table = Table(title=f"draftline run {summary.get('flow_run_id', '')} - {summary.get('state')}",
                  caption=f"artifacts under {store}" if store else None)
    for col in ("stage", "status", "ran", "cached", "failed", "time", "artifact"):
        table.add_column(col, justify="right" if col in ("ran", "cached", "failed", "time") else "left")
    colors = {"ran": "green", "cached": "cyan", "failed": "red", "partial": "yellow", "skipped": "dim",
              "stopped": "yellow"}
    for name, r in summary.get("stages", {}).items():
        st = r.get("status", "")
        table.add_row(name, f"[{colors.get(st, 'white')}]{st}[/]", str(r.get("executed", 0)), str(r.get("cached", 0)),
                      str(r.get("failed", 0)), f"{r.get('seconds', 0):.1f}s",
                      (r.get("artifact") or "").removeprefix(store).lstrip("/"))
    console.print(table)
    verified = ((summary.get("stages", {}).get("extract") or {}).get("stats") or {}).get("verified")
    if verified:
        console.print(f"extraction check: {summary_line(verified)}")
    for name, r in summary.get("stages", {}).items():
        if r.get("error"):
            err.print(f"[red]{name}[/]: {r['error']}")
    serve = summary.get("serve")
    if serve and summary.get("state") != "FAILED" and not summary.get("benchmark"):  # else the report prints it
        console.print("serve the trained draft " + (f"(k={serve['k']}, the best speedup measured, at the measured "
                                                   "engine settings):" if serve.get("measured") else
                                                   f"(not benchmarked: k={serve['k']}, its trained positions):"))
        for line in serve["lines"]:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
