"""The benchmark stage (`stage.py`: engines, drafts and the order of measurements) and its parts: the
evals' prompts (`prompts.py`), what a batch of requests measures (`measure.py`), greedy identity
against a control (`identity.py`), report.json (`results.py`), the offline replay (`replay.py`),
report.md, the plot and the terminal (`report.py`), and the served draft (`serve.py`: the
`vllm serve` line and `draftline export`), each engine's figures committed as it closes (`engine_runs.py`),
and the evidence `draftline check` reads for a trained draft (`evidence.py`), and what the flow shows of a benchmark
(`shown.py`).
This file holds the stage's name and its error.
"""

from __future__ import annotations

from tasks.core.errors import DraftlineError

STAGE = "benchmark"


class BenchmarkError(DraftlineError, ValueError):
    """The benchmark cannot run as configured; the message says what to change."""
