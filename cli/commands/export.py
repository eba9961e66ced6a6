"""`draftline export WHAT DEST`: find the train artifact WHAT names (a train digest or a unique prefix, a flow run
id or name or `last`, or a config whose run trained it) and write it where vLLM loads it, with the exact `vllm
serve` line (tasks/benchmark/serve.py builds both)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from cli.console import JsonOpt, SetOpt, StoreOpt, console, fail, load_cfg, open_store
from cli.drafts import export_serve, resolve_train
from tasks.benchmark.serve import ExportError, export_draft


def export(what: str = typer.Argument(..., help="A train digest (or 6+ first characters), a flow run id or "
                                                   "name, `last`, or a YAML config (its first head's draft)."),
           dest: str = typer.Argument(..., help="Folder or s3:// prefix to write the draft to."),
           store_config: Optional[Path] = typer.Option(None, "--config", help="Config naming the store (default: "
                                                                               "WHAT when it is a config)."),
           overrides: list[str] = SetOpt, store_uri: Optional[str] = StoreOpt,
           head: Optional[str] = typer.Option(None, help="With a config or run of several train.heads: which."),
           force: bool = typer.Option(False, "--force", help="Replace files in DEST that no draftline export "
                                                             "wrote (README.md, serve.json, ...)."),
           host: Optional[str] = typer.Option(None, "--host", help="The address the printed `vllm serve` line "
                                              "binds (default engines.serve_host, 127.0.0.1: this machine only; "
                                              "the API has no authentication)."),
           as_json: bool = JsonOpt):
    """Write a trained draft as vLLM loads it (draft/), its vocabulary maps and a README.md with the exact
    `vllm serve` line, at the settings its benchmark measured."""
    from_config = what.endswith((".yaml", ".yml")) or Path(what).is_file()
    cfg = load_cfg(Path(what) if from_config and store_config is None else store_config, overrides, store_uri)
    store = open_store(cfg, write=False)  # it reads the store only: read-only keys export
    try:
        digest, report, run_cfg = resolve_train(store, what, cfg if from_config else None, head)
        out = export_draft(store, digest, dest, export_serve(store, digest, report, run_cfg), force=force,
                           host=host)
    except (ExportError, ValueError, LookupError) as exc:
        fail(str(exc))
    if as_json:
        print(json.dumps(out, indent=2))
        return
    console.print(f"exported train artifact {digest} to {dest} ({len(out['files'])} files). Serve it:")
    for line in out["serve"]["lines"]:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
