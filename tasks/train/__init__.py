"""The train stage (`stage.py`: find, resume or train a head) and its parts: checked inputs (`inputs.py`),
the loop every rank runs (`loop.py`), the draft model (`model.py`), batches from the store
(`stream.py`) and ranks over a node's GPUs (`ranks.py`). This file holds what they share: the stage's
name, its error, the metrics callback and the logger.
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
