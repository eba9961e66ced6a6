"""`draftline check`: one verdict on a trained draft before the hero run pays for more (tasks/benchmark/evidence.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from cli.console import JsonOpt, SetOpt, StoreOpt, console, fail, load_cfg, open_store
from cli.drafts import resolve_train
from tasks.benchmark.evidence import as_rows, gather
from tasks.engine.target import load_hf_config, resolve_model, text_config

STYLE = {"ok": "green", "warn": "yellow", "fail": "red", "missing": "dim"}


def check(what: str = typer.Argument("last", help="A YAML config (its first head's draft), a train digest (or 6+ "
                                                  "first characters), a flow run id or name, or `last`."),
          store_config: Optional[Path] = typer.Option(None, "--config", help="Config naming the store (default: "
                                                                             "WHAT when it is a config)."),
          overrides: list[str] = SetOpt, store_uri: Optional[str] = StoreOpt,
          head: Optional[str] = typer.Option(None, help="With a config or run of several train.heads: which."),
          as_json: bool = JsonOpt):
    """The evidence the store holds for a trained draft: its stored states checked against the target, its
    vocabulary maps audited, their coverage, training lengths against the lengths benchmarked, and its
    acceptance; each with what to fix. Exits 1 when a check fails (read-only keys are enough)."""
    from_config = what.endswith((".yaml", ".yml")) or Path(what).is_file()
    cfg = load_cfg(Path(what) if from_config and store_config is None else store_config, overrides, store_uri)
    store = open_store(cfg, write=False)
    try:
        digest, report, _ = resolve_train(store, what, cfg if from_config else None, head)
    except (ValueError, LookupError) as exc:
        fail(str(exc))
    vocab_size = None
    if from_config:  # the target's vocabulary, to check the maps' shape against it
        try:
            vocab_size = int(text_config(load_hf_config(cfg.target, resolve_model(cfg.target))).vocab_size)
        except Exception:  # noqa: BLE001 - the maps are still checked against each other
            vocab_size = None
    findings = gather(store, digest, report, vocab_size)
    failed = any(f.status == "fail" for f in findings)
    if as_json:
        print(json.dumps({"train_digest": digest, "store": store.uri, "ok": not failed, "checks": as_rows(findings)},
                         indent=2))
    else:
        table = Table(title=f"draft {digest[:12]} on {store.uri}", show_lines=True)
        for col in ("check", "", "evidence", "fix"):
            table.add_column(col, overflow="fold")
        for f in findings:
            table.add_row(f.check, f"[{STYLE[f.status]}]{f.status}[/]", f.evidence, f.fix)
        console.print(table)
        console.print("verdict: " + ("[red]a check failed: fix it before training more[/]" if failed else
                                      "[green]nothing failed[/] (read the warnings)"))
    if failed:
        raise typer.Exit(1)
