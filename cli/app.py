"""`draftline`: the command line. Run `draftline --help`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

# Before Prefect is imported: a fresh Prefect home migrates its database slowly on
# small machines, and nothing here should phone home.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# draftline's own loggers (locks, engines, training) reach the terminal and the Prefect UI.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "draftline")

import typer
from rich.table import Table
from typer.core import TyperGroup

from cli.commands import check, deploy, doctor, export, runs, weights
from tasks.cost import plan
from cli.console import load_cfg, open_store, JsonOpt, SetOpt, StoreOpt, console, err, fail, with_store
from tasks.core.config import STAGES, check_stage, check_until, dump_config, load_config
from tasks.core.errors import DraftlineError



class _Commands(TyperGroup):
    """Every command's mistakes end the same way: a `DraftlineError` (config, store, target, plan, ...) is
    printed as one line naming the problem and the fix, exit code 2; caught here once, not per command."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DraftlineError as exc:
            fail(str(exc))


app = typer.Typer(help="Train EAGLE-3 draft heads for vLLM targets, as a resumable Prefect pipeline.",
                  cls=_Commands, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})
config_app = typer.Typer(help="Inspect configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")
store_app = typer.Typer(help="Set up a store.", no_args_is_help=True)
app.add_typer(store_app, name="store")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"draftline {version('draftline')}")
        raise typer.Exit()


@app.callback()
def _main(_v: bool = typer.Option(False, "--version", "-V", callback=_version, is_eager=True,
                                  help="Print draftline's version and exit.")):
    pass


def _check_inputs(cfg) -> None:
    """flows/preflight.py's checks, every problem at once."""
    from flows.preflight import input_problems

    problems = input_problems(cfg)
    if problems:
        fail("\n".join(problems))




@config_app.command("show")
def config_show(config: Optional[Path] = typer.Argument(None, help="YAML config (default: built-in defaults)."),
                overrides: list[str] = SetOpt, store: Optional[str] = StoreOpt,
                as_json: bool = typer.Option(False, "--json", help="Print JSON instead of YAML.")):
    """Print the resolved config (defaults, then the file, then --set overrides)."""
    cfg = load_cfg(config, overrides, store)
    if as_json:
        print(cfg.model_dump_json(indent=2))
    else:
        print(dump_config(cfg), end="")


@app.command()
def run(config: Path = typer.Argument(..., help="YAML config, e.g. configs/demo.yaml."),
        overrides: list[str] = SetOpt, store: Optional[str] = StoreOpt,
        until: Optional[str] = typer.Option(None, help=f"Stop after this stage: {', '.join(STAGES)}."),
        as_json: bool = typer.Option(False, "--json", help="Print the run summary as one JSON object.")):
    """Run the pipeline. Finished stages (and shards) are reused from the store."""
    overrides = with_store(overrides, store)
    cfg = load_cfg(config, overrides)
    check_until(until)
    open_store(cfg)
    _check_inputs(cfg)
    from cli.local_run import run_here

    run_here(str(config), list(overrides), until, as_json=as_json)


@app.command("ls")
def ls(config: Optional[Path] = typer.Argument(None, help="Config whose store to list (default store otherwise)."),
       overrides: list[str] = SetOpt, store_uri: Optional[str] = StoreOpt,
       stage: Optional[str] = typer.Option(None, help="Only this stage."),
       as_json: bool = JsonOpt):
    """List committed artifacts in the store (read-only keys are enough)."""
    cfg = load_cfg(config, overrides, store_uri)
    check_stage(stage, "--stage")
    store = open_store(cfg, write=False)
    if as_json:
        print(json.dumps([{**m.model_dump(mode="json", exclude={"config"}), "uri": store.uri_of(m.stage, m.digest),
                           "bytes": sum(f.bytes for f in m.files)} for m in store.list(stage)], indent=2))
        return
    console.print(f"committed artifacts in {store.uri}")  # not a table title: those fold at the table's width
    table = Table()
    for col in ("stage", "digest", "created", "files", "bytes", "stats"):
        table.add_column(col)
    trained = []
    for m in store.list(stage):
        size = sum(f.bytes for f in m.files)
        brief = ", ".join(f"{k}={v}" for k, v in m.stats.items() if isinstance(v, (int, float, str)) and len(str(v)) < 24)
        table.add_row(m.stage, m.digest, m.created, str(len(m.files)), f"{size:,}", brief[:80])
        if m.stage == "train":
            trained.append(m)
    console.print(table)
    for m in trained:  # where each draft is: the attempt folder the manifest names
        print(f"train {m.digest}: attempt {m.attempt}, draft {store.uri.rstrip('/')}/train/{m.digest}/{m.attempt}/draft/")


@app.command()
def gc(config: Optional[Path] = typer.Argument(None, help="Config whose store to clean (default store otherwise)."),
       overrides: list[str] = SetOpt, store_uri: Optional[str] = StoreOpt,
       min_age: float = typer.Option(3600, help="Leftovers whose owner may still be running (another host, "
                                                "none recorded) go only once older than this many seconds."),
       dry_run: bool = typer.Option(False, "--dry-run", help="List, do not delete."),
       yes: bool = typer.Option(False, "--yes", "-y", help="Delete without asking (needed without a terminal)."),
       as_json: bool = typer.Option(False, "--json", help="Print the leftovers as a JSON list.")):
    """Remove what dead runs left: attempt folders no manifest names, temp files, stale locks, engine
    work folders (/dev/shm) and a killed trainer's temporary checkpoints. A leftover whose owner
    process is gone goes at once; one whose owner cannot be checked, after --min-age. Only inside a
    draftline store (its root holds draftline-store.json, see `draftline store init`). It lists what it
    will delete and asks, unless --yes."""
    from cli.leftovers import find, human_age

    cfg = load_cfg(config, overrides, store_uri)
    store = open_store(cfg, write=not dry_run)
    found = find(store, min_age)
    title = f"leftovers of dead runs ({store.uri} and this machine's temp folders)"
    table = Table()
    for col in ("kind", "where", "age", "owner", "why"):
        table.add_column(col, overflow="fold")
    for item in found:
        table.add_row(item.kind, item.where, human_age(item.age_s), item.owner, item.why)
    asked = bool(found) and not dry_run and not yes
    if asked:
        # deleting is not undone (and on a shared store other people's runs write too): show, then ask
        (err if as_json else console).print(title)
        (err if as_json else console).print(table)
        if not sys.stdin.isatty():
            fail(f"{len(found)} leftover(s) of {store.uri} and this machine: not deleting without confirmation, "
                 "and there is no terminal to ask on; look with `draftline gc --dry-run`, then pass --yes")
        if not typer.confirm(f"delete these {len(found)} leftover(s) on {store.uri}?", default=False, err=True):
            fail("nothing deleted", code=1)
    if not dry_run:
        for item in found:
            item.remove(store)
    if as_json:
        print(json.dumps([{**vars(i), "age_s": round(i.age_s, 1), "removed": not dry_run} for i in found], indent=2))
        return
    if found and not asked:  # --dry-run, or --yes: what was (or would be) removed
        console.print(title)
        console.print(table)
    console.print(f"{len(found)} leftover(s) {'found (--dry-run: nothing removed)' if dry_run else 'removed'}")


@app.command()
def report(config: Optional[Path] = typer.Argument(None, help="Config naming the store (default store otherwise)."),
           target: str = typer.Argument("last", help="A benchmark artifact digest, its URI, a flow run id, or "
                                                     "`last` (the newest benchmark in the store)."),
           old_config: Optional[Path] = typer.Option(None, "--config", "-c", hidden=True,
                                                     help="Deprecated: the config as a positional argument."),
           overrides: list[str] = SetOpt, store_uri: Optional[str] = StoreOpt,
           as_json: bool = typer.Option(False, "--json")):
    """Re-render a benchmark report from the store (read-only keys are enough): `draftline report CONFIG
    [RUN|DIGEST]`."""
    from tasks.benchmark.stage import find_report
    from tasks.benchmark.report import render_terminal

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


@store_app.command("init")
def store_init(config: Optional[Path] = typer.Argument(None, help="Config naming the store (or use --store)."),
               overrides: list[str] = SetOpt, store_uri: Optional[str] = StoreOpt, as_json: bool = JsonOpt):
    """Create the store's S3 bucket (or local folder) if it does not exist, check that these keys can
    list, write and delete under the store's prefix, and mark it as a draftline store (draftline-store.json
    at its root: what `draftline gc` requires). Running it again changes nothing."""
    from tasks.store.artifacts import Store

    cfg = load_cfg(config, overrides, store_uri)
    store = Store.from_config(cfg.store)
    created = store.create()
    store.check()
    store.init_marker()
    where = f"folder {store.root}" if store.is_local else f"bucket s3://{store.root.partition('/')[0]}"
    if as_json:
        print(json.dumps({"store": store.uri, "created": created}))
    else:
        console.print(f"{'created' if created else 'found'} {where}; {store.uri} is ready "
                      "(listed, wrote and deleted a probe object; marked it a draftline store)")


for _command in (doctor.doctor, deploy.deploy, deploy.submit, runs.status, runs.retry, runs.ui, runs.logs,
                 plan.plan, weights.weights, export.export, check.check):
    app.command(_command.__name__)(_command)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
