"""One place that turns a config into vLLM engine settings, for every purpose: regeneration,
extraction and the benchmark's decoding engines.

Every purpose must see the same model the same way: the pinned `target.revision` (answers,
hidden states and the benchmark come from one revision), one attention backend for an MLA target
on a CPU, one KV-cache size rule. tests/unit/engine/test_engine_settings.py holds each purpose to these rules.

The same module plans what the engines run on, for regeneration and extraction alike: one engine per
GPU group on a GPU node (a group is `extract.tensor_parallel_size` GPUs), or `extract.cpu_groups`
engines over disjoint cores on a CPU (`engine_groups`, `engine_for_group(..., purpose)`, `EnginePool`).
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from tasks.core.errors import DraftlineError
from tasks.core import stopping

from tasks.core.config import RunConfig
from tasks.engine.process import EngineProcess, engine_dtype, vllm_extract_kwargs


class EngineSettingsError(DraftlineError, ValueError):
    """GPUs or cores asked for that this machine does not have; the message says what to set."""


def on_gpu_here() -> bool:
    import torch

    return torch.cuda.is_available()


def engine_env(cfg: RunConfig) -> dict[str, str]:
    """The environment every vLLM engine gets: the CPU KV cache in whole GiB, rounded up (a
    `kv_cache_gib: 1.5` gets 2 GiB, never less than asked). vLLM on a GPU ignores this variable: its KV
    cache is what `gpu_memory_utilization` leaves, or `kv_cache_memory_bytes` (engines.engine_args)."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(cfg.extract.kv_cache_gib)))}


PURPOSES = ("regenerate", "extract", "benchmark")


def is_vision_language(hf_config: Any) -> bool:
    """A target whose config also describes a vision tower (`vision_config`: Kimi-K2.5's
    KimiK25ForConditionalGeneration, Qwen-VL, Llama-4, ...): the text-only engines here need none of it."""
    return getattr(hf_config, "vision_config", None) is not None


def purpose_kwargs(cfg: RunConfig, purpose: str, *, on_gpu: bool, hf_config: Any) -> dict[str, Any]:
    """What differs by purpose among the `vllm.LLM` kwargs: CUDA graphs, the vision tower, the config's
    `engines:` pass-through (shared, then the purpose's own). None of it changes the bytes a stage stores.

    - enforce_eager: extraction follows extract.enforce_eager; the decoding engines (regeneration, the
      benchmark) follow engines.PURPOSE.enforce_eager, by default CUDA graphs on a GPU (the mode engines
      are served in: a draft benchmarked eager is measured in a mode nobody runs) and eager on a CPU.
    - language_model_only: every engine here reads and writes text only, so a vision-language target is
      loaded without its vision tower (not built, not profiled), where the installed vLLM has the argument.
    """
    from tasks.core.engine_args import engine_args_problems, vllm_knows

    if purpose not in PURPOSES:
        raise ValueError(f"engine purpose {purpose!r}: use one of {', '.join(PURPOSES)}")
    e = cfg.engines
    section = getattr(e, purpose)
    if purpose == "extract":
        eager = cfg.extract.enforce_eager
    else:
        eager = (not on_gpu) if section.enforce_eager is None else section.enforce_eager
    kw: dict[str, Any] = {"enforce_eager": eager}
    if is_vision_language(hf_config) and vllm_knows("language_model_only"):
        kw["language_model_only"] = True
    passed = {**e.engine_args, **section.engine_args}
    problems = engine_args_problems(passed, f"engines ({purpose})")  # checked here too: vLLM is installed here
    if problems:
        raise EngineSettingsError("; ".join(problems))
    kw.update(passed)
    return kw


def vllm_kwargs(cfg: RunConfig, model_path: str, *, on_gpu: bool | None = None, purpose: str = "extract",
                **extra: Any) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments for the target as `purpose` (tasks.engine.settings.PURPOSES) runs it;
    `extra` adds the purpose's own (speculative_config, kv_transfer_config, ...)."""
    from tasks.engine.target import load_hf_config, text_config

    on_gpu = on_gpu_here() if on_gpu is None else on_gpu
    t = cfg.target
    hf_config = load_hf_config(t, model_path)
    kw: dict[str, Any] = dict(
        max_model_len=t.max_model_len,
        # bf16 on a CPU without native bf16 is many times slower than float32 (tasks/engine/process.py).
        dtype=engine_dtype(t.dtype, on_gpu=on_gpu),
        trust_remote_code=t.trust_remote_code,
        tensor_parallel_size=cfg.extract.tensor_parallel_size,
        seed=cfg.data.seed,
    )
    if t.revision:
        kw["revision"] = t.revision
    if not on_gpu and kw["dtype"] == "float32" and getattr(text_config(hf_config), "kv_lora_rank", None):
        # An MLA target (DeepSeek-V3 / Kimi) on a CPU: vLLM picks its AMX MLA backend where the CPU has
        # AMX, and that one takes bf16/fp16/int8 weights only; the reference CPU MLA runs float32.
        kw["attention_backend"] = "CPU_MLA"
    kw.update(purpose_kwargs(cfg, purpose, on_gpu=on_gpu, hf_config=hf_config))
    kw.update(extra)
    return kw


def benchmark_kwargs(cfg: RunConfig, speculative: dict | None, model_path: str | None = None) -> dict[str, Any]:
    """The benchmark's decoding engines' `vllm.LLM` arguments: the target's, plus the draft (`speculative`: vLLM's
    speculative_config; None: the baseline). The one place they are built: the benchmark's engines run with them,
    and the printed `vllm serve` line is built from what its engine at the chosen k got (tasks/benchmark/serve.py)."""
    from tasks.engine.target import resolve_model

    extra: dict[str, Any] = {"disable_log_stats": False}  # the spec-decode counters and latency histograms
    if speculative is not None:
        extra["speculative_config"] = speculative
    return vllm_kwargs(cfg, model_path or resolve_model(cfg.target), purpose="benchmark", **extra)


# ============================================================================ engine groups


def visible_gpus() -> list[int]:
    """GPU ids as CUDA_VISIBLE_DEVICES names them (or 0..n-1 when it is unset)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        items = [x.strip() for x in cvd.split(",") if x.strip()]
        try:
            return [int(x) for x in items]
        except ValueError:
            raise EngineSettingsError(
                f"CUDA_VISIBLE_DEVICES={cvd!r}: draftline needs numeric GPU ids to form groups; use indices"
            ) from None
    try:
        import torch

        return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    except Exception:
        return []


def gpu_groups(cfg: RunConfig) -> list[list[int]]:
    """Visible GPUs split into groups of `tensor_parallel_size`; on CPU one group `[]`."""
    e = cfg.extract
    visible = visible_gpus()
    if e.gpus == 0:
        return [[]]
    if not visible:
        if e.gpus:
            raise EngineSettingsError(f"extract.gpus={e.gpus} but no GPU is visible; set extract.gpus: 0 to use the CPU")
        return [[]]
    n = len(visible) if e.gpus is None else e.gpus
    if n > len(visible):
        raise EngineSettingsError(f"extract.gpus={n} but only {len(visible)} GPU(s) are visible ({visible})")
    tp = e.tensor_parallel_size
    if n < tp:
        raise EngineSettingsError(
            f"extract.tensor_parallel_size={tp} needs {tp} GPUs per engine, only {n} to use; "
            f"lower tensor_parallel_size or raise extract.gpus"
        )
    use = visible[: n - n % tp]
    return [use[i:i + tp] for i in range(0, len(use), tp)]


@dataclass(frozen=True)
class EngineGroup:
    """What one engine of the pool may use: GPUs (one tensor-parallel group), or on a CPU, cores
    (None = every core this process may use)."""

    gpus: tuple[int, ...] = ()
    cpus: tuple[int, ...] | None = None

    @property
    def name(self) -> str:
        if self.gpus:
            return "gpu" + "-".join(map(str, self.gpus))
        return "cpu" + ("-".join(map(str, self.cpus)) if self.cpus else "")


def engine_groups(cfg: RunConfig) -> list[EngineGroup]:
    """The engines regeneration and extraction run side by side: one per GPU group (`gpu_groups`), or on a CPU
    `extract.cpu_groups` engines over disjoint shares of the cores this process may use."""
    gpus = gpu_groups(cfg)
    if gpus != [[]]:
        return [EngineGroup(gpus=tuple(g)) for g in gpus]
    n = cfg.extract.cpu_groups
    if n == 1:
        return [EngineGroup()]
    cores = sorted(os.sched_getaffinity(0))
    if n > len(cores):
        raise EngineSettingsError(f"extract.cpu_groups={n} but this process may use {len(cores)} core(s) ({cores}); "
                           f"set extract.cpu_groups to at most {len(cores)}")
    size = len(cores) // n
    return [EngineGroup(cpus=tuple(cores[i * size:(i + 1) * size])) for i in range(n)]


GROUP_PURPOSES = ("extract", "regenerate")  # the engines a pool of groups runs (the benchmark starts its own)


def engine_for_group(cfg: RunConfig, model_path: str, group: list[int] | EngineGroup,
                     purpose: str = "extract") -> EngineProcess:
    """An engine for PURPOSE (`extract`: hidden states; `regenerate`: the target's answers), not yet
    started (`with engine_for_group(...) as eng:` starts it), that sees only the group's GPUs (a list of
    GPU ids, or an EngineGroup), or only its cores. Named PURPOSE-GROUP (e.g. regenerate-cpu1)."""
    if purpose not in GROUP_PURPOSES:
        raise ValueError(f"engine purpose {purpose!r}: one of {', '.join(GROUP_PURPOSES)}")
    if not isinstance(group, EngineGroup):
        group = EngineGroup(gpus=tuple(group))
    e = cfg.extract
    env = {**engine_env(cfg), "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in group.gpus)}  # "": no GPU
    if group.cpus:  # pinned by the engine itself (tasks/engine/process.py), and vLLM's OpenMP threads with it
        cores = ",".join(map(str, group.cpus))
        env.update({"DRAFTLINE_ENGINE_CPUS": cores, "VLLM_CPU_OMP_THREADS_BIND": cores,
                    "OMP_NUM_THREADS": str(len(group.cpus))})
    on_gpu = bool(group.gpus)
    name = f"{purpose}-{group.name}"
    if purpose == "regenerate":  # a decoding engine: vLLM whatever extract.backend says
        return EngineProcess("vllm", model_path, vllm_kwargs(cfg, model_path, on_gpu=on_gpu, purpose="regenerate"),
                             env=env, name=name)
    from tasks.engine.target import load_hf_config, resolve_layer_ids

    layer_ids = resolve_layer_ids(cfg, load_hf_config(cfg.target, model_path))
    if e.backend == "vllm":
        kwargs = vllm_kwargs(cfg, model_path, on_gpu=on_gpu, purpose="extract",
                             **vllm_extract_kwargs(layer_ids, asynchronous=on_gpu))
    else:
        kwargs = {"max_model_len": cfg.target.max_model_len, "trust_remote_code": cfg.target.trust_remote_code,
                  "max_batch_tokens": e.batch_tokens}
        if cfg.target.revision:
            kwargs["revision"] = cfg.target.revision
        if on_gpu:
            kwargs["dtype"] = cfg.target.dtype  # CPU keeps float32 (bf16 matmuls are slow there)
    return EngineProcess(e.backend, model_path, kwargs, env=env, name=name)


class EnginePool:
    """One engine per group (GPU group or CPU core group), started on first use and shared by the
    shard tasks (regeneration's or extraction's) running side by side.

    A shard borrows a group's engine; if that engine died (killed, OOM), the shard that was using
    it fails and the next borrower gets a fresh engine on the same group.
    """

    def __init__(self, factory: Callable[[Any], EngineProcess], groups: list[Any]):
        self.factory = factory
        self.groups = groups
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(len(groups)):
            self._free.put(i)
        self._engines: dict[int, EngineProcess] = {}

    @classmethod
    def for_purpose(cls, cfg: RunConfig, model_path: str, purpose: str) -> "EnginePool":
        """The pool a stage's shard tasks share on this node: one PURPOSE engine per `engine_groups(cfg)`."""
        return cls(lambda group: engine_for_group(cfg, model_path, group, purpose), engine_groups(cfg))

    def _take(self) -> int:
        while True:  # every group busy: wait for one, but not past a stop request
            stopping.check("waiting for a free engine group")
            try:
                return self._free.get(timeout=0.5)
            except queue.Empty:
                continue

    @contextlib.contextmanager
    def engine(self) -> Iterator[EngineProcess]:
        idx = self._take()
        try:
            eng = self._engines.get(idx)
            if eng is None or not eng.alive:
                if eng is not None:
                    eng.close()
                eng = self.factory(self.groups[idx])
                eng.start()
                self._engines[idx] = eng
            yield eng
        finally:
            self._free.put(idx)

    def close(self) -> None:
        for eng in self._engines.values():
            with contextlib.suppress(Exception):
                eng.close()
        self._engines.clear()
