"""GPU validation and benchmarks: matmul roofline, extraction, training, on one GPU.

On the lent H200 (one device call, ~6-8 minutes):

    python3 benchmarks/bench_gpu.py --out $OUT

Smaller, quicker shapes for a smoke run: `--quick`. Sections: `--only matmul,extract,train`.

Measured, all in one process (the extraction engine is a child process, as in the pipeline):
1. bf16 matmul rate, 8192^3, mean of 10 after 3 warm-ups: the roofline for every MFU below.
2. Extraction, transformers backend, on random-init targets (Llama-3.1-8B-shaped and
   SmolLM2-135M-shaped, saved once in bf16): the bare prefill (the decoder with the same
   forward hooks, 8 x 2048 random tokens per call, nothing copied out) vs the stage path
   (tasks.extract.stage.extract_shard through EngineProcess(kind="transformers") into a file://
   store on local disk): tokens/s, MFU = 2 x params x tok/s / matmul rate, ratio stage/bare,
   peak GPU memory.
3. Training on the 8B-shaped target's extracted hidden states (32K draft vocabulary, 3 TTT
   steps, 8192 packed tokens per step): our loop streamed from the store vs in memory, and
   vs speculators' Trainer on identical data and config (benchmarks/bench_train.py's helpers),
   per attention implementation (`--speculators-attns`, default sdpa and flex_attention), with
   the anchor: speculators' bare Eagle3DraftModel step (forward, backward, AdamW) on one packed
   batch of ours already on the GPU (`--bare-steps`), the ceiling the two loops are compared to.

Results go to OUT/bench_gpu.json (rewritten after every section) and OUT/bench_gpu.md.
Every section runs under try/except: a failure is recorded and the next section runs; the script then exits 1.

4. `--only shard` (benchmarks/gpu_shard.py): extraction through vLLM on a production-sized shard (hundreds of
   parts) with its store on a disk folder (`--store-dir`), beside the bare prefill and dd of the same bytes.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import shutil
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "support"), str(REPO / "benchmarks")]

import torch  # noqa: E402

RESULTS: dict = {}
OUT: Path = Path(".")
DEADLINE = float("inf")  # time.monotonic() by which optional sections must have started


def time_left() -> float:
    return DEADLINE - time.monotonic()

LLAMA8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
               max_position_embeddings=8192)
SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
               max_position_embeddings=8192)
TINY = dict(hidden_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,  # CPU smoke runs
            intermediate_size=256, vocab_size=1024, tie_word_embeddings=False, rope_theta=10000.0,
            max_position_embeddings=2048)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save() -> None:
    (OUT / "bench_gpu.json").write_text(json.dumps(RESULTS, indent=2, default=str))


def section(name: str):
    """Run a section, record its failure instead of stopping."""
    def deco(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            log(f"== {name}")
            try:
                return fn(*a, **k)
            except Exception as exc:  # noqa: BLE001 - a benchmark records and goes on
                RESULTS.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
                log(f"!! {name} failed: {type(exc).__name__}: {exc}")
                traceback.print_exc()
            finally:
                RESULTS.setdefault("section_s", {})[name] = round(time.perf_counter() - t0, 1)
                save()
        return run
    return deco


def gib(n: float) -> float:
    return round(n / 2**30, 2)


# ============================================================================ 1. matmul


@section("matmul")
def bench_matmul(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    rate = 2 * n**3 / statistics.mean(times)
    RESULTS["matmul"] = {"n": n, "tflops": round(rate / 1e12, 1), "min_ms": round(min(times) * 1e3, 3)}
    log(f"matmul {n}^3 bf16: {rate / 1e12:.0f} TFLOP/s")
    del a, b
    torch.cuda.empty_cache()
    return rate


def roofline() -> float:
    return RESULTS.get("matmul", {}).get("tflops", 790.0) * 1e12


# ============================================================================ 2. extraction


def build_target(folder: Path, shape: dict, layers: int | None = None):
    """A random-init Llama of the given shape on the GPU (bf16), saved once as a HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(shape)
    if layers:
        kw["num_hidden_layers"] = layers
    cfg = LlamaConfig(**kw, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # cpu: the shard section's smoke run
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.eval()
    t0 = time.perf_counter()
    model.save_pretrained(str(folder))
    return model, time.perf_counter() - t0


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def write_data(store, name: str, prompts: list[list[int]]):
    """A prepare-like artifact (docs/ARTIFACTS.md) with one Parquet shard of the prompts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.core.digest import VERSIONS, stage_digest

    masks = [[0] * (len(p) // 10) + [1] * (len(p) - len(p) // 10) for p in prompts]
    table = pa.table({
        "sample_id": pa.array([f"{name}-{i}" for i in range(len(prompts))], pa.string()),
        "source": pa.array(["bench"] * len(prompts), pa.string()),
        "messages": pa.array(["[]"] * len(prompts), pa.string()),
        "input_ids": pa.array(prompts, pa.list_(pa.int32())),
        "loss_mask": pa.array(masks, pa.list_(pa.int8())),
    })
    buf = io.BytesIO()
    pq.write_table(table, buf)
    digest = stage_digest("prepare", {"bench_gpu": name, "n": len(prompts)}, {})
    with store.write("prepare", digest, VERSIONS["prepare"]) as w:
        w.write_bytes("shard-00000.parquet", buf.getvalue())
        art = w.commit({"num_shards": 1, "samples": len(prompts), "tokens": sum(map(len, prompts))})
    return art.ref(), list(zip(prompts, masks))


class GpuMemPoll:
    """Device-wide used memory (all processes), polled: the engine child's footprint."""

    def __init__(self, every_s: float = 0.05):
        self.every_s, self.peak, self._stop = every_s, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            time.sleep(self.every_s)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def bare_prefill(model, prompts: list[list[int]], layer_ids: list[int], reps: int) -> dict:
    """The decoder with the extraction hooks (same capture as the engine), nothing copied out."""
    layers = model.model.layers
    captured: dict[int, torch.Tensor] = {}

    def hook(slot: int):
        def fn(_m, _i, out):
            captured[slot] = out[0] if isinstance(out, (tuple, list)) else out
        return fn

    handles = [layers[k - 1].register_forward_hook(hook(s)) for s, k in enumerate(layer_ids)]
    cuda = next(model.parameters()).is_cuda  # else the shard section's CPU smoke run
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ids = torch.tensor(prompts, device=next(model.parameters()).device)
    mask = torch.ones_like(ids)
    try:
        with torch.inference_mode():
            for _ in range(2):
                model.model(input_ids=ids, attention_mask=mask, use_cache=False)
                captured.clear()
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                model.model(input_ids=ids, attention_mask=mask, use_cache=False)
                sync()
                times.append(time.perf_counter() - t0)
                captured.clear()
    finally:
        for h in handles:
            h.remove()
    tokens = ids.numel()
    med = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    return {"tokens_per_call": tokens, "median_s": round(med, 4), "tokens_per_s": round(tokens / med),
            "peak_gpu_gib": gib(peak), "activation_peak_gib": gib(peak - base)}


def write_ceiling(store, part_bytes: int, parts: int, workers: int) -> dict:
    """The store's write rate alone: `parts` parts of `part_bytes` through ArtifactWriter.open (hashing
    included) on `workers` threads, from one buffer already in memory. The stage cannot write faster."""
    from concurrent.futures import ThreadPoolExecutor

    from tasks.formats.parts import _tensor_bytes

    data = torch.randint(-100, 100, (part_bytes,), dtype=torch.int8)
    view = _tensor_bytes(data)
    with store.write("ceiling", f"w{workers}-{time.monotonic_ns()}", "1") as w:
        t0 = time.perf_counter()

        def one(i: int) -> None:
            with w.open(f"part-{i:05d}.bin") as fh:
                fh.write(view)

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, range(parts)))
        secs = time.perf_counter() - t0
        w.commit({})
    return {"workers": workers, "parts": parts, "bytes": part_bytes * parts, "seconds": round(secs, 3),
            "gb_per_s": round(part_bytes * parts / secs / 1e9, 2)}


def extraction(name: str, shape: dict, tmp: Path, n_prompts: int, seq: int, stage_prompts: int,
               layers: int | None, part_tokens: int, write_workers: list[int] | None = None,
               other_backends: tuple[str, ...] = ()):
    from tasks.core.config import EnginesConfig, ExtractConfig, ExtractEngineConfig, RunConfig, TargetConfig
    from tasks.engine.settings import engine_for_group
    from tasks.extract.stage import extract_shard, plan_extract
    from tasks.store.artifacts import Store
    from tasks.engine.target import load_hf_config

    res: dict = {"shape": {**shape, **({"num_hidden_layers": layers} if layers else {})}}
    RESULTS.setdefault("extract", {})[name] = res
    shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    base = Path("/dev/shm/bench-gpu") if shm_free > 48 << 30 else tmp
    folder = base / f"target-{name}"
    t0 = time.perf_counter()
    model, save_s = build_target(folder, shape, layers)
    params = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel()
    head = 0 if shape["tie_word_embeddings"] else model.lm_head.weight.numel()
    layer_params = params - embed - head
    res.update(params=params, decoder_layer_params=layer_params, nonembed_params=params - embed,
               build_s=round(time.perf_counter() - t0, 1), save_s=round(save_s, 1), model_dir=str(folder))
    log(f"{name}: {params / 1e9:.2f}B params, built+saved in {res['build_s']}s to {folder}")

    hf_config = load_hf_config(TargetConfig(model=str(folder)), str(folder))
    workers_list = write_workers or [ExtractConfig().write_workers]

    def stage_cfg(workers: int, backend: str = "transformers") -> RunConfig:
        # vllm@N: vLLM with max_num_batched_tokens=N (tokens per engine step). The target has no tokenizer and
        # the prompts are random ids: vLLM is told not to load one.
        backend, _, step_tokens = backend.partition("@")
        args: dict = {"skip_tokenizer_init": True}
        if step_tokens:
            args["max_num_batched_tokens"] = int(step_tokens)
        engines = EnginesConfig(extract=ExtractEngineConfig(engine_args=args))
        return RunConfig(target=TargetConfig(model=str(folder), max_model_len=seq + 64),
                         extract=ExtractConfig(backend=backend, batch_tokens=n_prompts * seq,
                                               part_tokens=part_tokens, write_workers=workers),
                         **({"engines": engines} if backend == "vllm" else {}))

    cfg = stage_cfg(workers_list[0])
    prompts = random_prompts(stage_prompts, seq, shape["vocab_size"], seed=1)
    stores = {w: Store(f"file://{tmp}/store-{name}-w{w}") for w in workers_list}  # one per run: none cached
    data = {w: write_data(st, name, prompts) for w, st in stores.items()}
    store, (data_ref, samples) = stores[workers_list[0]], data[workers_list[0]]
    plan = plan_extract(cfg, data_ref, hf_config)[0]
    layer_ids = plan.layer_ids
    res["layer_ids"] = layer_ids

    # bare prefill with hooks, in this process
    bare = bare_prefill(model, prompts[:n_prompts], layer_ids, reps=5)
    rate = roofline()
    bare["mfu_layers"] = round(2 * layer_params * bare["tokens_per_s"] / rate, 3)
    bare["mfu_nonembed"] = round(2 * (params - embed) * bare["tokens_per_s"] / rate, 3)
    res["bare_prefill"] = bare
    log(f"{name} bare prefill+hooks: {bare['tokens_per_s']} tok/s, MFU {bare['mfu_layers']:.0%} (layers), "
        f"peak {bare['peak_gpu_gib']} GiB")
    save()
    del model
    gc.collect()
    torch.cuda.empty_cache()

    # the stage path: EngineProcess(kind="transformers") + extract_shard into file://
    free0, total = torch.cuda.mem_get_info()
    engine = engine_for_group(cfg, str(folder), [0])
    t0 = time.perf_counter()
    with GpuMemPoll() as poll:
        engine.start(timeout_s=400)
        res["engine_start_s"] = round(time.perf_counter() - t0, 1)
        try:
            # warm-up: kernels, and the two page-locked ring buffers extract_shard uses (allocated
            # once per engine, which the pipeline keeps across shards)
            warm = []
            for _ in range(2):
                engine.extract(prompts[:n_prompts], layer_ids, ring=True)
                warm.append(dict(engine.last_timings))
            # the engine call alone, no store (forward + D2H into the ring, mapped in this process)
            calls = []
            for _ in range(3):
                t1 = time.perf_counter()
                engine.extract(prompts[:n_prompts], layer_ids, ring=True)
                calls.append((time.perf_counter() - t1, dict(engine.last_timings)))
            call_s = statistics.median(c[0] for c in calls)
            res["engine_call"] = {"tokens_per_s": round(n_prompts * seq / call_s), "median_s": round(call_s, 4),
                                  "timings_last": calls[-1][1], "warmup_timings": warm}
            timings = timed_calls(engine)
            runs = {}
            for w in workers_list:  # the same shard, each into its own store, with w part writers
                timings.clear()
                c = stage_cfg(w)
                p = plan_extract(c, data[w][0], hf_config)[0]
                t1 = time.perf_counter()
                r = extract_shard(c, stores[w], p, engine)
                runs[w] = (r, time.perf_counter() - t1, list(timings))
        finally:
            engine.close()
    stages = {}
    for w, (r, stage_s, tms) in runs.items():
        stages[w] = stage_stats(stores[w].open("extract", r.digest), stage_prompts * seq, stage_s, tms, poll,
                                total - free0, layer_params, rate, bare)
        log(f"{name} stage, {w} writer(s): {stages[w]['tokens_per_s']} tok/s = {stages[w]['over_bare']} x bare; "
            + ", ".join(f"{k}={stages[w].get(k)}" for k in ("write_s", "write_wait_s", "engine_wait_s", "collect_s")))
    ref = runs[workers_list[0]][0]
    stage = stages[workers_list[0]]
    res["engine_call"]["over_bare"] = round(res["engine_call"]["tokens_per_s"] / bare["tokens_per_s"], 3)
    res["stage"] = stage
    if len(stages) > 1:
        res["stage_by_write_workers"] = {str(w): v for w, v in stages.items()}
    # what the store takes alone, with as many writers: the ceiling the stage can reach
    part_bytes = int(stage["bytes"] / max(1, stage["parts"]))
    res["store_write_ceiling"] = {}
    for w in workers_list:
        res["store_write_ceiling"][str(w)] = write_ceiling(Store(f"file://{tmp}/ceiling-{name}"), part_bytes,
                                                           max(4, stage["parts"]), w)
        shutil.rmtree(tmp / f"ceiling-{name}", ignore_errors=True)
    for w, c in res["store_write_ceiling"].items():
        c["tokens_per_s"] = round(c["gb_per_s"] * 1e9 / stage["bytes_per_token"]) if stage["bytes_per_token"] else None
        c["over_bare"] = round(c["tokens_per_s"] / bare["tokens_per_s"], 3) if c["tokens_per_s"] else None
        log(f"{name} store write alone, {w} writer(s): {c['gb_per_s']} GB/s = {c['tokens_per_s']} tok/s "
            f"({c['over_bare']} x bare)")
    save()
    for backend in other_backends:  # the same shard through another backend's engine, into its own store
        section(f"extract-{name}-{backend}")(other_backend)(res, backend, stage_cfg(workers_list[0], backend), folder,
                                                           tmp, name, prompts, n_prompts, hf_config, layer_params,
                                                           rate, bare)
    return store, folder, ref, samples, layer_ids, shape["vocab_size"]


def other_backend(res: dict, backend: str, cfg, folder: Path, tmp: Path, name: str, prompts: list[list[int]],
                  n_prompts: int, hf_config, layer_params: int, rate: float, bare: dict) -> None:
    """extract_shard through `backend`'s engine (vllm: its hidden-states connector, asynchronous on CUDA) on the
    shard the transformers stage ran, beside the same bare prefill: engine start, one warm-up call, the stage."""
    from tasks.engine.settings import engine_for_group
    from tasks.extract.stage import extract_shard, plan_extract
    from tasks.store.artifacts import Store

    store = Store(f"file://{tmp}/store-{name}-{backend}")
    data_ref, _ = write_data(store, name, prompts)
    plan = plan_extract(cfg, data_ref, hf_config)[0]
    free0, total = torch.cuda.mem_get_info()
    engine = engine_for_group(cfg, str(folder), [0])
    out: dict = {}
    res.setdefault("backends", {})[backend] = out
    t0 = time.perf_counter()
    with GpuMemPoll() as poll:
        engine.start(timeout_s=500)
        out["engine_start_s"] = round(time.perf_counter() - t0, 1)
        log(f"{name} {backend} engine started in {out['engine_start_s']} s")
        try:
            t1 = time.perf_counter()
            engine.extract(prompts[:n_prompts], plan.layer_ids)  # warm-up: the first call's kernels and buffers
            out["warmup_call_s"] = round(time.perf_counter() - t1, 2)
            timings = timed_calls(engine)
            t1 = time.perf_counter()
            ref = extract_shard(cfg, store, plan, engine)
            stage_s = time.perf_counter() - t1
        finally:
            engine.close()
    out["stage"] = stage_stats(store.open("extract", ref.digest), len(prompts) * len(prompts[0]), stage_s, timings,
                               poll, total - free0, layer_params, rate, bare)
    log(f"{name} {backend} stage: {out['stage']['tokens_per_s']} tok/s = {out['stage']['over_bare']} x bare prefill")
    save()


def timed_calls(engine) -> list[dict]:
    """From now on, each `engine.extract` call appends the engine's own timings to the list returned."""
    timings: list[dict] = []
    orig = engine.extract

    def timed(p, ids, **kw):
        got = orig(p, ids, **kw)
        timings.append(dict(engine.last_timings))
        return got

    engine.extract = timed  # type: ignore[method-assign]
    return timings


def stage_stats(art, tokens: int, stage_s: float, timings: list[dict], poll, used0: int, layer_params: int,
                rate: float, bare: dict) -> dict:
    summed = {k: round(sum(t.get(k, 0.0) for t in timings), 3) for k in ("forward_s", "save_s", "engine_s",
                                                                           "call_s", "load_s")}
    stage = {"tokens": tokens, "wall_s": round(stage_s, 2), "tokens_per_s": round(tokens / stage_s),
             "stats_tokens_per_s": art.stats.get("tokens_per_s"), "bytes": art.stats.get("bytes"),
             "bytes_per_token": art.stats.get("bytes_per_token"), "parts": len(art.stats.get("parts", [])),
             "engine_calls": len(timings), "summed_timings": summed,
             # the stage's own accounting: time writing parts (summed over workers), and how long its
             # loop waited for the writers / for the engine
             **{k: art.stats.get(k) for k in ("write_s", "write_wait_s", "engine_wait_s", "collect_s", "write_workers")},
             "engine_gpu_gib_device_wide": gib(poll.peak - used0)}
    stage["mfu_layers"] = round(2 * layer_params * stage["tokens_per_s"] / rate, 3)
    stage["over_bare"] = round(stage["tokens_per_s"] / bare["tokens_per_s"], 3)
    return stage


# ============================================================================ 3. training


class _Done:
    """What is left of a finished run of ours: its eval batches, parts, FLOPs per token."""

    def __init__(self, eval_batches, parts, flops_per_token):
        self.eval, self.parts, self.flops_per_token = eval_batches, parts, flops_per_token


def train_bench(store, target: str, extract_ref, samples, layer_ids: list[int], vocab: int, steps: int,
                draft_vocab: int, batch_tokens: int, rounds: int, speculators: bool, flex: bool,
                attns: list[str] | None = None, spec_attns: list[str] | None = None, bare_steps: int = 12) -> None:
    """Ours (streamed / in memory, per attention), then the anchors per attention in `spec_attns`:
    speculators' bare Eagle3DraftModel step on one packed batch of ours, and speculators' Trainer."""
    import bench_train
    from tasks.core.config import RunConfig
    from tasks.formats.parts import load_part
    from tasks.train.inputs import resolve_inputs
    from tasks.train.stream import PartReader
    from train_data import write_vocab

    res: dict = {"draft_vocab": draft_vocab, "batch_tokens": batch_tokens, "steps": steps, "ttt_steps": 3}
    RESULTS["train"] = res
    vref = write_vocab(store, samples, vocab, draft_vocab, tag=f"bench-gpu-{draft_vocab}")

    def make_cfg(attn: str) -> RunConfig:
        return RunConfig.model_validate({
            "target": {"model": target, "max_model_len": 4096}, "extract": {"layer_ids": layer_ids},
            "train": {"max_steps": steps, "batch_tokens": batch_tokens, "warmup_steps": 2, "lr": 1e-3,
                      "min_lr_ratio": 0.0, "weight_decay": 0.0, "checkpoint_every": 10**6, "eval_batches": 2,
                      "prefetch": 2, "device": "cuda", "attn_impl": attn, "ttt_steps": 3}})

    cfg = make_cfg("sdpa")
    inputs = resolve_inputs(cfg, store, vref, [extract_ref])
    reader = PartReader(inputs.artifacts, inputs.layer_ids, inputs.hidden_size)
    preloaded = {(p.digest, p.name): reader(p) for p in inputs.parts}
    res["parts"] = len(inputs.parts)
    res["tokens"] = sum(p.hidden.shape[0] for p in preloaded.values())
    rate = roofline()
    import tasks.train.loop as tt

    FPT: dict = {}
    orig_fpt = getattr(tt.flops_per_token, "__wrapped__", tt.flops_per_token)

    def fpt(model, ttt_steps):  # what the Trainer computes, captured (run_ours returns no Trainer)
        FPT["value"] = orig_fpt(model, ttt_steps)
        FPT["params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return FPT["value"]

    fpt.__wrapped__ = orig_fpt
    tt.flops_per_token = fpt

    def one(mode: str, c: RunConfig) -> dict:
        torch.cuda.reset_peak_memory_stats()
        r = bench_train.run_ours(c, store, inputs, None if mode == "streamed" else preloaded)
        trainer = _Done(r.pop("_eval"), r.pop("_parts"), FPT["value"])
        r["flops_per_token"] = trainer.flops_per_token
        r["mfu"] = round(r["tokens_per_s"] * trainer.flops_per_token / rate, 3)
        r["peak_gpu_gib"] = gib(torch.cuda.max_memory_allocated())
        r["draft_trainable_params"] = FPT["params"]
        log(f"ours {mode} ({c.train.attn_impl}): {r['tokens_per_s']:.0f} tok/s, MFU {r['mfu']:.1%}, data wait "
            f"{r['data_wait_frac']:.1%}, peak {r['peak_gpu_gib']} GiB, acc {r.get('val_acc_per_pos')}")
        return r, trainer

    def held_out_ids(trainer: _Done) -> set[str]:
        held = trainer.parts[-1]
        last = preloaded[(held.digest, held.name)]
        with inputs.artifacts[held.digest].local_copy(held.name) as path:
            sample_ids = load_part(path)["sample_ids"]
        return set(sample_ids[last.num_samples - held.holdout:])

    def ours_tokens_per_s(attn: str) -> float | None:
        for key in (f"ours_streamed_{attn}", "ours_streamed_flex" if attn == "flex_attention" else ""):
            if "tokens_per_s" in res.get(key, {}):
                return res[key]["tokens_per_s"]
        if attn == "sdpa" and res.get("ours_streamed"):
            return statistics.median(x["tokens_per_s"] for x in res["ours_streamed"])
        return None

    def anchors(trainer: _Done | None) -> None:
        """Per attention: speculators' bare model step on one packed batch of ours (the ceiling), then
        speculators' Trainer on the same data and config; each from a clean GPU (dynamo reset)."""
        for attn in spec_attns or []:
            if not bare_steps:
                break
            if time_left() < 60:
                res.setdefault("bare_model", {})[attn] = {"error": f"skipped: {time_left():.0f}s left of --budget-s"}
                continue
            torch.cuda.reset_peak_memory_stats()
            try:
                b = bench_train.run_bare_step(make_cfg(attn), inputs, preloaded, attn, bare_steps, "cuda")
                b["mfu"] = round(b["tokens_per_s"] * b["flops_per_token"] / rate, 3)
                b["peak_gpu_gib"] = gib(torch.cuda.max_memory_allocated())
                log(f"speculators' bare Eagle3DraftModel step ({attn}): {b['tokens_per_s']:.0f} tok/s, MFU "
                    f"{b['mfu']:.1%}, first step {b['first_step_s']} s, peak {b['peak_gpu_gib']} GiB")
            except Exception as exc:  # noqa: BLE001 - the next anchor still runs
                b = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
                traceback.print_exc()
            res.setdefault("bare_model", {})[attn] = b
            save()
        held_ids = held_out_ids(trainer) if trainer is not None else set()
        for attn in spec_attns or []:
            if not speculators or trainer is None:
                break
            if time_left() < 150:
                res.setdefault("speculators_by_attn", {})[attn] = {
                    "error": f"skipped: {time_left():.0f}s left of --budget-s"}
                continue
            bench_train.free_memory()  # gc, empty cache, dynamo reset: their compiled forward starts afresh
            torch.cuda.reset_peak_memory_stats()
            try:
                theirs = bench_train.run_speculators(make_cfg(attn), store, inputs, held_ids, trainer.eval, 4, "cuda",
                                                     attn=attn)
                theirs["peak_gpu_gib"] = gib(torch.cuda.max_memory_allocated())
                theirs["mfu_by_our_flops"] = round(theirs["tokens_per_s"] * trainer.flops_per_token / rate, 3)
                log(f"speculators Trainer ({attn}): {theirs['tokens_per_s']:.0f} tok/s")
            except Exception as exc:  # noqa: BLE001 - the next one still runs
                theirs = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
                traceback.print_exc()
            res.setdefault("speculators_by_attn", {})[attn] = theirs
            if attn == "sdpa":
                res["speculators"] = theirs
            save()
        for attn in spec_attns or []:  # ratios, where both sides ran
            ours = ours_tokens_per_s(attn)
            bare = res.get("bare_model", {}).get(attn, {}).get("tokens_per_s")
            theirs = res.get("speculators_by_attn", {}).get(attn, {}).get("tokens_per_s")
            for key, num, den in (("ours_over_bare", ours, bare), ("ours_over_speculators", ours, theirs),
                                  ("speculators_over_bare", theirs, bare)):
                if num and den:
                    res.setdefault(f"{key}_by_attn", {})[attn] = round(num / den, 3)
        if "sdpa" in res.get("ours_over_speculators_by_attn", {}):
            res["ours_over_speculators"] = res["ours_over_speculators_by_attn"]["sdpa"]
        save()

    if attns:  # one streamed run per attention implementation, each from a clean GPU, in this order
        last = None
        for attn in attns:
            gc.collect()
            torch.cuda.empty_cache()
            try:
                r, last = one("streamed", make_cfg(attn))
                res[f"ours_streamed_{attn}"] = r
            except Exception as exc:  # noqa: BLE001
                res[f"ours_streamed_{attn}"] = {"error": f"{type(exc).__name__}: {exc}"}
                traceback.print_exc()
            save()
        a, b = res.get("ours_streamed_flex_attention", {}), res.get("ours_streamed_sdpa", {})
        if "tokens_per_s" in a and "tokens_per_s" in b:
            res["flex_over_sdpa"] = round(a["tokens_per_s"] / b["tokens_per_s"], 3)
        anchors(last)
        return

    streamed, in_mem = [], []
    trainer = None
    for _ in range(rounds):
        r, trainer = one("streamed", cfg)
        streamed.append(r)
        save()
        r, _t = one("in-memory", cfg)
        in_mem.append(r)
        res["ours_streamed"], res["ours_in_memory"] = streamed, in_mem
        save()
    med = lambda rs: statistics.median(x["tokens_per_s"] for x in rs)  # noqa: E731
    res["streamed_over_in_memory"] = round(med(streamed) / med(in_mem), 3)
    log(f"streamed / in-memory: {res['streamed_over_in_memory']}")
    save()

    if flex and time_left() < 60:
        res["ours_streamed_flex"] = {"error": f"skipped: {time_left():.0f}s left of --budget-s"}
    elif flex:
        try:
            r, _t = one("streamed", make_cfg("flex_attention"))
            res["ours_streamed_flex"] = r
            res["flex_over_sdpa"] = round(r["tokens_per_s"] / med(streamed), 3)
        except Exception as exc:  # noqa: BLE001
            res["ours_streamed_flex"] = {"error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        save()
    anchors(trainer)


# ============================================================================ report


def markdown() -> str:
    r = RESULTS
    env = r.get("env", {})
    lines = [f"Device: {env.get('gpu')}, torch {env.get('torch')}, transformers {env.get('transformers')}, "
             f"CUDA {env.get('cuda')}; {env.get('date')}; command: `{env.get('command')}`", ""]
    if "matmul" in r:
        lines.append(f"bf16 matmul 8192^3 (mean of 10): **{r['matmul']['tflops']} TFLOP/s** (the MFU roofline)")
        lines.append("")
    if r.get("extract"):
        lines += ["Extraction (transformers backend, random-init targets, 8 x 2048-token prompts per call):", "",
                  "| target | params | bare prefill+hooks tok/s | MFU (layers) | engine call tok/s (x bare) "
                  "| stage extract_shard tok/s (x bare) | bytes/token | peak GPU GiB (bare / engine) |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, e in r["extract"].items():
            b, s, c = e.get("bare_prefill", {}), e.get("stage", {}), e.get("engine_call", {})
            lines.append(f"| {name} | {e.get('params', 0) / 1e9:.3f}B | {b.get('tokens_per_s')} | "
                         f"{b.get('mfu_layers')} | {c.get('tokens_per_s')} ({c.get('over_bare')}) | "
                         f"{s.get('tokens_per_s')} (**{s.get('over_bare')}**) | {s.get('bytes_per_token')} | "
                         f"{b.get('peak_gpu_gib')} / {s.get('engine_gpu_gib_device_wide')} |")
        lines.append("")
        for name, e in r["extract"].items():
            for w, x in e.get("stage_by_write_workers", {}).items():
                lines.append(f"- {name}, {w} part writers: stage {x['tokens_per_s']} tok/s = **{x['over_bare']} x bare** "
                             f"(collect {x.get('collect_s')} s, waiting for writers {x.get('write_wait_s')} s)")
            for be, x in e.get("backends", {}).items():
                st = x.get("stage", {})
                lines.append(f"- {name}, {be} backend (engine start {x.get('engine_start_s')} s): stage "
                             f"{st.get('tokens_per_s')} tok/s = **{st.get('over_bare')} x bare** "
                             f"(transformers stage {e.get('stage', {}).get('over_bare')} x bare)")
            for w, c in e.get("store_write_ceiling", {}).items():
                lines.append(f"- {name}, the store alone with {w} writers: {c['gb_per_s']} GB/s = {c['tokens_per_s']} "
                             f"tok/s = {c['over_bare']} x bare (the most the stage can reach)")
        lines.append("")
    t = r.get("train")
    if t:
        lines += [f"Training ({t.get('tokens')} extracted tokens of the 8B-shaped target, draft vocab "
                  f"{t['draft_vocab']}, {t['ttt_steps']} TTT steps, {t['batch_tokens']} tokens/step, "
                  f"{t['steps']} steps, median tok/s over steps 3+):", "",
                  "| run | tok/s | MFU | data wait | peak GPU GiB | held-out acc/pos |", "|---|---|---|---|---|---|"]
        rows = [(f"ours streamed #{i}", x) for i, x in enumerate(t.get("ours_streamed", []))]
        rows += [(f"ours in-memory #{i}", x) for i, x in enumerate(t.get("ours_in_memory", []))]
        if "tokens_per_s" in t.get("ours_streamed_flex", {}):
            rows.append(("ours streamed, flex_attention", t["ours_streamed_flex"]))
        for attn in ("flex_attention", "sdpa"):
            if "tokens_per_s" in t.get(f"ours_streamed_{attn}", {}):
                rows.append((f"ours streamed, {attn} (fresh GPU)", t[f"ours_streamed_{attn}"]))
        by_attn = t.get("speculators_by_attn") or ({"sdpa": t["speculators"]} if "speculators" in t else {})
        for attn, x in by_attn.items():
            if "tokens_per_s" in x:
                rows.append((f"speculators Trainer ({attn}, eager loss)", {**x, "mfu": x.get("mfu_by_our_flops")}))
        for attn, x in t.get("bare_model", {}).items():
            if "tokens_per_s" in x:
                rows.append((f"speculators' bare Eagle3DraftModel step ({attn}, one packed batch of ours, "
                             f"{x.get('documents')} documents)", {**x, "data_wait_frac": "-"}))
        for label, x in rows:
            lines.append(f"| {label} | {x.get('tokens_per_s', 0):.0f} | {x.get('mfu')} | "
                         f"{x.get('data_wait_frac', '-') if isinstance(x.get('data_wait_frac'), str) else round(x.get('data_wait_frac', 0) or 0, 3)} | "
                         f"{x.get('peak_gpu_gib')} | {x.get('val_acc_per_pos')} |")
        lines.append("")
        for k in ("streamed_over_in_memory", "ours_over_speculators", "flex_over_sdpa"):
            if k in t:
                lines.append(f"- {k}: **{t[k]}**")
        for k in ("ours_over_bare_by_attn", "ours_over_speculators_by_attn", "speculators_over_bare_by_attn"):
            for attn, v in t.get(k, {}).items():
                lines.append(f"- {k.removesuffix('_by_attn')} ({attn}): **{v}**")
        lines.append("")
    if r.get("errors"):
        lines.append("Errors: " + "; ".join(f"{k}: {v.splitlines()[0]}" for k, v in r["errors"].items()))
    return "\n".join(lines)


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="small shapes: a smoke run of every section")
    ap.add_argument("--only", default="matmul,extract,train")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per engine call")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--stage-prompts-8b", type=int, default=48, help="prompts in the 8B stage-path shard")
    ap.add_argument("--stage-prompts-small", type=int, default=128)
    ap.add_argument("--small-write-workers", default="2",
                    help="part writers for the SmolLM2-shape stage, one run each (e.g. 2,4)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-speculators", action="store_true")
    ap.add_argument("--speculators-attns", default="sdpa,flex_attention",
                    help="attention implementations for the anchors: speculators' bare model step and their Trainer")
    ap.add_argument("--bare-steps", type=int, default=12,
                    help="steps of speculators' bare Eagle3DraftModel on one packed batch (0: skip the anchor)")
    ap.add_argument("--flex", action="store_true", help="also train ours with flex_attention")
    ap.add_argument("--train-attns", default=None,
                    help="instead of the default training runs: one streamed run per attn impl, in this order "
                         "(e.g. flex_attention,sdpa)")
    ap.add_argument("--budget-s", type=float, default=None, help="skip optional sections past this many seconds")
    ap.add_argument("--extract-backends", default="transformers",
                    help="backends of the 8B-shape stage path, the first with the write-ceiling detail "
                         "(e.g. transformers,vllm,vllm@16384: vLLM's hidden-states connector beside it on the same "
                         "shard; @N sets vLLM's max_num_batched_tokens)")
    ap.add_argument("--skip-small", action="store_true", help="no SmolLM2-shape extraction section")
    ap.add_argument("--store-dir", default=None,
                    help="shard section: the folder its store and dd write to, on a disk (default: the temp folder)")
    ap.add_argument("--shard-prompts", type=int, default=512, help="shard section: prompts of --seq tokens")
    ap.add_argument("--part-tokens", type=int, default=4096, help="shard section: extract.part_tokens")
    ap.add_argument("--shard-writers", type=int, default=2, help="shard section: extract.write_workers")
    ap.add_argument("--shard-shape", choices=["llama8b", "tiny"], default="llama8b",
                    help="shard section: the target's shape (tiny: a CPU smoke run)")
    ap.add_argument("--allow-tmpfs", action="store_true", help="shard section: accept a --store-dir in RAM")
    args = ap.parse_args()
    if args.extract_backends.split(",")[0] != "transformers":
        ap.error("--extract-backends starts with transformers (the detailed stage run); name others after it")
    global DEADLINE
    if args.budget_s:
        DEADLINE = time.monotonic() + args.budget_s
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(","))
    import transformers

    RESULTS["env"] = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)", "torch": torch.__version__, "cuda": torch.version.cuda,
                      "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      "command": " ".join(["python3", "benchmarks/bench_gpu.py", *sys.argv[1:]]),
                      "cpus": os.cpu_count()}
    tmp = Path("/tmp/bench-gpu")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t_all = time.perf_counter()
    if "shard" in only:
        import gpu_shard

        gpu_shard.bg = sys.modules[__name__]  # this module's RESULTS, however it was started
        shape = TINY if args.shard_shape == "tiny" else LLAMA8B
        section("shard")(gpu_shard.production_shard)(
            tmp, Path(args.store_dir or tmp) / "bench-gpu-shard", shape, None, args.prompts, args.seq,
            args.shard_prompts, args.part_tokens, args.shard_writers, args.allow_tmpfs)
    if "matmul" in only:
        bench_matmul(4096 if args.quick else 8192)
    big = None
    if "extract" in only or "train" in only:
        layers8 = 4 if args.quick else None
        big = section("extract-llama8b")(extraction)(
            "llama8b-shape", LLAMA8B, tmp, args.prompts, args.seq,
            args.prompts if args.quick else args.stage_prompts_8b, layers8, 4 * args.seq * 2,
            other_backends=tuple(b for b in args.extract_backends.split(",")[1:] if b))
    if "extract" in only and not args.skip_small:
        section("extract-smollm2")(extraction)(
            "smollm2-shape", SMOLLM2, tmp, args.prompts, args.seq,
            args.prompts * 2 if args.quick else args.stage_prompts_small, None, 32 * args.seq,
            [int(w) for w in args.small_write_workers.split(",")])
    if "train" in only and big is not None:
        store, folder, ref, samples, layer_ids, vocab = big
        section("train")(train_bench)(store, str(folder), ref, samples, layer_ids, vocab,
                                      8 if args.quick else args.steps, 32000, 8192,
                                      1 if args.quick else args.rounds, not args.skip_speculators, args.flex,
                                      args.train_attns.split(",") if args.train_attns else None,
                                      [a for a in args.speculators_attns.split(",") if a],
                                      4 if args.quick else args.bare_steps)
    RESULTS["total_s"] = round(time.perf_counter() - t_all, 1)
    save()
    md = markdown()
    if "shard" in only:
        md += "\n" + "\n".join(gpu_shard.markdown(RESULTS))
    (OUT / "bench_gpu.md").write_text(md + "\n")
    print("\n" + md, flush=True)
    shutil.rmtree("/dev/shm/bench-gpu", ignore_errors=True)
    if RESULTS.get("errors"):  # every section ran; the run failed all the same (benchmarks/gpu_vllm.sh stops here)
        print(f"!! sections failed: {', '.join(RESULTS['errors'])}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
