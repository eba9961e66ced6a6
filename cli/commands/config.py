"""`draftline config show`: the resolved config (defaults, then the file, then --set overrides)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from cli.console import SetOpt, StoreOpt, load_cfg
from tasks.core.config_load import dump_config


def show(config: Optional[Path] = typer.Argument(None, help="YAML config (default: built-in defaults)."),
                overrides: list[str] = SetOpt, store: Optional[str] = StoreOpt,
                as_json: bool = typer.Option(False, "--json", help="Print JSON instead of YAML.")):
    """Print the resolved config (defaults, then the file, then --set overrides)."""
    cfg = load_cfg(config, overrides, store)
    if as_json:
        print(cfg.model_dump_json(indent=2))
    else:
        print(dump_config(cfg), end="")
