"""What the training modules share: their error, the metrics callback and the logger."""

from __future__ import annotations

import logging
from typing import Any, Callable

MetricsCallback = Callable[[dict[str, Any]], None]
log = logging.getLogger("draftline.train")

STAGE = "train"
CKPT_STAGE = "checkpoint"  # what checkpoints are stored as (checkpoint/<train digest[:20]>-s<step>)


class TrainError(ValueError):
    """Training cannot start or continue; the message names the problem and the fix."""
