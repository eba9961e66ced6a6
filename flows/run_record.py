"""What a pipeline run did, stage by stage: the summary `draftline run` prints, the flow returns and
the Prefect UI shows.

A caller in the same process (the CLI's `run` and a local `retry`) gets the record of the run it
started, even when that run failed or was stopped by a signal and returned nothing, by wrapping
the flow call in `recording()`: the flow appends its record to the list the caller holds. The list
travels in a context variable, so two callers (or two threads) never see each other's runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from tasks.core.config import STAGES
from tasks.store.artifacts import ArtifactRef


@dataclass
class StageRecord:
    status: str = "pending"          # pending | ran | cached | partial | failed | skipped
    artifact: str | None = None
    executed: int = 0
    cached: int = 0
    failed: int = 0
    seconds: float = 0.0
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunRecord:
    config_path: str | None
    overrides: list[str]
    flow_run_id: str | None = None
    state: str = "RUNNING"
    stages: dict[str, StageRecord] = field(default_factory=lambda: {s: StageRecord() for s in STAGES})
    benchmark: dict[str, Any] | None = None
    serve: dict[str, Any] | None = None  # the trained draft's `vllm serve` line (tasks/benchmark/serve.py run_serve)
    store: str = ""
    started: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        out = {
            "flow_run_id": self.flow_run_id,
            "state": self.state,
            "store": self.store,
            "seconds": round(time.time() - self.started, 1),
            "stages": {
                name: {k: v for k, v in vars(r).items() if k != "stats" or v}
                for name, r in self.stages.items()
            },
        }
        if self.benchmark is not None:
            out["benchmark"] = self.benchmark
        if self.serve is not None:
            out["serve"] = self.serve
        return out


def count_stage(record: StageRecord, refs: list[ArtifactRef]) -> None:
    record.executed = sum(1 for r in refs if r.executed_here)
    record.cached = len(refs) - record.executed


def finish_stage(record: StageRecord, t0: float, refs: list[ArtifactRef], failed: int = 0,
                 executed: int | None = None) -> None:
    """The one status rule: failed when nothing came out, partial when some of it did, else ran or cached.
    EXECUTED: how many of REFS were computed by this run when not all of them ran in this process (other
    nodes' shards); by default the refs say it themselves."""
    count_stage(record, refs)
    if executed is not None:
        record.executed, record.cached = executed, len(refs) - executed
    record.failed = failed
    record.seconds = round(time.time() - t0, 1)
    if failed:
        record.status = "failed" if not refs else "partial"
    else:
        record.status = "ran" if record.executed else "cached"


_RECORDERS: contextvars.ContextVar[list[RunRecord] | None] = contextvars.ContextVar("draftline_run_records",
                                                                                    default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[RunRecord]]:
    """`with recording() as runs: pipeline(...)`: afterwards `runs[-1]` is that run's record."""
    runs: list[RunRecord] = []
    token = _RECORDERS.set(runs)
    try:
        yield runs
    finally:
        _RECORDERS.reset(token)


def announce(rec: RunRecord) -> RunRecord:
    """Hand the flow's record to the caller that is recording (if any)."""
    runs = _RECORDERS.get()
    if runs is not None:
        runs.append(rec)
    return rec
