"""A trained draft found from what a user gives: a train digest (or a unique prefix), a flow run id or name or
`last`, or a config whose run trained it; with the newest benchmark report that measured it and the serve
settings it is exported at. `draftline export` and `draftline check` both start here."""

from __future__ import annotations

import json
from typing import Any

from cli.prefect_api import client, find_run
from flows.flow_runs import OpsError
from flows.started_runs import params_digest, started_here
from tasks.benchmark.serve import ExportError, run_serve
from tasks.benchmark.results import find_report, load_report
from tasks.core.config import RunConfig
from tasks.core.config_load import load_config
from tasks.core.errors import ConfigError
from tasks.store.resolve import resolve


def resolve_train(store: Any, what: str, config: Any | None = None,
                  head: str | None = None) -> tuple[str, dict | None, Any | None]:
    """(train digest, the newest benchmark report that measured it or None, the config it was trained with when
    known) for what `draftline export` was given: a train digest (or a unique prefix of 6+), a flow run id / name
    / `last` (its benchmark report, else its parameters' config), or (`config`) a loaded config whose train
    address is computed from the store."""
    run_cfg = config
    if config is not None:
        digest = config_train_digest(store, config, head)
    else:
        hits = [m for m in store.list("train") if len(what) >= 6 and m.digest.startswith(what)]
        if len(hits) > 1:
            raise ExportError(f"{what!r} is the start of {len(hits)} train digests; give more characters")
        rep = find_report(store, what) if not hits and what not in ("last", "latest") else None
        if hits:
            digest = hits[0].digest
        elif rep is not None and head is None:
            digest = rep["draft"]["train_digest"]
        else:
            digest, run_cfg = run_train_digest(store, what, head)
    return digest, report_for(store, digest), run_cfg


def export_serve(store: Any, digest: str, report: dict | None, cfg: Any | None) -> dict[str, Any]:
    """The serve settings for an export: the benchmark's (measured), else the run's config's, else (a bare train
    digest) the target the draft's own config names with default engine settings."""
    ref = store.open("train", digest).ref()
    if report is not None or cfg is not None:
        return run_serve(cfg or RunConfig(), store, ref, report)
    art = store.open("train", digest)
    conf = json.loads(art.read_bytes("draft/config.json"))
    verifier = ((conf.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    base = RunConfig()
    if verifier:
        base.target.model = verifier
    return run_serve(base, store, ref, None)


def report_for(store: Any, train_digest: str) -> dict[str, Any] | None:
    """The newest benchmark report whose main draft is this train artifact."""
    for m in sorted(store.list("benchmark"), key=lambda m: m.created, reverse=True):
        if m.inputs.get("train") == train_digest:
            try:
                return load_report(store, m.digest)
            except Exception:  # noqa: BLE001 - an unreadable report: the next one, or the config's settings
                continue
    return None


def config_train_digest(store: Any, cfg: Any, head: str | None = None) -> str:
    """The train address a config's run has (or would have): the data, vocab and extraction artifacts are read
    from the store, as the pipeline computes them (tasks/store/resolve.py)."""
    heads = [h.label for h in cfg.train.heads]
    if head is not None and head not in heads:
        raise ExportError(f"--head {head!r}: this config trains {', '.join(heads)}")
    found = resolve(cfg, store, until="train")
    train = found.of("train", head)
    if train is None or train.artifact is None:
        stage = found.missing or "train"
        where = f" ({found.of(stage).digest})" if found.of(stage) is not None else ""
        raise ExportError(f"this config's {stage} artifact{where} is not on {store.uri}: the run has not got that "
                          "far; run it first (`draftline run CONFIG`) or give a train digest")
    return train.digest


def run_train_digest(store: Any, run: str, head: str | None = None) -> tuple[str, Any]:
    """The train address of a flow run (id, name or `last`) and its config, from the config and overrides it
    ran with."""
    try:
        with client() as c:
            fr = find_run(c, run, mine=True)
    except OpsError as exc:
        raise ExportError(f"{run!r} is no train digest on {store.uri} and no flow run: {exc}") from None
    params = fr.parameters or {}
    try:
        cfg = load_config(params.get("config_path"), list(params.get("overrides") or []))
    except ConfigError as exc:
        raise ExportError(f"flow run {fr.name} ({fr.id}) ran with a config that no longer loads here: {exc}; give "
                          "its train digest (`draftline ls --stage train`)") from None
    mine = started_here(fr.id)
    if cfg.target.trust_remote_code and (mine is None or mine.get("digest") != params_digest(params)):
        raise ExportError(f"flow run {fr.name} ({fr.id}) names target.trust_remote_code=true for {cfg.target.model} "
                          "in parameters this machine did not record (another API user's run, or edited since): "
                          "loading its target would run that repository's code here. Give its train digest "
                          "(`draftline ls --stage train`) or the config you trust")
    if cfg.store.uri != store.uri:  # both canonical: one store however it is written (relative, absolute, slash)
        raise ExportError(f"flow run {fr.name} wrote to {cfg.store.uri}, not {store.uri}: pass --store {cfg.store.uri}")
    return config_train_digest(store, cfg, head), cfg
