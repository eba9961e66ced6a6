"""The rates a plan rests on (configs/rates.yaml): each names its source and kind (a run in
benchmarks/RESULTS.md, a cited published figure, or an assumption); the hardware's come from a machine profile
(`--machine`), the target's from its entry under `targets:` (its config, so no weights are needed)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tasks.core.config import RunConfig
from tasks.core.config_load import CHECKOUT
from tasks.core.errors import DraftlineError

RATES_FILE = CHECKOUT / "configs" / "rates.yaml"
DEFAULT_MACHINE = "b300-node"
KINDS = ("measured", "cited", "assumption")
TARGET_RATES = ("decode_tok_s", "decode_tok_s_batch1")  # per target and machine
# per target: its active parameters, and the bytes of its weights (an engine start reads them: engine.start_s_per_gb)
TARGET_SIZES = ("active_params", "weights_gb")


class PlanError(DraftlineError, ValueError):
    """A plan that cannot be made; the message says what to add or fix."""


@dataclass
class Rate:
    name: str
    value: float
    unit: str
    kind: str  # measured | cited | assumption | command line | the run's stats
    source: str


def _rate(name: str, raw: Any) -> Rate:
    if not isinstance(raw, dict) or not {"value", "unit", "kind", "source"} <= set(raw):
        raise PlanError(f"rate {name}: give value, unit, kind ({', '.join(KINDS)}) and source")
    if raw["kind"] not in KINDS:
        raise PlanError(f"rate {name}: kind must be one of {', '.join(KINDS)}, got {raw['kind']!r}")
    return Rate(name, float(raw["value"]), str(raw["unit"]), raw["kind"], " ".join(str(raw["source"]).split()))


def _section_rates(data: dict[str, Any], where: str) -> dict[str, Rate]:
    return {f"{sec}.{name}": _rate(f"{where}{sec}.{name}", raw)
            for sec, items in data.items() for name, raw in (items or {}).items()}


def read_rates_file(path: Path = RATES_FILE) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise PlanError(f"cannot read the rates file {path}: {exc}") from None
    if not data.get("machines"):
        raise PlanError(f"{path}: add `machines:` (at least {DEFAULT_MACHINE}: with its node rates)")
    return data


def machine_for(config_name: str | None, path: Path = RATES_FILE) -> str:
    """The machine a preset names in the rates file (`presets:`), else the B300 node."""
    for name, entry in read_rates_file(path)["machines"].items():
        if config_name and config_name in (entry.get("presets") or []):
            return name
    return DEFAULT_MACHINE


def all_rates(path: Path = RATES_FILE) -> list[Rate]:
    """Every rate the file holds, on every machine and for every target (for checking their sources)."""
    data = read_rates_file(path)
    out = list(_section_rates({k: v for k, v in data.items() if k not in ("machines", "targets")}, "").values())
    for m, entry in data["machines"].items():
        out += _section_rates({k: v for k, v in entry.items() if k not in ("description", "presets", "max_nodes")},
                              f"{m}: ").values()
    for model, entry in (data.get("targets") or {}).items():
        out += [_rate(f"{model}.{k}", v) for k, v in entry.items() if k not in ("config", "machines", "local_copies")]
        for m, items in (entry.get("machines") or {}).items():
            out += [_rate(f"{model} on {m}: target.{k}", v) for k, v in items.items()]
    return out


def load_rates(path: Path = RATES_FILE, overrides: list[str] | None = None,
               machine: str = DEFAULT_MACHINE) -> dict[str, Any]:
    """The rates of one machine as {"rates": {"node.gpus": Rate, ...}, "targets": {model: {...}}, "machine":
    name, "description": ..., "overrides": {...}}; `overrides` are `section.name=value` (target rates:
    `target.decode_tok_s=...`, applied to the config's target on this machine)."""
    data = read_rates_file(path)
    machines = data.pop("machines")
    targets = data.pop("targets", {}) or {}
    if machine not in machines:
        raise PlanError(f"--machine {machine!r} is not in {Path(path).name}; one of: {', '.join(machines)}")
    entry = dict(machines[machine])
    description = " ".join(str(entry.pop("description", machine)).split())
    entry.pop("presets", None)
    max_nodes = entry.pop("max_nodes", None)
    rates = _section_rates(data, "")
    rates.update(_section_rates(entry, ""))
    out = {"rates": rates, "targets": targets, "overrides": {}, "machine": machine, "description": description,
           "max_nodes": int(max_nodes) if max_nodes else None}
    target_names = [f"target.{n}" for n in (*TARGET_SIZES, *TARGET_RATES)]
    for item in overrides or []:
        key, _, value = item.partition("=")
        if key not in rates and key not in target_names:
            raise PlanError(f"--rate {key!r} is not a rate; one of: {', '.join(sorted(rates) + target_names)}")
        try:
            number = float(value)
        except ValueError:
            raise PlanError(f"--rate {item!r}: expected NAME=NUMBER, e.g. --rate node.gpu_hour_price=4.5") from None
        if key in rates:
            rates[key] = Rate(key, number, rates[key].unit, "command line", f"--rate {item}")
        else:
            out["overrides"][key.removeprefix("target.")] = number
    return out


@dataclass
class Target:
    """The target a plan prices. From load_target: transformers' config and the folder its config.json was saved
    to; from a kept shape (tasks/cost/shape_cache.py): the fields of its text config a plan reads, and no folder."""
    hf_config: Any
    folder: str  # a folder holding its config.json (for speculators' layer config); "" for a kept shape
    rates: dict[str, Rate]
    experts: bool
    known_as: str = ""  # the rates file's target whose shape a local target.model has


SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size")


def _same_shape(hf: Any, targets: dict[str, Any]) -> str:
    """The rates file's target with the decoder shape of `hf` (the same weights under another path, e.g. a
    workstation's /models/kimi-k2.5), or ""."""
    from transformers import AutoConfig

    from tasks.engine.target import text_config

    mine = [getattr(text_config(hf), k, None) for k in SHAPE_KEYS]
    for model, entry in targets.items():
        conf = dict(entry["config"])
        known = text_config(AutoConfig.for_model(conf.pop("model_type"), **conf))
        if [getattr(known, k, None) for k in SHAPE_KEYS] == mine:
            return model
    return ""


def _target_rate(model: str, entry: dict, name: str, overrides: dict[str, float], where: str) -> Rate:
    if name in overrides:
        return Rate(f"target.{name}", overrides[name], entry.get(name, {}).get("unit", ""), "command line",
                    f"--rate target.{name}={overrides[name]:g}")
    if name not in entry:
        raise PlanError(f"configs/rates.yaml: targets: {model}: {where}add {name} (value, unit, kind, source), "
                        f"or pass --rate target.{name}=...")
    return _rate(f"target.{name}", entry[name])


@dataclass
class TargetSource:
    """Where a target's shape comes from, read without transformers (or torch): its rates file entry (None for
    a model the file does not name) and the config that entry states, or the model's own config.json."""
    entry: dict | None
    known_as: str  # the rates file's target a local copy (local_copies) is
    config: dict
    stated: bool  # the config states the target's context length (a rates entry's config is a stand-in)


def target_source(cfg: RunConfig, rates: dict[str, Any]) -> TargetSource:
    """The rates file's `targets` entry of target.model (or of the preset it is a local copy of), else the
    config.json of target.model (a folder, or a hub id's files on this node)."""
    from tasks.engine.target import TargetError, resolve_model

    model = cfg.target.model
    entry = rates["targets"].get(model)
    known_as = ""
    if entry is None and not Path(model).exists():  # a preset's copy on its own machine, planned elsewhere
        known_as = next((name for name, e in rates["targets"].items() if model in (e.get("local_copies") or [])), "")
        entry = rates["targets"].get(known_as)
    if entry is not None:  # its context length stated at the top, or in a multimodal wrapper's text_config
        conf = dict(entry["config"])
        stated = any("max_position_embeddings" in (c or {}) for c in (conf, conf.get("text_config")))
        return TargetSource(entry, known_as, conf, stated)
    try:
        config = json.loads((Path(resolve_model(cfg.target, weights=False)) / "config.json").read_text())
    except (TargetError, OSError, ValueError) as exc:
        raise unreadable_target(model, exc) from None
    return TargetSource(None, "", config, True)


def unreadable_target(model: str, exc: Exception) -> PlanError:
    return PlanError(f"target.model {model!r}: cannot read its config ({str(exc).splitlines()[0][:160]}); add it "
                     f"under `targets:` in {RATES_FILE.relative_to(CHECKOUT)} (its config.json fields, "
                     f"active_params, and per machine {', '.join(TARGET_RATES)})")


def load_target(cfg: RunConfig, rates: dict[str, Any], tmp: Path) -> Target:
    """The target's config from the rates file's `targets` entry (no weights needed), else from target.model
    (transformers' AutoConfig, saved to `tmp` for speculators' layer config); its rates on the plan's machine."""
    from transformers import AutoConfig

    from tasks.engine.target import TargetError, load_hf_config, max_model_len_problem, text_config

    src = target_source(cfg, rates)
    entry, known_as = src.entry, src.known_as
    if entry is not None:
        conf = dict(src.config)
        hf = AutoConfig.for_model(conf.pop("model_type"), **conf)
    else:
        try:
            hf = load_hf_config(cfg.target)
        except (TargetError, OSError, ValueError) as exc:
            raise unreadable_target(cfg.target.model, exc) from None
        known_as = _same_shape(hf, rates["targets"])
        entry = rates["targets"][known_as] if known_as else {}
    hf.save_pretrained(tmp)
    tc = text_config(hf)
    too_long = max_model_len_problem(cfg.target, tc) if src.stated else None
    if too_long:
        raise PlanError(too_long)
    return Target(hf, str(tmp), target_rates(cfg, rates, entry, known_as),
                  experts=bool(getattr(tc, "n_routed_experts", None) or getattr(tc, "num_local_experts", None)),
                  known_as=known_as)


def target_rates(cfg: RunConfig, rates: dict[str, Any], entry: dict, known_as: str) -> dict[str, Rate]:
    """The target's rates on the plan's machine: its active parameters and decode rates from its rates file
    `entry` (or --rate), the bytes of its weights from the entry or its local folder's *.safetensors."""
    model = cfg.target.model
    machine = rates.get("machine", DEFAULT_MACHINE)
    on_machine = (entry.get("machines") or {}).get(machine, {})
    out = {"active_params": _target_rate(known_as or model, entry, "active_params", rates["overrides"], "")}
    out.update({n: _target_rate(known_as or model, on_machine, n, rates["overrides"], f"machines: {machine}: ")
                for n in TARGET_RATES})
    local = Path(model).expanduser()
    if "weights_gb" in entry or "weights_gb" in rates["overrides"]:
        out["weights_gb"] = _target_rate(known_as or model, entry, "weights_gb", rates["overrides"], "")
    elif local.is_dir():  # the folder itself says how many bytes an engine start reads
        size = sum(f.stat().st_size for f in local.glob("*.safetensors"))
        out["weights_gb"] = Rate("target.weights_gb", size / 1e9, "GB of weights (*.safetensors)", "measured",
                                 f"the sizes of the *.safetensors files in {local}")
    return out
