"""What every `draftline` command shares: the consoles (results on stdout, messages on stderr), the one
way a command fails (a red line that names the problem and the fix, exit status 2), the `--set`
option, and the checkout's root."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]


console = Console()
err = Console(stderr=True)


def fail(msg: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {msg}")
    raise typer.Exit(code)


SetOpt = typer.Option([], "--set", "-s", help="Override a config value: --set train.max_steps=50 (repeatable).")
