"""The vocab artifact's file, read without torch: its name, its error and its tensors as they are stored.

`draftline check` compares a draft's d2t/t2d with the vocab artifact's byte for byte; importing torch for that
took most of the command's time (seconds; benchmarks/RESULTS.md, "Listing commands on the preset's store").
Checking the maps against each other and the target (tasks/formats/vocab_maps.py) needs torch.
"""

from __future__ import annotations

from typing import Any

from tasks.core.errors import DraftlineError
from tasks.store.artifacts import ArtifactRef, Store

FILE = "vocab.safetensors"


class VocabFormatError(DraftlineError, ValueError):
    """A vocab artifact that is missing, incomplete or inconsistent; the message says what to rerun."""


def read_maps(store: Store, vocab_ref: ArtifactRef, framework: str = "pt") -> dict[str, Any]:
    """Every tensor of the file, unchecked (d2t, t2d, token_counts): torch tensors, or numpy arrays with
    FRAMEWORK "np" (no torch import)."""
    if framework == "np":
        from safetensors.numpy import load
    else:
        from safetensors.torch import load  # torch: heavy (seconds), only where tensors are asked for

    art = store.open(vocab_ref.stage or "vocab", vocab_ref.digest)
    return load(art.read_bytes(FILE))
