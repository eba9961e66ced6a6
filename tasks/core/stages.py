"""The stage registry: one line per stage, in the order the flow runs them, importable without torch or Prefect
(the command line, the store's listings and the flow's task names all read it; the stage modules, which may
import torch, are named here by their dotted path and imported only by the flow).

A line says the stage's name (the name `--until` and `ls --stage` take, its record's key, its Prefect task's
name), the module whose `STAGE_DEF` the flow runs (tasks/store/stages.py says what one is), the store folder
of its own artifact (default: its name) and, for a sharded stage, the folder of its shards' artifacts. Every
other list of stages derives from `REGISTRY`: tasks/core/config.py's `STAGES`, `stage_folders()`, the flow's `STAGE_DEFS`, the
task names the flow gives (`task_name`) and their parser (`parse_task_name`). Adding a stage is writing its
module and one line here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tasks.core.errors import ConfigError, did_you_mean

SHARD = "shard"  # a shard task's name: STAGE-shard-I


@dataclass(frozen=True)
class StageEntry:
    """One stage as the light parts of draftline know it (no callables: those are its module's STAGE_DEF)."""

    name: str                        # the stage: `--until`'s value, its task's name, its record's key
    module: str                      # the module whose STAGE_DEF the flow runs
    folder: str = ""                 # where the stage's own artifact is committed (default: its name)
    shard_folder: str | None = None  # a sharded stage's: where each shard's artifact is committed

    @property
    def store_folder(self) -> str:
        return self.folder or self.name

    @property
    def sharded(self) -> bool:
        return self.shard_folder is not None

    @property
    def folders(self) -> tuple[str, ...]:
        """Where the stage's artifacts are on the store: its own artifact's folder, then its shards'."""
        return (self.store_folder,) + ((self.shard_folder,) if self.shard_folder else ())


REGISTRY: list[StageEntry] = [
    StageEntry("prepare", "tasks.data.prepare"),
    StageEntry("regenerate", "tasks.data.regenerate", shard_folder="regenerate-shard"),
    StageEntry("vocab", "tasks.data.vocab"),
    StageEntry("extract", "tasks.extract.stage", folder="extract-stage", shard_folder="extract"),
    StageEntry("train", "tasks.train.stage"),
    StageEntry("benchmark", "tasks.benchmark.stage"),
]


def register(entry: StageEntry) -> None:
    """Add ENTRY after the stages registered (before a module reading `STAGES` or `stage_folders()` is
    imported: a test's throwaway stage, tests/repo/test_layout.py)."""
    if entry.name in stage_names() or set(entry.folders) & {f for e in REGISTRY for f in e.folders}:
        raise ValueError(f"stage {entry.name!r}: its name or a folder of {entry.folders} is registered already")
    REGISTRY.append(entry)


def stage(name: str) -> StageEntry:
    """The registry's line for stage NAME."""
    for e in REGISTRY:
        if e.name == name:
            return e
    raise KeyError(f"no stage {name!r}: the stages are {', '.join(stage_names())}")


def stage_names() -> tuple[str, ...]:
    return tuple(e.name for e in REGISTRY)


def stage_folders() -> dict[str, tuple[str, ...]]:
    """Each stage's store folders, its own artifact's then its shards' (`draftline ls --stage`)."""
    return {e.name: e.folders for e in REGISTRY}


def task_name(stage_name: str, shard: int | None = None, variant: str | None = None) -> str:
    """The Prefect task-run name the flow gives: `extract`, `extract-shard-3`, `train-eagle3` (a variant: one
    head of several)."""
    if shard is not None:
        return f"{stage_name}-{SHARD}-{shard}"
    return f"{stage_name}-{variant}" if variant else stage_name


def parse_task_name(name: str) -> tuple[str, int | None] | None:
    """`extract-shard-3` -> ("extract", 3); `train-eagle3` -> ("train", None); a name no stage's task has (a
    progress artifact's key, another flow's task) -> None. A shard index only for a sharded stage's shards."""
    for e in sorted(REGISTRY, key=lambda e: -len(e.name)):  # the longest name first: no stage shadows another
        if name == e.name:
            return e.name, None
        if name.startswith(e.name + "-"):
            m = re.fullmatch(rf"{SHARD}-(\d+)", name[len(e.name) + 1:])
            return e.name, (int(m.group(1)) if m and e.sharded else None)
    return None


def check_stage(name: str | None, option: str) -> str | None:
    """A stage named on the command line (`--until`, `ls --stage`): a registered stage, or None for all."""
    names = stage_names()
    if name is not None and name not in names:
        raise ConfigError(f"{option} {name!r}: use one of {', '.join(names)}{did_you_mean(name, names)}")
    return name


def check_until(until: str | None) -> str | None:
    """`--until STAGE` (run, submit, the flow's parameter): a stage name, or None for the whole pipeline."""
    return check_stage(until, "--until")
