"""The shape a plan prices (tasks/cost/shape.py `make_shape`), kept on disk so that `draftline plan` builds it
once per draft: building it imports speculators, transformers and torch (seconds), reading it imports none.

An entry is one JSON file, `plan-shapes/KEY.json` under draftline's cache home (tasks/core/home.py
`cache_home`: $DRAFTLINE_HOME, else ~/.cache/draftline), holding the shape's numbers and the few fields of the
target's text config the plan checks (TEXT_FIELDS). KEY digests everything the numbers depend on (`shape_key`):
the target's config as read (the rates file entry's `config`, or the model's config.json), the train fields
draft_model reads (train.num_layers, train.ttt_steps), vocab.draft_vocab_size, extract.layer_ids, the
speculators and transformers versions, and SHAPE_VERSION (raised whenever make_shape counts differently).
A file that does not parse or validate (`ShapeEntry`: every field, its type, its key) is rebuilt, never
trusted; writes are atomic (a temporary file, then os.replace); the newest KEEP entries are kept. Deleting the
folder is always safe: the next plan builds its shape again."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from tasks.core.config import RunConfig
from tasks.core.home import cache_home
from tasks.cost.rates import PlanError, Target, TargetSource, target_rates, target_source
from tasks.cost.shape import Shape, make_shape
from tasks.engine.target import max_model_len_problem, text_config

SHAPE_VERSION = 1  # raise when make_shape's numbers change for the same inputs: every entry is then rebuilt
KEEP = 64  # entries kept: the newest by last use
FOLDER = "plan-shapes"
# the target's text config fields a plan reads besides the shape's numbers: its context length
# (max_model_len_problem) and whether its attention is MLA (tasks/train/head_kinds.py head_target_problem)
TEXT_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "max_position_embeddings",
               "rope_scaling", "kv_lora_rank")


class ShapeEntry(BaseModel):
    """One cached shape, as its JSON file holds it."""
    model_config = ConfigDict(extra="forbid", strict=True)

    schema_version: Literal[1]
    key: str
    hidden: int
    n_layers: int
    train_flops: float
    trainable: int
    flops_fixed: float
    flops_per_pass: float
    layer_params: int
    experts: bool
    known_as: str
    text: dict[str, Any]

    @field_validator("text")
    @classmethod
    def _every_text_field(cls, text: dict[str, Any]) -> dict[str, Any]:
        if sorted(text) != sorted(TEXT_FIELDS):
            raise ValueError(f"text holds {sorted(text)}, not the fields {sorted(TEXT_FIELDS)}")
        return text


def shape_key(cfg: RunConfig, src: TargetSource, rates: dict[str, Any]) -> str:
    """The digest of everything make_shape's numbers depend on (the module docstring lists it)."""
    inputs = {"shape_version": SHAPE_VERSION, "speculators": version("speculators"),
              "transformers": version("transformers"), "target_config": src.config,
              "num_layers": cfg.train.num_layers, "ttt_steps": cfg.train.ttt_steps,
              "draft_vocab_size": cfg.vocab.draft_vocab_size, "layer_ids": cfg.extract.layer_ids}
    if src.entry is None:  # a model of its own: which rates file target it matches (known_as) rests on theirs
        inputs["trust_remote_code"] = cfg.target.trust_remote_code
        inputs["known_targets"] = {name: e.get("config") for name, e in rates["targets"].items()}
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def cached_shape(cfg: RunConfig, rates: dict[str, Any]) -> Shape:
    """make_shape's Shape for CFG, from its cache entry when one is there (no speculators, transformers or
    torch imported), else built and kept. Either way the target's config is the stand-in of TEXT_FIELDS, so
    a plan reads the same from a new entry as from a kept one."""
    src = target_source(cfg, rates)
    key = shape_key(cfg, src, rates)
    folder = cache_home() / FOLDER
    entry = read_entry(folder, key)
    if entry is None:
        entry = entry_of(make_shape(cfg, rates), key)
        write_entry(folder, entry)
    text = SimpleNamespace(**entry.text)
    too_long = max_model_len_problem(cfg.target, text) if src.stated else None
    if too_long:
        raise PlanError(too_long)
    known = src.entry if src.entry is not None else rates["targets"].get(entry.known_as, {})
    target = Target(text, "", target_rates(cfg, rates, known, src.known_as or entry.known_as), entry.experts,
                    src.known_as or entry.known_as)
    return Shape(target, entry.hidden, entry.n_layers, entry.train_flops, entry.trainable, entry.flops_fixed,
                 entry.flops_per_pass, entry.layer_params)


def entry_of(shape: Shape, key: str) -> ShapeEntry:
    tc = text_config(shape.target.hf_config)
    return ShapeEntry(schema_version=1, key=key, hidden=shape.hidden, n_layers=shape.n_layers,
                      train_flops=float(shape.train_flops), trainable=shape.trainable,
                      flops_fixed=float(shape.flops_fixed), flops_per_pass=float(shape.flops_per_pass),
                      layer_params=shape.layer_params, experts=shape.target.experts, known_as=shape.target.known_as,
                      text=json.loads(json.dumps({k: getattr(tc, k, None) for k in TEXT_FIELDS}, default=str)))


def read_entry(folder: Path, key: str) -> ShapeEntry | None:
    """The entry kept under KEY, or None: none kept, or a file that does not parse or validate as one
    (it is then rebuilt and replaced)."""
    path = folder / f"{key}.json"
    try:
        entry = ShapeEntry.model_validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None
    if entry.key != key:
        return None
    try:
        os.utime(path)  # its last use: what KEEP keeps
    except OSError:
        pass
    return entry


def write_entry(folder: Path, entry: ShapeEntry) -> None:
    """Write ENTRY whole or not at all (a temporary file renamed over it), then drop all but the newest KEEP.
    A cache that cannot be written (a read-only home) leaves the plan as it is: the next one builds again."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(entry.model_dump_json())
            os.replace(tmp, folder / f"{entry.key}.json")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        entries = [p for p in folder.glob("*.json") if not p.name.startswith(".")]  # not another's temporary file
        kept = sorted(entries, key=lambda p: p.stat().st_mtime, reverse=True)
        for old in kept[KEEP:]:
            old.unlink(missing_ok=True)
    except OSError:
        return
