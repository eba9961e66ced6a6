"""`speculators train` (speculators 0.9's own CLI and Trainer), unchanged, with its steps timed: the reference side
of bench_equal_budget.py's block-head comparison (DFlash, DSpark).

    python benchmarks/speculators_train.py [--cpu] --timing OUT.json -- SPECULATORS_TRAIN_ARGS...

--cpu patches the two CUDA-only spots of their Trainer (bench_train.speculators_on_cpu); pass their own
`--draft-attn-impl sdpa --loss-implementation eager` there too (their flex attention has no CPU backward, their
fused loss needs Triton on a GPU). --timing writes, per training forward pass, the tokens it saw and when it
started: tokens / (next start - this start) is one step's tokens/s, forward, backward and optimizer included.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--")
    ours, theirs = argv[:split], argv[split + 1:]
    timing = Path(ours[ours.index("--timing") + 1])
    if "--cpu" in ours:
        from bench_train import speculators_on_cpu

        speculators_on_cpu()
    import speculators.train.trainer as sp_trainer
    from speculators.train.cli import main as speculators_train
    from speculators.train.config import TrainConfig

    steps: list[tuple[int, float]] = []
    init = sp_trainer.Trainer.__init__

    def timed_init(self, model, *a, **k):
        def hook(module, _args, kwargs):
            if module.training:
                steps.append((int((kwargs["document_ids"] != -1).sum()), time.perf_counter()))

        model.register_forward_pre_hook(hook, with_kwargs=True)
        init(self, model, *a, **k)

    sp_trainer.Trainer.__init__ = timed_init
    sys.argv = ["speculators train", *theirs]
    try:
        speculators_train(TrainConfig.resolve())
    finally:
        steps.append((0, time.perf_counter()))
        timing.write_text(json.dumps({"steps": steps}))


if __name__ == "__main__":
    main()
