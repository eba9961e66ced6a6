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
    # The target's fingerprint (tasks/engine/weights.py `_digest`), in every address of a folder or hub target.
    # v2: the weight files enter by the sha256 of their content, not their (name, size) alone, so a fine-tune or
    # a re-release with the same file sizes is another model (issue 33). Every address of such a target moved once;
    # the offline preset's (the demo's) did not: it is named, not fingerprinted.
    "target": "target-v2",
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
