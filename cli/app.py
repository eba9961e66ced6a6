"""`draftline`: the command line. Run `draftline --help`.

The app, its one error handler and the commands' registration; each command is a module of cli/commands/."""

from __future__ import annotations

from importlib.metadata import version

from tasks.core.arenas import bound_arenas
from tasks.core.home import apply_env_defaults

apply_env_defaults()  # before Prefect is imported (tasks.core.home.ENV_DEFAULTS says why)
bound_arenas()  # before any thread starts: a local run's flow runs in this process (tasks/core/arenas.py)

import httpx
import typer
from typer.core import TyperGroup

from cli.commands import check, config, deploy, doctor, export, plan, report, run, runs, store, weights
from cli.console import fail, help_paragraphs
from cli.prefect_api import api_problem
from tasks.core.errors import DraftlineError


class _Commands(TyperGroup):
    """Every command's mistakes end the same way: a `DraftlineError` (config, store, target, plan, an
    operation the Prefect server refuses, ...) is printed as one line naming the problem and the fix, exit
    code 2, and so is a Prefect API that cannot be reached (httpx.HTTPError); caught here once, not per
    command."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DraftlineError as exc:
            fail(str(exc))
        except httpx.HTTPError as exc:
            fail(api_problem(exc))


app = typer.Typer(help="Train EAGLE-3 draft heads for vLLM targets, as a resumable Prefect pipeline.",
                  cls=_Commands, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})
config_app = typer.Typer(help="Inspect configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")
store_app = typer.Typer(help="Set up a store.", no_args_is_help=True)
app.add_typer(store_app, name="store")


def _version(value: bool) -> None:
    if value:
        print(f"draftline {version('draftline')}")
        raise typer.Exit()


@app.callback()
def _main(_v: bool = typer.Option(False, "--version", "-V", callback=_version, is_eager=True,
                                  help="Print draftline's version and exit.")):
    pass


def _register(group: typer.Typer, name: str, command) -> None:
    """A command under NAME, its docstring as help paragraphs (lines joined: rich wraps them to the terminal)."""
    group.command(name, help=help_paragraphs(command.__doc__))(command)


_register(config_app, "show", config.show)
_register(store_app, "init", store.init)
for _command in (run.run, store.ls, store.gc, report.report, doctor.doctor, deploy.deploy, deploy.submit, runs.status,
                 runs.retry, runs.ui, runs.logs, plan.plan, weights.weights, export.export, check.check):
    _register(app, _command.__name__, _command)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
