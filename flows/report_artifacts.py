"""What a run shows in the Prefect UI besides its task runs: each stage's progress bar, and what each stage
shows of its artifacts (its `show`, as data: tasks/store/stages.py `Shown`) as markdown and table artifacts.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from tasks.store.stages import Shown

# the terminal and the Prefect UI (PREFECT_LOGGING_EXTRA_LOGGERS gives "draftline" Prefect's API handler)
log = logging.getLogger("draftline.ui")


def publish(shown: Shown) -> dict[str, Any]:
    """Create the markdown and table artifacts a stage's `show` made (tasks/store/stages.py `Shown`) for the
    current flow run; returns their ids by key."""
    out: dict[str, Any] = {}
    for key, description, rows in shown.tables:
        out[key] = create_table_artifact(rows, key=key, description=description)
    for key, description, md in shown.markdown:
        out[key] = create_markdown_artifact(md, key=key, description=description)
    return out


def show(shown: Shown, record: Any, logger, rec: Any = None) -> None:
    """What a stage shows (its `show`): figures on its line of the run's summary (RECORD, a StageRecord),
    fields of the run's record REC, log lines, and its artifacts in the Prefect UI (best effort: the figures
    are on the store either way)."""
    record.stats.update(shown.stats)
    for key, value in shown.record.items():
        if rec is not None:
            setattr(rec, key, value)
    for line in shown.log:
        logger.info(line)
    try:
        publish(shown)
    except Exception as exc:  # noqa: BLE001 - the UI's view only
        logger.warning(f"could not publish {', '.join(k for k, *_ in shown.markdown + shown.tables)} to Prefect: "
                       f"{exc}")


class Progress:
    """A Prefect progress artifact that tolerates running outside a flow."""

    def __init__(self, key: str, description: str):
        self.id = None
        self.key = key
        self.last = -1.0
        self.warned = False
        for attempt in range(3):  # a busy API may time out once; the bar is worth a second try, not a failed run
            try:
                self.id = create_progress_artifact(0.0, key=key, description=description)
                return
            except Exception as exc:  # noqa: BLE001 - the bar is the UI's view only; the run goes on without it
                from prefect.context import FlowRunContext  # heavy (prefect): only where a bar fails, to tell why

                if FlowRunContext.get() is None:  # outside a flow: no bar to make
                    return
                if attempt < 2:
                    time.sleep(1.0)
                else:
                    log.warning(f"progress bar {key!r} not created in the Prefect UI after 3 tries "
                                f"({type(exc).__name__}: {exc}); the run goes on without it")

    def update(self, pct: float, description: str | None = None) -> None:
        if self.id is None or (pct - self.last < 1.0 and pct < 100.0):
            return
        self.last = pct
        try:
            update_progress_artifact(self.id, min(100.0, pct), description=description)
        except Exception as exc:  # noqa: BLE001 - the bar is the UI's view only; said once, the run goes on
            if not self.warned:
                self.warned = True
                log.warning(f"progress bar {self.key!r} not updated in the Prefect UI ({type(exc).__name__}: {exc}); "
                            "the run goes on, the bar may lag")
