"""`draftline weights CONFIG`: put the target's weights on this node ahead of a run (tasks/engine/weights.py). The
disk check `draftline doctor` runs for them is cli/commands/doctor.py `check_weights`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import typer

from cli.console import SetOpt, console, fail, gb
from tasks.core.config_load import load_config
from tasks.engine.target import resolve_model
from tasks.engine.weights import disk_needed, ensure_snapshot, local_target


def weights(config: Path = typer.Argument(..., help="YAML config whose target to fetch."),
            overrides: list[str] = SetOpt,
            as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON object.")):
    """Fetch the target's weights into this node's cache (once; resumable; HF_TOKEN from the environment) and
    print the path, commit, bytes and the disk needed/free. A local folder is only fingerprinted."""
    cfg = load_config(config, overrides)
    t = cfg.target
    out = local_target(t)
    if out is None:
        need = disk_needed(t.model, t.revision, bool(t.trust_remote_code))
        if need["missing_bytes"] > need["free"]:
            fail(f"{t.model}@{need['commit'][:12]} needs {gb(need['missing_bytes'])} more, {gb(need['free'])} "
                 f"free in {need['cache']}: free disk space or point HF_HOME at a larger disk")
        snap = ensure_snapshot(t.model, t.revision, bool(t.trust_remote_code))  # resolved once (cached)
        out = {"model": t.model, "path": snap.path, "commit": snap.commit, "bytes": snap.bytes,
               "fingerprint": snap.fingerprint, "needed_bytes": need["missing_bytes"]}
    elif not out["fingerprint"]:
        out["path"] = resolve_model(t)  # the preset converts here, once
        out = local_target(t)
    out["free_bytes"] = shutil.disk_usage(out["path"]).free
    if as_json:
        print(json.dumps(out, indent=2))
        return
    console.print(f"path:        {out['path']}")
    if out.get("commit"):
        console.print(f"commit:      {out['commit']}")
    console.print(f"bytes:       {out['bytes']:,} ({gb(out['bytes'])})")
    console.print(f"fingerprint: {out['fingerprint']}")
    console.print(f"disk:        {gb(out.get('needed_bytes', 0))} needed (fetched now), {gb(out['free_bytes'])} free")
