"""`draftline ls | gc | store init`: the store's committed artifacts, what dead runs left in it (and on this
machine), and a new store made ready."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from cli.console import JsonOpt, SetOpt, StoreOpt, console, err, fail, load_cfg, open_store
from cli.leftovers import find, human_age
from tasks.address.digests import STAGE_FOLDERS
from tasks.core.stages import check_stage
from tasks.store.artifacts import Store

FOLD = 20  # a folder with more artifacts than this is one row of `ls`'s table (1,024 rows: seconds of rendering)


def ls(config: Optional[Path] = typer.Argument(None, help="Config whose store to list (default store otherwise)."),
       overrides: list[str] = SetOpt, store_uri: Optional[str] = StoreOpt,
       stage: Optional[str] = typer.Option(None, help="Only this stage's artifacts: its own and, for a sharded "
                                                       "stage, its shards' (" + "; ".join(
                                                           f"{s}: {', then '.join(f)}" for s, f in STAGE_FOLDERS.items()
                                                           if len(f) > 1) + ")."),
       all_rows: bool = typer.Option(False, "--all", help=f"A row for every artifact: the table folds a folder of "
                                                           f"more than {FOLD} (a sharded stage's shards) into one row."),
       as_json: bool = JsonOpt):
    """List committed artifacts in the store (read-only keys are enough). --json lists every one."""
    cfg = load_cfg(config, overrides, store_uri)
    check_stage(stage, "--stage")
    store = open_store(cfg, write=False)
    manifests = [m for folder in STAGE_FOLDERS[stage] for m in store.list(folder)] if stage else store.list()
    if as_json:
        print(json.dumps([{**m.model_dump(mode="json", exclude={"config"}), "uri": store.uri_of(m.stage, m.digest),
                           "bytes": sum(f.bytes for f in m.files)} for m in manifests], indent=2))
        return
    console.print(f"committed artifacts in {store.uri}")  # not a table title: those fold at the table's width
    table = Table()
    for col in ("stage", "digest", "created", "files", "bytes", "stats"):
        table.add_column(col)
    for folder, group in itertools.groupby(manifests, key=lambda m: m.stage):  # each folder's are together
        rows = list(group)
        if len(rows) > FOLD and not all_rows:
            table.add_row(folder, f"{len(rows):,} artifacts", f"{rows[0].created} to {rows[-1].created}",
                          f"{sum(len(m.files) for m in rows):,}", f"{sum(f.bytes for m in rows for f in m.files):,}",
                          "folded: --all lists each")
            continue
        for m in rows:
            size = sum(f.bytes for f in m.files)
            brief = ", ".join(f"{k}={v}" for k, v in m.stats.items()
                              if isinstance(v, (int, float, str)) and len(str(v)) < 24)
            table.add_row(m.stage, m.digest, m.created, str(len(m.files)), f"{size:,}", brief[:80])
    trained = [m for m in manifests if m.stage == "train"]
    console.print(table)
    for m in trained:  # where each draft is: the attempt folder the manifest names
        print(f"train {m.digest}: attempt {m.attempt}, draft {store.uri.rstrip('/')}/train/{m.digest}/{m.attempt}/draft/")


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


def init(config: Optional[Path] = typer.Argument(None, help="Config naming the store (or use --store)."),
               overrides: list[str] = SetOpt, store_uri: Optional[str] = StoreOpt, as_json: bool = JsonOpt):
    """Create the store's S3 bucket (or local folder) if it does not exist, check that these keys can
    list, write and delete under the store's prefix, and mark it as a draftline store (draftline-store.json
    at its root: what `draftline gc` requires). Running it again changes nothing."""
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
