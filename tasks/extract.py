"""Stage `extract`: run the target over each data shard once and store its hidden states.

One artifact per shard (`extract/DIGEST/`), so a failed or killed shard is the
only work repeated: every other shard is committed and found on the store.

    plans = plan_extract(cfg, data_ref, hf_config)           # one ShardPlan (and digest) per shard
    for group in gpu_groups(cfg):                            # the flow fans shards over groups
        with engine_for_group(cfg, model_path, group) as engine:
            refs = [extract_shard(cfg, store, p, engine) for p in my_plans]

Inside a shard three things run at once: the engine computes batch k+1, the
calling thread collects batch k into the current part, and a background writer
serializes, hashes and uploads the previous part (`extract.write_overlap`, at
most `extract.write_queue` parts waiting, so memory stays bounded). The
manifest is committed after the last part is written; any failure commits nothing.

A shard's parts hold `hidden_states` [T, L, H] for the auxiliary layers
`layer_ids[:-1]` plus the last decoder layer's pre-norm output, `input_ids`,
`loss_mask` and `offsets` (docs/ARTIFACTS.md); `load_part` reads one back as
bf16 whatever the storage dtype. `storage_dtype: fp8` stores float8_e4m3fn with
one float32 scale per token and layer, about half the bytes of bf16.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterator

from pydantic import BaseModel, Field

from tasks.config import RunConfig
from tasks.digest import VERSIONS, stage_digest
from tasks.engine import EngineError, EngineProcess, vllm_extract_kwargs
from tasks.engine_settings import engine_env, vllm_kwargs
from tasks.faults import kill_point
from tasks.store import ArtifactRef, ArtifactWriter, Store
from tasks.target import default_layer_ids, load_hf_config, text_config, validate_for_vllm, validate_layer_ids

STAGE = "extract"
# Keys that decide where and how fast extraction runs, not what it produces.
SCHEDULING_KEYS = {"gpus", "cpu_groups", "kv_cache_gib", "batch_tokens", "tensor_parallel_size", "enforce_eager",
                   "write_overlap", "write_queue", "write_workers"}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DATA_STAGES = ("prepare", "regenerate")

ProgressCallback = Callable[[int, int], None]  # (tokens done, tokens in the shard)


class ExtractError(RuntimeError):
    """Extraction cannot proceed; the message names the problem and the fix."""


class ShardPlan(BaseModel):
    """Everything one shard's extraction needs, and the digest its artifact lives under."""

    shard: int
    digest: str
    data_stage: str
    data_digest: str
    data_file: str
    layer_ids: list[int]
    hidden_size: int
    num_layers: int
    config: dict[str, Any] = Field(default_factory=dict, description="the extract section that made the digest")

    @property
    def inputs(self) -> dict[str, str]:
        return {"data": self.data_digest, "shard": str(self.shard)}


# ============================================================================ planning


def resolve_layer_ids(cfg: RunConfig, hf_config: Any) -> list[int]:
    n = int(text_config(hf_config).num_hidden_layers)
    ids = list(cfg.extract.layer_ids) if cfg.extract.layer_ids else default_layer_ids(n)
    return validate_layer_ids(ids, n)


def digest_section(cfg: RunConfig, layer_ids: list[int]) -> dict[str, Any]:
    """The extract section minus scheduling-only keys, with the layer ids resolved
    (so `layer_ids: null` and the same ids written out share a digest)."""
    section = cfg.extract.model_dump(mode="json", exclude=SCHEDULING_KEYS)
    section["layer_ids"] = list(layer_ids)
    return section


def plan_extract(cfg: RunConfig, data_ref: ArtifactRef, hf_config: Any) -> list[ShardPlan]:
    if data_ref.stage not in DATA_STAGES:
        raise ExtractError(f"extract reads a prepare or regenerate artifact, got stage {data_ref.stage!r}")
    num_shards = data_ref.stats.get("num_shards")
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ExtractError(
            f"{data_ref.uri}: its stats have no num_shards ({data_ref.stats.get('num_shards')!r}); "
            "re-run the prepare stage (its manifest must list num_shards)"
        )
    text = text_config(hf_config)
    layer_ids = resolve_layer_ids(cfg, hf_config)
    if cfg.extract.backend == "vllm":  # refuse what vLLM would refuse (or misread) before any engine loads
        validate_for_vllm(hf_config, layer_ids, cfg.target.model)
    section = digest_section(cfg, layer_ids)
    plans = []
    for i in range(num_shards):
        digest = stage_digest(STAGE, section, {"data": data_ref.digest, "shard": str(i)})
        plans.append(ShardPlan(shard=i, digest=digest, data_stage=data_ref.stage, data_digest=data_ref.digest,
                               data_file=f"shard-{i:05d}.parquet", layer_ids=layer_ids,
                               hidden_size=int(text.hidden_size), num_layers=int(text.num_hidden_layers),
                               config=section))
    return plans


# ============================================================================ GPU groups and engines


def visible_gpus() -> list[int]:
    """GPU ids as CUDA_VISIBLE_DEVICES names them (or 0..n-1 when it is unset)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        items = [x.strip() for x in cvd.split(",") if x.strip()]
        try:
            return [int(x) for x in items]
        except ValueError:
            raise ExtractError(
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
            raise ExtractError(f"extract.gpus={e.gpus} but no GPU is visible; set extract.gpus: 0 to use the CPU")
        return [[]]
    n = len(visible) if e.gpus is None else e.gpus
    if n > len(visible):
        raise ExtractError(f"extract.gpus={n} but only {len(visible)} GPU(s) are visible ({visible})")
    tp = e.tensor_parallel_size
    if n < tp:
        raise ExtractError(
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
    """The engines extraction runs side by side: one per GPU group (`gpu_groups`), or on a CPU
    `extract.cpu_groups` engines over disjoint shares of the cores this process may use."""
    gpus = gpu_groups(cfg)
    if gpus != [[]]:
        return [EngineGroup(gpus=tuple(g)) for g in gpus]
    n = cfg.extract.cpu_groups
    if n == 1:
        return [EngineGroup()]
    cores = sorted(os.sched_getaffinity(0))
    if n > len(cores):
        raise ExtractError(f"extract.cpu_groups={n} but this process may use {len(cores)} core(s) ({cores}); "
                           f"set extract.cpu_groups to at most {len(cores)}")
    size = len(cores) // n
    return [EngineGroup(cpus=tuple(cores[i * size:(i + 1) * size])) for i in range(n)]


def engine_for_group(cfg: RunConfig, model_path: str, group: list[int] | EngineGroup) -> EngineProcess:
    """An extraction engine (not yet started: `with engine_for_group(...) as eng:` starts it)
    that sees only the group's GPUs (a list of GPU ids, or an EngineGroup), or only its cores."""
    if not isinstance(group, EngineGroup):
        group = EngineGroup(gpus=tuple(group))
    e = cfg.extract
    hf_config = load_hf_config(cfg.target, model_path)
    layer_ids = resolve_layer_ids(cfg, hf_config)
    env = {**engine_env(cfg), "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in group.gpus)}  # "": no GPU
    if group.cpus:  # pinned by the engine itself (tasks/engine.py), and vLLM's OpenMP threads with it
        cores = ",".join(map(str, group.cpus))
        env.update({"DRAFTLINE_ENGINE_CPUS": cores, "VLLM_CPU_OMP_THREADS_BIND": cores,
                    "OMP_NUM_THREADS": str(len(group.cpus))})
    on_gpu = bool(group.gpus)
    if e.backend == "vllm":
        kwargs = vllm_kwargs(cfg, model_path, on_gpu=on_gpu, **vllm_extract_kwargs(layer_ids))
    else:
        kwargs = {"max_model_len": cfg.target.max_model_len, "trust_remote_code": cfg.target.trust_remote_code,
                  "max_batch_tokens": e.batch_tokens}
        if cfg.target.revision:
            kwargs["revision"] = cfg.target.revision
        if on_gpu:
            kwargs["dtype"] = cfg.target.dtype  # CPU keeps float32 (bf16 matmuls are slow there)
    return EngineProcess(e.backend, model_path, kwargs, env=env, name=f"extract-{group.name}")


# ============================================================================ parts on disk

_ST_DTYPES = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float32": "F32", "int32": "I32",
              "uint8": "U8", "int64": "I64"}


def _tensor_bytes(t: Any) -> memoryview:
    import torch

    t = t.detach().contiguous().cpu()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b"")


def write_safetensors_stream(fh: BinaryIO, tensors: list[tuple[str, str, list[int], list[Any]]],
                             metadata: dict[str, str]) -> int:
    """Write a safetensors file from chunks, without concatenating them in memory.

    tensors: (name, torch dtype name, shape, chunks); the chunks of one tensor, in
    order, make up its row-major data. Returns the bytes written.
    """
    import torch

    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, chunks in tensors:
        nbytes = sum(c.numel() * c.element_size() for c in chunks)
        elem = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        if nbytes != math.prod(shape) * elem:
            raise ValueError(f"{name}: chunks hold {nbytes} bytes, shape {shape} of {dtype} needs "
                             f"{math.prod(shape) * elem}")
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    fh.write(struct.pack("<Q", len(raw)))
    fh.write(raw)
    for _name, _dtype, _shape, chunks in tensors:
        for c in chunks:
            fh.write(_tensor_bytes(c))
    return 8 + len(raw) + offset


def quantize_fp8(hidden: Any) -> tuple[Any, Any]:
    """[T, L, H] -> (float8_e4m3fn [T, L, H], float32 scales [T, L]); x ~= q * scale."""
    import torch

    x = hidden.float()
    scale = (x.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: Any, scale: Any) -> Any:
    import torch

    return (q.float() * scale.float().unsqueeze(-1)).to(torch.bfloat16)


def _copy_into(dst: Any, src: Any) -> None:
    """dst[...] = src for contiguous tensors of one dtype, on this thread only (numpy's copy, which
    releases the GIL). torch's copy_ runs on all the process's intra-op threads, and on the H200's
    host, while the engine process computed the next batch, those parallel copies were held up to
    the engine's pace (8 x 2048 tokens of SmolLM2 shape: 4.5 ms alone, 42 ms beside the engine)."""
    import numpy as np
    import torch

    np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())


class _PartBuffer:
    """Samples collected for one part, copied into preallocated tensors; flushed as one safetensors file.

    A buffer is reused from part to part (`_PartWriter` hands written ones back), so a shard
    allocates at most write_queue + 1 of them and its resident memory stays flat. (Reuse alone
    did not speed up collecting on the H200: the cost there was the multi-threaded copy, see
    `_copy_into`.) `capacity` tokens are allocated on first use and grown (doubling) if a part
    outgrows them.
    """

    def __init__(self, layer_ids: list[int], hidden_size: int, storage_dtype: str, capacity: int = 0):
        self.layer_ids = layer_ids
        self.hidden_size = hidden_size
        self.storage_dtype = storage_dtype
        self.capacity = 0
        self._want = max(1, capacity)
        self._hidden: Any = None  # [capacity, L, H] in the storage dtype
        self._scales: Any = None  # fp8: float32 [capacity, L]
        self._ids: Any = None  # int32 [capacity]
        self._mask: Any = None  # uint8 [capacity]
        self.reset()

    def reset(self) -> None:
        """Empty the buffer; its memory is kept for the next part."""
        self.sample_ids: list[str] = []
        self.lengths: list[int] = []
        self.tokens = 0

    def _reserve(self, tokens: int) -> None:
        import torch

        if tokens <= self.capacity:
            return
        cap = max(tokens, self._want, 2 * self.capacity)
        n_l, h, t = len(self.layer_ids), self.hidden_size, self.tokens
        fp8 = self.storage_dtype == "fp8"
        hidden = torch.empty(cap, n_l, h, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
        scales = torch.empty(cap, n_l, dtype=torch.float32) if fp8 else None
        ids, mask = torch.empty(cap, dtype=torch.int32), torch.empty(cap, dtype=torch.uint8)
        if t:  # outgrown mid-part: keep what it holds
            hidden[:t].copy_(self._hidden[:t])
            ids[:t].copy_(self._ids[:t])
            mask[:t].copy_(self._mask[:t])
            if fp8:
                scales[:t].copy_(self._scales[:t])
        self._hidden, self._scales, self._ids, self._mask, self.capacity = hidden, scales, ids, mask, cap

    def add(self, sample_id: str, input_ids: Any, loss_mask: Any, hidden: Any) -> None:
        """Copies `hidden` [T, L, H] in (it may live in memory the engine reuses: extract(ring=True))."""
        import torch

        n = int(hidden.shape[0])
        if len(input_ids) != n or len(loss_mask) != n:
            raise ExtractError(f"sample {sample_id}: {n} hidden states for {len(input_ids)} input_ids and "
                               f"{len(loss_mask)} loss_mask values")
        self._reserve(self.tokens + n)
        a, b = self.tokens, self.tokens + n
        if self.storage_dtype == "fp8":
            q, s = quantize_fp8(hidden)
            self._hidden[a:b].copy_(q)
            self._scales[a:b].copy_(s)
        elif hidden.dtype == torch.bfloat16 and hidden.is_contiguous():
            _copy_into(self._hidden[a:b], hidden)
        else:
            self._hidden[a:b].copy_(hidden)  # casts to bf16 if the engine returned another dtype
        self._ids[a:b].copy_(torch.as_tensor(input_ids, dtype=torch.int32))
        self._mask[a:b].copy_(torch.as_tensor(loss_mask, dtype=torch.uint8))
        self.sample_ids.append(sample_id)
        self.lengths.append(n)
        self.tokens = b

    def write(self, fh: BinaryIO) -> int:
        import torch

        t, n_l, h = self.tokens, len(self.layer_ids), self.hidden_size
        offsets = torch.zeros(len(self.lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(self.lengths, dtype=torch.int64).cumsum(0)
        def rows(x: Any) -> list[Any]:  # the filled rows, as one chunk (none before the first add)
            return [x[:t]] if t else []

        tensors = [("hidden_states", "float8_e4m3fn" if self.storage_dtype == "fp8" else "bfloat16",
                    [t, n_l, h], rows(self._hidden))]
        if self.storage_dtype == "fp8":
            tensors.append(("hidden_scales", "float32", [t, n_l], rows(self._scales)))
        tensors += [("input_ids", "int32", [t], rows(self._ids)),
                    ("loss_mask", "uint8", [t], rows(self._mask)),
                    ("offsets", "int64", [len(self.lengths) + 1], [offsets])]
        meta = {"sample_ids": json.dumps(self.sample_ids), "layer_ids": json.dumps(self.layer_ids),
                "storage_dtype": self.storage_dtype, "hidden_size": str(h), "format": "draftline-extract-v1"}
        return write_safetensors_stream(fh, tensors, meta)


def load_part(path: str) -> dict[str, Any]:
    """One part as {"hidden_states" bf16 [T, L, H], "input_ids" int32 [T], "loss_mask" uint8 [T],
    "offsets" int64 [N+1], "sample_ids" list[str], "layer_ids" list[int], "storage_dtype" str}.
    fp8 parts are dequantized with their per-token-per-layer scales."""
    import torch
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        meta = f.metadata() or {}
        names = set(f.keys())
        missing = {"hidden_states", "input_ids", "loss_mask", "offsets"} - names
        if missing:
            raise ExtractError(f"{path} is not an extraction part: it lacks {sorted(missing)}")
        hs = f.get_tensor("hidden_states")
        if hs.dtype == torch.float8_e4m3fn:
            if "hidden_scales" not in names:
                raise ExtractError(f"{path}: fp8 hidden_states without hidden_scales; the part is corrupt")
            hs = dequantize_fp8(hs, f.get_tensor("hidden_scales"))
        else:
            hs = hs.to(torch.bfloat16)
        out = {
            "hidden_states": hs,
            "input_ids": f.get_tensor("input_ids"),
            "loss_mask": f.get_tensor("loss_mask"),
            "offsets": f.get_tensor("offsets"),
        }
    out["sample_ids"] = json.loads(meta.get("sample_ids", "[]"))
    out["layer_ids"] = json.loads(meta.get("layer_ids", "[]"))
    out["storage_dtype"] = meta.get("storage_dtype", "bf16")
    return out


# ============================================================================ the stage


def _read_shard(store: Store, plan: ShardPlan) -> list[tuple[str, list[int], list[int]]]:
    import pyarrow.parquet as pq

    data = store.open(plan.data_stage, plan.data_digest)
    if plan.data_file not in data.files():
        raise ExtractError(f"{data.uri} has no {plan.data_file} (files: {data.files()[:5]}...); "
                           "its num_shards does not match its files: re-run the data stage")
    with data.local_copy(plan.data_file) as path:
        table = pq.read_table(path, columns=["sample_id", "input_ids", "loss_mask"])
    rows = table.to_pydict()
    samples = []
    for sid, ids, mask in zip(rows["sample_id"], rows["input_ids"], rows["loss_mask"]):
        if len(ids) != len(mask):
            raise ExtractError(f"{data.uri}/{plan.data_file}: sample {sid} has {len(ids)} input_ids but "
                               f"{len(mask)} loss_mask values; re-run the data stage")
        if ids:
            samples.append((sid, ids, mask))
    return samples


def _batches(samples: list, batch_tokens: int) -> Iterator[list]:
    batch: list = []
    tokens = 0
    for s in samples:
        n = len(s[1])
        if batch and tokens + n > batch_tokens:
            yield batch
            batch, tokens = [], 0
        batch.append(s)
        tokens += n
    if batch:
        yield batch


def _store_batch(plan: ShardPlan, buf: "_PartBuffer", batch: list, hidden: list, done: int,
                 masked: int) -> tuple[int, int]:
    if len(hidden) != len(batch):
        raise ExtractError(f"the engine returned {len(hidden)} results for {len(batch)} samples")
    for (sid, ids, mask), hs in zip(batch, hidden):
        if hs.shape[-1] != plan.hidden_size:
            raise ExtractError(f"the engine returned hidden size {hs.shape[-1]}, the target config says "
                               f"{plan.hidden_size}: the engine runs a different model than planned")
        buf.add(sid, ids, mask, hs)
        masked += int(sum(mask))
        done += len(ids)
    return done, masked


class _Cancelled(Exception):
    """The shard failed elsewhere: the background writer stops mid-part."""


class _CancellableFile:
    """Passes writes through until the shard is cancelled, then stops the part being written."""

    def __init__(self, fh: BinaryIO, cancelled: threading.Event):
        self.fh, self.cancelled = fh, cancelled

    def write(self, b: Any) -> int:
        if self.cancelled.is_set():
            raise _Cancelled("the shard failed; part write stopped")
        return self.fh.write(b)


class _PartWriter:
    """Writes finished parts into the attempt, on `workers` background threads when `depth` > 0.

    Serializing, hashing (while writing, see `ArtifactWriter.open`) and uploading parts then
    overlap the engine's forward of the next batches; several workers write several parts at
    once (one stream hashes and writes at ~1 GB/s, less than a GPU extracts). At most `depth`
    parts are handed over and not yet written (those being written included): `put` blocks
    beyond that, so hidden states in memory stay bounded by depth + 1 parts. `depth` 0 writes
    inline (the serial path). Written buffers are emptied and kept for `take` to hand out again,
    so at most depth + 1 buffers are ever allocated.

    A write error is re-raised in the caller, unchanged, at the next `put`/`check`/`finish`, and
    stops the other workers' parts. Leaving the `with` block stops the threads (cancelling the
    parts being written when the shard failed), so the attempt is aborted with no writer still
    adding files to it.
    """

    def __init__(self, w: ArtifactWriter, depth: int, name: str, workers: int = 1):
        self.w = w
        self.depth = depth
        self.parts: list[tuple[str, int]] = []  # (name, tokens) in hand-over order
        self.write_s = 0.0  # time spent writing parts, summed over the workers
        self.peak_in_flight = 0
        self.error: BaseException | None = None
        self._pending: deque[tuple[str, _PartBuffer]] = deque()  # handed over, not started
        self._free: list[_PartBuffer] = []  # written and emptied, for `take`
        self._active = 0  # being written
        self._closing = False
        self._cancelled = threading.Event()
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        if depth > 0:
            for k in range(max(1, min(workers, depth))):
                t = threading.Thread(target=self._run, name=f"{name}-{k}", daemon=True)
                t.start()
                self._threads.append(t)

    def put(self, buf: "_PartBuffer") -> None:
        """Hand over a filled part; the caller starts a new buffer."""
        if not buf.tokens:
            return
        name = f"part-{len(self.parts):05d}.safetensors"
        if not self._threads:
            self.parts.append((name, buf.tokens))
            self.peak_in_flight = 1
            self._write(name, buf)
            buf.reset()
            self._free.append(buf)
            return
        with self._cond:
            while len(self._pending) + self._active >= self.depth and self.error is None:
                self._cond.wait()
            self._raise_error()
            self.parts.append((name, buf.tokens))
            self._pending.append((name, buf))
            self.peak_in_flight = max(self.peak_in_flight, len(self._pending) + self._active)
            self._cond.notify_all()

    def take(self) -> "_PartBuffer | None":
        """A written, emptied buffer to fill again (its memory already touched), or None."""
        with self._cond:
            return self._free.pop() if self._free else None

    def check(self) -> None:
        """Raise the writer's error, if it has failed, without waiting."""
        with self._cond:
            self._raise_error()

    def finish(self) -> None:
        """Wait until every part handed over is written; raise the writer's error if it failed."""
        self._stop(cancel=False)
        self._raise_error()

    def __enter__(self) -> "_PartWriter":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self._stop(cancel=exc_type is not None)

    def _stop(self, cancel: bool) -> None:
        if not self._threads:
            return
        with self._cond:
            if cancel:
                self._cancelled.set()
                self._pending.clear()
            self._closing = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()
        self._threads = []

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def _write(self, name: str, buf: "_PartBuffer") -> None:
        t0 = time.monotonic()
        with self.w.open(name) as fh:
            buf.write(_CancellableFile(fh, self._cancelled))  # type: ignore[arg-type]
        with self._cond:
            self.write_s += time.monotonic() - t0
        kill_point("extract.part-written")

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                name, buf = self._pending.popleft()
                self._active += 1
            try:
                if self.error is None and not self._cancelled.is_set():
                    self._write(name, buf)
            except BaseException as exc:  # handed to the caller; the other parts are stopped
                if not isinstance(exc, _Cancelled):
                    with self._cond:
                        self.error = self.error or exc
                    self._cancelled.set()
            finally:
                buf.reset()
                with self._cond:  # back to the pool before `put` may go on, so buffers stay <= depth + 1
                    self._free.append(buf)
                    self._active -= 1
                    self._cond.notify_all()


def extract_shard(cfg: RunConfig, store: Store, plan: ShardPlan, engine: EngineProcess,
                  progress_cb: ProgressCallback | None = None) -> ArtifactRef:
    """Extract one shard into `extract/<plan.digest>/`; returns at once if it is already committed.

    Three things run at once: the engine computes batch k+1 (one call ahead), this thread
    collects batch k into the current part, and a background writer stores the previous
    part(s) (`extract.write_overlap`, at most `extract.write_queue` parts queued). The
    manifest is committed only after every part is written; a failure anywhere (the engine
    dying, a store error in the writer) raises that error and commits nothing.
    """
    found = store.find(STAGE, plan.digest)
    if found is not None:
        return found.ref()

    e = cfg.extract
    samples = _read_shard(store, plan)
    total = sum(len(s[1]) for s in samples)
    limit = int(engine.info.get("max_model_len") or cfg.target.max_model_len)
    too_long = [(s[0], len(s[1])) for s in samples if len(s[1]) >= limit]
    if too_long:
        raise ExtractError(
            f"shard {plan.shard}: {len(too_long)} sample(s) do not fit the engine's max_model_len={limit} "
            f"(e.g. {too_long[0][0]}: {too_long[0][1]} tokens); raise target.max_model_len above "
            "data.max_length or lower data.max_length"
        )
    engine_ids = engine.info.get("layer_ids")
    if engine_ids is not None and list(engine_ids) != plan.layer_ids:
        raise ExtractError(f"the engine extracts layers {engine_ids}, shard {plan.shard} needs {plan.layer_ids}; "
                           "start it with engine_for_group(cfg, ...) for this config")

    t0 = time.monotonic()
    done = masked = 0
    engine_wait = write_wait = 0.0  # time this thread waited for the engine / for the part writer
    collect = 0.0  # time this thread spent collecting batches into parts
    # A part ends at the first batch that reaches part_tokens: it holds at most part_tokens - 1 + one batch.
    batches = list(_batches(samples, e.batch_tokens))
    longest_batch = max((sum(len(s[1]) for s in b) for b in batches), default=0)
    capacity = min(total, e.part_tokens - 1 + longest_batch)
    new_buffer = lambda: _PartBuffer(plan.layer_ids, plan.hidden_size, e.storage_dtype, capacity)  # noqa: E731
    buf = new_buffer()

    with store.write(STAGE, plan.digest, VERSIONS[STAGE], inputs=plan.inputs, config=plan.config) as w:
        if progress_cb:
            progress_cb(0, total)
        depth = e.write_queue if e.write_overlap else 0
        with ThreadPoolExecutor(1, thread_name_prefix=f"extract-{plan.shard}") as ahead, \
                _PartWriter(w, depth, f"extract-{plan.shard}-writer", e.write_workers) as writer:
            # The engine computes batch k+1 while this thread collects batch k. A transformers engine
            # copies into two shared buffers it alternates between (no file written per call): batch
            # k is copied out here before batch k+2 is asked for, which is when its buffer is reused.
            ring = engine.kind == "transformers"
            call = functools.partial(engine.extract, ring=True) if ring else engine.extract
            pending = ahead.submit(call, [s[1] for s in batches[0]], plan.layer_ids) if batches else None
            for k, batch in enumerate(batches):
                assert pending is not None
                t1 = time.monotonic()
                hidden = pending.result()
                engine_wait += time.monotonic() - t1
                pending = (ahead.submit(call, [s[1] for s in batches[k + 1]], plan.layer_ids)
                           if k + 1 < len(batches) else None)
                t1 = time.monotonic()
                done, masked = _store_batch(plan, buf, batch, hidden, done, masked)
                collect += time.monotonic() - t1
                del hidden
                if buf.tokens >= e.part_tokens:
                    t1 = time.monotonic()
                    writer.put(buf)  # blocks while write_queue parts are still being written
                    write_wait += time.monotonic() - t1
                    buf = writer.take() or new_buffer()
                writer.check()  # a failed write fails the shard now, not after the last batch
                if progress_cb:
                    progress_cb(done, total)
            t1 = time.monotonic()
            writer.put(buf)
            writer.finish()
            write_wait += time.monotonic() - t1
        seconds = time.monotonic() - t0
        stored = sum(f.bytes for f in w.files)
        w.files.sort(key=lambda f: f.path)  # workers finish parts in any order; names are zero-padded
        if [f.path for f in w.files] != [n for n, _ in writer.parts]:  # never expected: a writer bug
            raise ExtractError(f"shard {plan.shard}: parts written {[f.path for f in w.files]} differ from "
                               f"parts planned {[n for n, _ in writer.parts]}; nothing was committed")
        stats = {
            "shard": plan.shard, "samples": len(samples), "tokens": total, "masked_tokens": masked,
            "layer_ids": plan.layer_ids, "hidden_size": plan.hidden_size, "storage_dtype": e.storage_dtype,
            "bytes": stored, "bytes_per_token": round(stored / total, 2) if total else 0.0,
            "tokens_per_s": round(total / seconds, 1) if seconds > 0 else 0.0, "seconds": round(seconds, 2),
            "parts": [{"name": n, "tokens": t} for n, t in writer.parts], "backend": engine.kind,
            "engine": engine.name,
            # Where the time went: writing parts (summed), and how long the loop was held up by the
            # writer (all of write_s when writing inline) and by the engine.
            "write_overlap": depth > 0, "write_workers": min(e.write_workers, depth) if depth else 0,
            "write_s": round(writer.write_s, 3),
            "write_wait_s": round(write_wait, 3), "engine_wait_s": round(engine_wait, 3),
            "collect_s": round(collect, 3),
        }
        art = w.commit(stats)
    return art.ref()


__all__ = [
    "EngineError", "ExtractError", "ShardPlan", "SCHEDULING_KEYS", "plan_extract", "extract_shard", "load_part",
    "gpu_groups", "engine_groups", "EngineGroup", "engine_for_group", "visible_gpus", "resolve_layer_ids", "quantize_fp8", "dequantize_fp8",
    "write_safetensors_stream",
]
