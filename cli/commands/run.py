"""`draftline run CONFIG`: the pipeline in this process (cli/local_run.py), its inputs checked first
(tasks/train/preflight.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from cli.console import SetOpt, StoreOpt, fail, load_cfg, open_store, with_store
from cli.local_run import run_here
from tasks.train.preflight import input_problems
from tasks.core.config import STAGES
from tasks.core.stages import check_until


def run(config: Path = typer.Argument(..., help="YAML config, e.g. configs/demo.yaml."),
        overrides: list[str] = SetOpt, store: Optional[str] = StoreOpt,
        until: Optional[str] = typer.Option(None, help=f"Stop after this stage: {', '.join(STAGES)}."),
        as_json: bool = typer.Option(False, "--json", help="Print the run summary as one JSON object.")):
    """Run the pipeline. Finished stages (and shards) are reused from the store."""
    overrides = with_store(overrides, store)
    cfg = load_cfg(config, overrides)
    check_until(until)
    open_store(cfg)
    problems = input_problems(cfg)  # every problem at once, before the flow starts
    if problems:
        fail("\n".join(problems))
    run_here(str(config), list(overrides), until, as_json=as_json)
