"""When training checkpoints are written and which are kept: the checkpointer the loop calls as
`save(step, write)` after every step and `save(step, write, last_step=True)` when it ends.

Cadence: every `train.checkpoint_every` steps before the last, and once at the end unless that step is
already saved (so a crash during evaluation or export never retrains). Retention: the newest
`train.keep_checkpoints` of this train address (`checkpoint/<train digest[:20]>-s<step>`), older ones deleted
after a new one is committed. What a checkpoint holds (weights, optimizer moments, data positions, RNG) is the
trainer's `write()`; a checkpoint is one artifact, committed whole or not at all.
"""

from __future__ import annotations

from typing import Callable

from tasks.store.artifacts import Store
from tasks.train import CKPT_STAGE


def checkpoint_digest(digest: str, step: int) -> str:
    return f"{digest[:20]}-s{step:08d}"


class Checkpointer:
    def __init__(self, store: Store, train_digest: str, every: int, keep: int, max_steps: int):
        self.store, self.train_digest = store, train_digest
        self.every, self.keep, self.max_steps = every, keep, max_steps
        self.last_saved = -1

    def checkpoints(self) -> list[tuple[int, str]]:
        """(step, digest) of this train address's committed checkpoints, oldest first."""
        prefix = self.train_digest[:20] + "-s"
        out = []
        for m in self.store.list(CKPT_STAGE):
            if m.digest.startswith(prefix) and m.inputs.get("train") == self.train_digest:
                out.append((int(m.stats.get("step", -1)), m.digest))
        return sorted(out)

    def resumed_at(self, step: int | None) -> None:
        """The step the run resumed from (already saved), or None for a fresh start."""
        self.last_saved = -1 if step is None else step

    def save(self, step: int, write: Callable[[], str], last_step: bool = False) -> str | None:
        """Write a checkpoint of `step` through `write()` when one is due; its digest, else None."""
        due = self.last_saved != step if last_step else step % self.every == 0 and step < self.max_steps
        if not due:
            return None
        digest = write()
        self.last_saved = step
        return digest

    def prune(self) -> None:
        """Delete all but the newest `keep` checkpoints (rank 0, after a commit)."""
        for _step, old in self.checkpoints()[:-self.keep]:
            self.store.delete(CKPT_STAGE, old)
