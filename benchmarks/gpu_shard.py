"""bench_gpu.py's `shard` section: extraction through vLLM on a production-sized shard, the store on a disk.

    python3 benchmarks/bench_gpu.py --out OUT --only shard --store-dir DIR [--shard-prompts 512] [--part-tokens 4096]

One process, in this order (issue 47, item 4):
1. where the bytes go: the store folder DIR (`df -PT`: device, filesystem type; tmpfs is refused unless
   --allow-tmpfs, the point is a disk), the engines' hidden-state folder and the system temp folder;
2. the bare prefill with the extraction hooks (bench_gpu.bare_prefill, in this process, the same 8 x 2048-token
   calls), the target then freed;
3. `extract_shard` through a vLLM engine (its asynchronous hidden-states connector on CUDA; draftline's
   synchronous one on a CPU) of `--shard-prompts` x `--seq` tokens into a file:// store in DIR, `--part-tokens`
   per part (hundreds of parts), `--shard-writers` part writers; one warm-up call first;
4. the medium's own rate on the same bytes: the store is removed (`sync` after, outside the timings), then
   `dd` writes as many copies of one of its parts into DIR with as many writers (benchmarks/media.py), then the
   store path alone (bench_gpu.write_ceiling: the same parts through ArtifactWriter, hashing included).
Reported: stage tok/s over the bare prefill (the aim: >= 0.95), the stage's write rate and the store path's over dd's.

Sizes: the 8B shape stores 4 x 4096 x 2 = 32,768 bytes a token in bf16; 512 x 2,048 tokens are 34.4 GB, 256
parts of 4,096 tokens (128 MiB each). The section checks DIR has room for them (and refuses with the count that
fits). On the lent H100 (64 GiB disk, 16 GB target in /dev/shm) that is ~40 s of extraction at ~27K tok/s after a
~150 s engine start: the whole section ~5 minutes. On a CPU (`--quick`: a 2-layer, hidden-128 target, 8 x 128
tokens, parts of 128 tokens) it is a smoke run of the same code.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import torch

from media import dd_rate, medium

bg = None  # benchmarks/bench_gpu.py as it runs (its RESULTS, log, build_target ...): set by bench_gpu.main


def _engine_group() -> list[int]:
    return [0] if torch.cuda.is_available() else []  # []: no GPU, vLLM's CPU build with the synchronous connector


class _NoPoll:
    peak = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _sync_disk() -> float:
    t0 = time.perf_counter()
    subprocess.run(["sync"], check=False)
    return round(time.perf_counter() - t0, 2)


def where(store_dir: Path, allow_tmpfs: bool) -> dict:
    from tasks.engine.process import engine_tmp_base

    out = {"store": medium(store_dir), "engine_tmp": medium(engine_tmp_base() or os.environ.get("TMPDIR", "/tmp")),
           "tmpdir": medium(os.environ.get("TMPDIR", "/tmp"))}
    for k, m in out.items():
        bg.log(f"{k}: {m['folder']} is {m['kind']} ({m['fstype']} on {m['device']}, mounted at {m['mount']}, "
               f"{m['avail_gb']} GB free)")
    if out["store"]["kind"] != "disk" and not allow_tmpfs:
        raise RuntimeError(f"--store-dir {store_dir} is on {out['store']['fstype']} ({out['store']['kind']}), not a "
                           "disk: pass a folder on a disk (see its df line above), or --allow-tmpfs")
    return out


def production_shard(tmp: Path, store_dir: Path, shape: dict, layers: int | None, n_prompts: int, seq: int,
                     shard_prompts: int, part_tokens: int, writers: int, allow_tmpfs: bool) -> None:
    res: dict = {"shape": {**shape, **({"num_hidden_layers": layers} if layers else {})}, "shard_prompts": shard_prompts,
                 "seq": seq, "part_tokens": part_tokens, "write_workers": writers}
    bg.RESULTS["shard"] = res
    res["where"] = where(store_dir, allow_tmpfs)
    try:
        _run(res, tmp, store_dir, shape, layers, n_prompts, seq, shard_prompts, part_tokens, writers)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)  # the shard's store, dd's copies: tens of GB on the disk


def _run(res: dict, tmp: Path, store_dir: Path, shape: dict, layers: int | None, n_prompts: int, seq: int,
         shard_prompts: int, part_tokens: int, writers: int) -> None:
    from tasks.core.config import EnginesConfig, ExtractConfig, ExtractEngineConfig, RunConfig, TargetConfig
    from tasks.engine.settings import engine_for_group
    from tasks.engine.target import load_hf_config
    from tasks.extract.stage import extract_shard, plan_extract
    from tasks.store.artifacts import Store

    shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    folder = (Path("/dev/shm/bench-gpu") if shm_free > 48 << 30 else tmp) / "target-shard"
    model, _ = bg.build_target(folder, shape, layers)
    bpt = 4 * shape["hidden_size"] * 2 + 5  # 4 stored layers in bf16, int32 id, uint8 mask
    need = shard_prompts * seq * bpt
    free = shutil.disk_usage(store_dir).free  # after the target was saved (it may sit on the same disk)
    if need * 1.1 > free:
        fits = int(free / 1.1 / (seq * bpt))
        raise RuntimeError(f"the shard's {need / 1e9:.1f} GB do not fit {store_dir} ({free / 1e9:.1f} GB free after "
                           f"the target was saved to {folder}): --shard-prompts {fits} fits (GV_SHARD_PROMPTS)")
    params = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel()
    head = 0 if shape["tie_word_embeddings"] else model.lm_head.weight.numel()
    layer_params = params - embed - head
    res.update(params=params, model_dir=str(folder), model_on=medium(folder.parent)["kind"])
    hf_config = load_hf_config(TargetConfig(model=str(folder)), str(folder))
    cfg = RunConfig(target=TargetConfig(model=str(folder), max_model_len=seq + 64),
                    extract=ExtractConfig(backend="vllm", batch_tokens=n_prompts * seq, part_tokens=part_tokens,
                                          write_workers=writers, write_queue=max(2, writers)),
                    engines=EnginesConfig(extract=ExtractEngineConfig(engine_args={"skip_tokenizer_init": True})))
    prompts = bg.random_prompts(shard_prompts, seq, shape["vocab_size"], seed=1)
    store = Store(f"file://{store_dir}/shard-store")
    data_ref, _ = bg.write_data(store, "shard", prompts)
    plan = plan_extract(cfg, data_ref, hf_config)[0]
    bare = bg.bare_prefill(model, prompts[:n_prompts], plan.layer_ids, reps=5)
    res["bare_prefill"] = bare
    bg.log(f"shard: bare prefill + hooks {bare['tokens_per_s']} tok/s ({n_prompts} x {seq} tokens a call)")
    del model
    bg.gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    engine = engine_for_group(cfg, str(folder), _engine_group())
    t0 = time.perf_counter()
    used0 = 0
    if torch.cuda.is_available():
        free0, total = torch.cuda.mem_get_info()
        used0 = total - free0
    with (bg.GpuMemPoll() if torch.cuda.is_available() else _NoPoll()) as poll:
        engine.start(timeout_s=600)
        res["engine_start_s"] = round(time.perf_counter() - t0, 1)
        bg.log(f"shard: vLLM engine started in {res['engine_start_s']} s")
        try:
            engine.extract(prompts[:n_prompts], plan.layer_ids)  # warm-up
            timings = bg.timed_calls(engine)
            t1 = time.perf_counter()
            ref = extract_shard(cfg, store, plan, engine)
            stage_s = time.perf_counter() - t1
        finally:
            engine.close()
    art = store.open("extract", ref.digest)
    stage = bg.stage_stats(art, shard_prompts * seq, stage_s, timings, poll, used0, layer_params, bg.roofline(), bare)
    stage["write_gb_per_s"] = round(stage["bytes"] / stage_s / 1e9, 3)  # what the stage wrote, over its wall time
    res["stage"] = stage
    bg.log(f"shard: vLLM stage {stage['tokens_per_s']} tok/s = {stage['over_bare']} x bare prefill, {stage['parts']} "
           f"parts, {stage['bytes'] / 1e9:.1f} GB in {stage['wall_s']} s into {res['where']['store']['fstype']} "
           f"(write_wait {stage.get('write_wait_s')} s, engine_wait {stage.get('engine_wait_s')} s)")
    bg.save()
    # the medium's own rate, on the same bytes: one part (held in RAM) copied as many times by dd
    parts = art.stats["parts"]
    src_dir = Path(tempfile_dir())
    src = src_dir / "part.safetensors"
    with art.local_copy(parts[len(parts) // 2]["name"]) as p:
        shutil.copyfile(p, src)
    part_bytes = os.path.getsize(src)
    shutil.rmtree(store_dir / "shard-store", ignore_errors=True)
    res["sync_s_after_stage"] = _sync_disk()
    try:
        res["dd"] = dd_rate(src, store_dir / "dd", len(parts), writers)
        res["sync_s_after_dd"] = _sync_disk()
        ceiling = bg.write_ceiling(Store(f"file://{store_dir}/ceiling"), part_bytes, len(parts), writers)
        shutil.rmtree(store_dir / "ceiling", ignore_errors=True)
        res["sync_s_after_store_alone"] = _sync_disk()
        res["store_alone"] = ceiling
    finally:
        shutil.rmtree(src_dir, ignore_errors=True)
    dd = res["dd"]["gb_per_s"]
    res["ratios"] = {"stage_over_bare": stage["over_bare"],
                     "stage_write_over_dd": round(stage["write_gb_per_s"] / dd, 3),
                     "store_alone_over_dd": round(ceiling["gb_per_s"] / dd, 3),
                     "dd_tokens_per_s": round(dd * 1e9 / stage["bytes_per_token"]),
                     "dd_over_bare_tokens": round(dd * 1e9 / stage["bytes_per_token"] / bare["tokens_per_s"], 3)}
    bg.log(f"shard: dd into {store_dir} {dd} GB/s (= {res['ratios']['dd_tokens_per_s']} tok/s); the store path alone "
           f"{ceiling['gb_per_s']} GB/s = {res['ratios']['store_alone_over_dd']} x dd; stage over bare "
           f"{stage['over_bare']}")
    bg.save()


def tempfile_dir() -> str:
    """A folder in RAM for dd's source part (so dd's reads cost no disk time), else the temp folder."""
    import tempfile

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return tempfile.mkdtemp(prefix="bench-gpu-dd-", dir=base)


def markdown(r: dict) -> list[str]:
    s = r.get("shard")
    if not s or "stage" not in s:
        return []
    st, w, q = s["stage"], s["where"]["store"], s.get("ratios", {})
    return [f"Production shard through vLLM ({s['shard_prompts']} x {s['seq']} tokens, {st['parts']} parts of "
            f"{s['part_tokens']} tokens, {s['write_workers']} part writers), store in {w['folder']} "
            f"({w['fstype']} on {w['device']}: {w['kind']}):", "",
            f"- bare prefill + hooks: {s['bare_prefill']['tokens_per_s']} tok/s; vLLM stage: {st['tokens_per_s']} "
            f"tok/s = **{st['over_bare']} x bare** (engine start {s.get('engine_start_s')} s)",
            f"- bytes: {st['bytes'] / 1e9:.2f} GB, the stage wrote {st['write_gb_per_s']} GB/s over its wall; dd of "
            f"the same bytes {s.get('dd', {}).get('gb_per_s')} GB/s; the store path alone "
            f"{s.get('store_alone', {}).get('gb_per_s')} GB/s = **{q.get('store_alone_over_dd')} x dd**", ""]
