"""vLLM engine arguments a config passes through (`engines:` in the config, tasks/core/config.py), checked
against the installed vLLM before any engine starts.

The names are those of `vllm.engine.arg_utils.EngineArgs` (what `vllm.LLM(**kwargs)` takes), read from
that file's source rather than by importing vLLM (an import takes ~10 s; `draftline config show` and
`plan` must stay quick, and a laptop that only submits runs may have no vLLM at all: then the names
are checked where the engine starts, by `vllm_kwargs`).

Keys draftline sets itself are refused with the config key that sets them, so one value never has two
sources.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
from pathlib import Path
from typing import Any

# EngineArgs fields draftline sets from its own config: the key to use instead.
OWNED = {
    "model": "target.model",
    "tokenizer": "target.model",
    "revision": "target.revision",
    "tokenizer_revision": "target.revision",
    "trust_remote_code": "target.trust_remote_code",
    "max_model_len": "target.max_model_len",
    "dtype": "target.dtype",
    "seed": "data.seed",
    "tensor_parallel_size": "extract.tensor_parallel_size",
    "enforce_eager": "extract.enforce_eager (extraction) or engines.regenerate/benchmark.enforce_eager",
    "speculative_config": "the stage (extraction: the hidden-states method; benchmark: the draft)",
    "kv_transfer_config": "the stage (extraction's hidden-states connector)",
    "disable_log_stats": "the stage (the benchmark reads vLLM's metrics)",
}


def _arg_utils_file() -> Path | None:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "engine" / "arg_utils.py"
    return path if path.is_file() else None


@functools.lru_cache(maxsize=None)
def vllm_engine_arg_names() -> frozenset[str] | None:
    """The field names of the installed vLLM's `EngineArgs` dataclass, or None without vLLM."""
    path = _arg_utils_file()
    if path is None:
        return None
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "EngineArgs":
            return frozenset(st.target.id for st in node.body
                             if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
                             and not st.target.id.startswith("_"))
    return None


def vllm_knows(name: str) -> bool:
    """Whether the installed vLLM takes engine argument `name` (False without vLLM)."""
    names = vllm_engine_arg_names()
    return names is not None and name in names


def engine_args_problems(args: dict[str, Any], where: str) -> list[str]:
    """One line per key of `args` that cannot be passed: set by draftline, or unknown to the installed
    vLLM (with the close names). Unknown names pass when vLLM is not installed here."""
    names = vllm_engine_arg_names()
    out = []
    for key in args:
        if key in OWNED:
            out.append(f"{where}.{key}: set by draftline; fix: use {OWNED[key]}")
        elif names is not None and key not in names:
            close = difflib.get_close_matches(key, sorted(names), n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(close)}?" if close else "see `vllm serve --help` for the names"
            out.append(f"{where}.{key}: not an engine argument of the installed vLLM (vllm.EngineArgs); fix: {hint}")
    return out
