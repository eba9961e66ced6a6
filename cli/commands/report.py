"""`draftline report CONFIG [RUN|DIGEST]`: a benchmark's report re-rendered from the store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from cli.console import SetOpt, StoreOpt, console, fail, load_cfg, open_store
from tasks.benchmark.report import render_terminal
from tasks.benchmark.results import find_report


def report(config: Optional[Path] = typer.Argument(None, help="Config naming the store (default store otherwise)."),
           target: str = typer.Argument("last", help="A benchmark artifact digest, its URI, a flow run id, or "
                                                     "`last` (the newest benchmark in the store)."),
           old_config: Optional[Path] = typer.Option(None, "--config", "-c", hidden=True,
                                                     help="Deprecated: the config as a positional argument."),
           overrides: list[str] = SetOpt, store_uri: Optional[str] = StoreOpt,
           as_json: bool = typer.Option(False, "--json")):
    """Re-render a benchmark report from the store (read-only keys are enough): `draftline report CONFIG
    [RUN|DIGEST]`."""
    if old_config is not None:  # the old form, `report TARGET -c CONFIG`
        config, target = old_config, str(config) if config is not None else target
    elif config is not None and config.suffix.lower() not in (".yaml", ".yml") and not config.is_file():
        config, target = None, str(config)  # `report DIGEST` on the default store
    cfg = load_cfg(config, overrides, store_uri)
    store = open_store(cfg, write=False)
    if target in ("last", "latest"):
        newest = sorted(store.list("benchmark"), key=lambda m: m.created)
        target = newest[-1].digest if newest else target
    rep = find_report(store, target)
    if rep is None:
        fail(f"no benchmark report for {target!r} in {store.uri}; `draftline ls --stage benchmark` lists them")
    if as_json:
        print(json.dumps(rep, indent=2))
    else:
        render_terminal(rep.get("benchmark", {}), console, rep)
