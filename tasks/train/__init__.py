"""The train stage (`stage.py`: find, resume or train a head) and its parts: checked inputs (`inputs.py`),
the loop every rank runs (`loop.py`: the Trainer, whose `fit()` calls the components below, and the export
for vLLM), the learning-rate schedule and time budget (`schedule.py`), checkpoints: what one holds, loading
it, cadence and retention (`checkpoints.py`), the step records and their emit (`metrics.py`), the held-out
split and its evaluation (`evaluation.py`), a rank's distributed environment (`dist.py`), the draft model
(`model.py`), batches from the store (`stream.py`) and ranks over a node's GPUs (`ranks.py`).
This file holds what they share: the stage's name, its error, the metrics callback, the logger and
whether training wants CUDA.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from tasks.core.errors import DraftlineError

MetricsCallback = Callable[[dict[str, Any]], None]
log = logging.getLogger("draftline.train")

STAGE = "train"
CKPT_STAGE = "checkpoint"  # what checkpoints are stored as (checkpoint/<train digest[:20]>-s<step>)


class TrainError(DraftlineError, ValueError):
    """Training cannot start or continue; the message names the problem and the fix."""


def wants_cuda(train: Any) -> bool:
    """Whether training runs on GPUs (`train.device` cuda, or auto with a GPU visible); cuda where torch sees
    no GPU is an error naming the fix. The one place both the ranks' count and each rank's device ask."""
    import torch  # here, not at the top: this package's __init__ stays light

    use = train.device == "cuda" or (train.device == "auto" and torch.cuda.is_available())
    if use and not torch.cuda.is_available():
        raise TrainError("train.device is cuda but torch sees no GPU; set train.device: auto (or cpu)")
    return use
