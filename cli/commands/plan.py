"""`draftline plan CONFIG`: a run's time, store bytes and cost before it starts; the cost model is
tasks/cost/plan.py."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer

from cli.console import SetOpt
from tasks.core.config_load import load_config
from tasks.address.data import DataIdentityError
from tasks.cost.lengths import Lengths, run_lengths, unresolved
from tasks.cost.plan import make_plan, render
from tasks.cost.rates import RATES_FILE, PlanError, Rate, load_rates, machine_for
from tasks.store.artifacts import Store
from tasks.store.resolve import resolve


def plan(config: Path = typer.Argument(..., help="YAML config, e.g. configs/kimi-k2.5-b300.yaml."),
         nodes: Optional[int] = typer.Option(None, "--nodes", help="Nodes the extraction (and regeneration) "
                                             "is dealt over (default: the config's extract.nodes); as --set "
                                             "extract.nodes=N."),
         machine: Optional[str] = typer.Option(None, "--machine", help="The machine's rates in configs/rates.yaml "
                                               "(b300-node, workstation-rtx-pro-6000; default: the one whose "
                                               "presets name the config, else b300-node)."),
         gpu_hour_price: Optional[float] = typer.Option(None, "--gpu-hour-price",
                                                        help="USD per GPU-hour (default: the machine's)."),
         storage_price: Optional[float] = typer.Option(None, "--storage-price-gb-month",
                                                       help="USD per GB-month kept on the store "
                                                            "(default: configs/rates.yaml)."),
         from_store: bool = typer.Option(False, "--from-store",
                                         help="Take the mean prompt and answer lengths from this config's prepare "
                                              "and regenerate stats on store.uri (--set store.uri=...), where "
                                              "they exist."),
         overrides: list[str] = SetOpt,
         rate: list[str] = typer.Option([], "--rate", help="Override a rate: --rate node.matmul_tflops=2000 "
                                                           "(repeatable; target.decode_tok_s=... for the target)."),
         as_json: bool = typer.Option(False, "--json", help="Print the plan as one JSON object.")):
    """Time, store bytes and cost of a run, per stage, from the config and configs/rates.yaml."""
    cfg = load_config(config, overrides)
    rates = load_rates(RATES_FILE, list(rate), machine or machine_for(cfg.name))
    for value, key, unit, flag in ((gpu_hour_price, "node.gpu_hour_price", "USD per GPU-hour", "--gpu-hour-price"),
                                   (storage_price, "storage.gb_month_price", "USD per GB-month kept on the store",
                                    "--storage-price-gb-month")):
        if value is None:
            continue
        if value <= 0:
            raise PlanError(f"{flag} must be positive, got {value:g}")
        rates["rates"][key] = Rate(key, value, unit, "command line", f"{flag} {value:g}")
    lengths = store_lengths(cfg) if from_store else None
    result = make_plan(cfg, rates, nodes=cfg.extract.nodes if nodes is None else nodes,
                       config_name=str(config), lengths=lengths)
    if as_json:
        print(json.dumps(asdict(result), indent=2))
    else:
        print(render(result, rates["description"]), end="")


def store_lengths(cfg) -> Lengths:
    """The lengths this config's prepare and regenerate stages recorded on its store (tasks/cost/lengths.py); a
    store that cannot be read, or data with no address here, plans on the assumed lengths and says why."""
    try:
        found = resolve(cfg, Store.from_config(cfg.store), until="regenerate", sizes=False)  # the stats only
    except DataIdentityError as exc:  # the data's content cannot be named here (offline, no record of a commit)
        return unresolved(cfg, exc, data_identity=True)
    except Exception as exc:  # noqa: BLE001 - any store or credential failure: say it and plan on assumptions
        return unresolved(cfg, exc, data_identity=False)
    return run_lengths(cfg, found)
