"""What every `draftline` command shares: the consoles (results on stdout, messages on stderr), the one
way a command fails (a red line that names the problem and the fix, exit status 2), the options that mean
the same in every command (`--set`, `--store`, `--json`, a RUN argument that defaults to `last`), and the
checkout's root.

Output that goes to a pipe or a file is not wrapped at 80 columns (rich's width when it cannot ask a
terminal): a URL or a path in a message stays on one line for `grep` and for copying."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console, ConsoleDimensions

from tasks.core.config_load import load_config
from tasks.core.secrets import mask
from tasks.store.artifacts import Store

ROOT = Path(__file__).resolve().parents[1]

def help_paragraphs(doc: str | None) -> str:
    """A docstring as `--help` shows it: its paragraphs (blank-line separated) each one line, which rich wraps to
    the terminal's width; a docstring's own line breaks would cut sentences wherever the source was wrapped."""
    paragraphs = inspect.cleandoc(doc or "").split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs if p.strip())


# The width of output that is not a terminal: wide enough that no line a command prints is folded.
PIPE_WIDTH = 100_000


class _Console(Console):
    """rich's Console, but wide when its stream is not a terminal (and COLUMNS does not say otherwise)."""

    @property
    def size(self) -> ConsoleDimensions:
        dims = super().size
        if self._width is None and not self.is_terminal:
            return ConsoleDimensions(PIPE_WIDTH, dims.height)
        return dims

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self._width, self._height = new_size


console = _Console()
err = _Console(stderr=True)


def fail(msg: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {mask(str(msg))}")  # an error never echoes a credential
    raise typer.Exit(code)


def gb(n: int) -> str:
    """Bytes as gigabytes, one decimal."""
    return f"{n / 1e9:,.1f} GB"


def with_store(overrides: list[str], store: str | None) -> list[str]:
    """`--store URI` is `--set store.uri=URI` (an explicit --set store.uri= after it still wins)."""
    return [f"store.uri={store}", *overrides] if store else list(overrides)


SetOpt = typer.Option([], "--set", "-s", help="Override a config value: --set train.max_steps=50 (repeatable).")

StoreOpt = typer.Option(None, "--store", metavar="URI", help="The store: file://PATH or s3://BUCKET/PREFIX "
                                                              "(the same as --set store.uri=URI).")

JsonOpt = typer.Option(False, "--json", help="Print the result as JSON (for scripts).")

TimeoutOpt = typer.Option(None, "--timeout", metavar="SECONDS",
                          help="With --watch: give up after this many seconds (default: wait as long as it runs).")

RunArg = typer.Argument("last", help="Flow run id (or its first 8+ characters), name, or `last` (the default).")


def load_cfg(config: Optional[Path], overrides: list[str], store: Optional[str] = None):
    """The config with --set and --store applied (a ConfigError ends the command through the app's one
    handler: exit 2 with its problems)."""
    return load_config(config, with_store(overrides, store))


def open_store(cfg, write: bool = True):
    """The config's store, checked: `write=False` for commands that only read it (read-only keys pass); a
    StoreError ends the command through the app's one handler."""
    store = Store.from_config(cfg.store)
    store.check(write=write)
    return store
