"""The one cache-key function: what made an artifact decides its address.

digest = sha256(stage, stage version, the stage's config section, its inputs'
digests), shortened to 32 hex characters. Never the code's source text (an
edited comment must not throw away a day of extraction), never the run id (a
new run must reuse finished work). Bump a stage's VERSION when its output
changes meaning.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel

# Bump when the bytes a stage writes change meaning.
VERSIONS = {
    "prepare": "prepare-v1",
    "regenerate": "regenerate-v1",
    "vocab": "vocab-v1",
    "extract": "extract-v1",
    "train": "train-v1",
    "checkpoint": "checkpoint-v1",
    "benchmark": "benchmark-v1",
    "target": "target-v1",
}


def _canonical(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return _canonical(obj.model_dump(mode="json"))
    if isinstance(obj, dict):
        return {str(k): _canonical(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    if isinstance(obj, float) and obj.is_integer():
        return int(obj)  # 3 and 3.0 in YAML mean the same config
    return obj


def stage_digest(stage: str, config: Any, inputs: dict[str, str] | None = None,
                 version: str | None = None) -> str:
    payload = {
        "stage": stage,
        "version": version or VERSIONS[stage],
        "config": _canonical(config),
        "inputs": dict(sorted((inputs or {}).items())),
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


# --------------------------------------------------------------------------- per-stage addresses
# One function per stage, used by the stage itself and by the Prefect cache policy,
# so both always agree on where an artifact lives. Scheduling-only keys (devices,
# prefetch, batch sizes that do not change the bytes) are left out on purpose.

def _target_identity(cfg) -> dict[str, Any]:
    t = cfg.target
    ident: dict[str, Any] = {"model": t.model, "revision": t.revision, "max_model_len": t.max_model_len}
    if t.chat_template:
        from pathlib import Path

        p = Path(t.chat_template)
        ident["chat_template_sha256"] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else t.chat_template
    return ident


def prepare(cfg) -> str:
    return stage_digest("prepare", {"target": _target_identity(cfg), "data": cfg.data})


def regenerate(cfg, prepared) -> str:
    return stage_digest("regenerate", {"target": _target_identity(cfg), "regenerate": cfg.regenerate},
                        {"data": prepared.digest})


def vocab(cfg, data) -> str:
    return stage_digest("vocab", cfg.vocab, {"data": data.digest})


# Train keys that change how fast or where the draft is made, not the recipe: the number of ranks
# (a retry may resume on another count), and kernels computing the same function (attention, loss).
TRAIN_SCHEDULING_KEYS = {"device", "gpus", "prefetch", "checkpoint_every", "keep_checkpoints", "loss_impl",
                         "attn_impl"}


def train(cfg, vocab_ref, shard_refs) -> str:
    """The train artifact's address (run_train commits there; the Prefect key uses it too)."""
    refs = sorted(shard_refs, key=lambda r: (int(r.stats.get("shard", 0)), r.digest))
    t = cfg.target
    inputs = {"vocab": vocab_ref.digest, "extract": ",".join(r.digest for r in refs),
              "target": t.model + (f"@{t.revision}" if t.revision else "")}
    return stage_digest("train", cfg.train.model_dump(mode="json", exclude=TRAIN_SCHEDULING_KEYS), inputs)


def benchmark(cfg, trained, data) -> str:
    return stage_digest("benchmark", {"benchmark": cfg.benchmark, "target": _target_identity(cfg)},
                        {"train": trained.digest, "data": data.digest})
