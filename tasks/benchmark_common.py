"""What the benchmark modules share: the stage's name and its error."""

from __future__ import annotations

STAGE = "benchmark"


class BenchmarkError(ValueError):
    """The benchmark cannot run as configured; the message says what to change."""
