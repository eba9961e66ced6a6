"""One place that turns a config into vLLM engine settings, for every purpose: regeneration,
extraction and the benchmark's decoding engines.

Three copies of these rules had drifted apart: regeneration ignored `target.revision` (a pinned
hub revision answered with another revision of the model than the one extracted and benchmarked),
only extraction chose vLLM's reference MLA backend for a float32 MLA target on a CPU, and the
KV-cache size was rounded down in two places and up in the third.
"""

from __future__ import annotations

import math
from typing import Any

from tasks.config import RunConfig
from tasks.engine import engine_dtype


def on_gpu_here() -> bool:
    import torch

    return torch.cuda.is_available()


def engine_env(cfg: RunConfig) -> dict[str, str]:
    """The environment every vLLM engine gets: the CPU KV cache in whole GiB, rounded up (a
    `kv_cache_gib: 1.5` gets 2 GiB, never less than asked)."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(cfg.extract.kv_cache_gib)))}


def vllm_kwargs(cfg: RunConfig, model_path: str, *, on_gpu: bool | None = None, **extra: Any) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments for the target; `extra` adds the purpose's own (speculative_config,
    kv_transfer_config, ...)."""
    from tasks.target import load_hf_config, text_config

    on_gpu = on_gpu_here() if on_gpu is None else on_gpu
    t = cfg.target
    kw: dict[str, Any] = dict(
        max_model_len=t.max_model_len,
        # bf16 on a CPU without native bf16 is many times slower than float32 (tasks/engine.py).
        dtype=engine_dtype(t.dtype, on_gpu=on_gpu),
        trust_remote_code=t.trust_remote_code,
        enforce_eager=cfg.extract.enforce_eager,
        tensor_parallel_size=cfg.extract.tensor_parallel_size,
        seed=cfg.data.seed,
    )
    if t.revision:
        kw["revision"] = t.revision
    if not on_gpu and kw["dtype"] == "float32" and getattr(text_config(load_hf_config(t, model_path)),
                                                           "kv_lora_rank", None):
        # An MLA target (DeepSeek-V3 / Kimi) on a CPU: vLLM picks its AMX MLA backend where the CPU has
        # AMX, and that one takes bf16/fp16/int8 weights only; the reference CPU MLA runs float32.
        kw["attention_backend"] = "CPU_MLA"
    kw.update(extra)
    return kw


def vllm_engine(cfg: RunConfig, model_path: str, name: str, **extra: Any):
    """An unstarted vLLM EngineProcess for `model_path` with the settings above."""
    from tasks.engine import EngineProcess

    return EngineProcess(kind="vllm", model=model_path, llm_kwargs=vllm_kwargs(cfg, model_path, **extra),
                         env=engine_env(cfg), name=name)
