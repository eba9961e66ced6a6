"""The training loader alone, N ranks at once: tokens/s per rank from a cold local disk and through the
node part cache from S3, bf16 and fp8 parts, beside the Kimi-shaped training step's rate.

    # on a GPU node (the default shape is Kimi-K2.5's draft: hidden 7168, 3 aux layers + the last, 16,384
    # tokens per batch; 8 ranks x 3 parts = 22.5 GB of bf16 parts, twice that at the peak with S3 + cache):
    python benchmarks/bench_loader.py --device cuda --ranks 8 --workdir /local/nvme --out loader.json
    # RESULTS.md's H200 entry: the cold disk and the step, then the ceilings with the step's rate given
    python benchmarks/bench_loader.py --device cuda --ranks 8 --sources disk,raw,warm --step-steps 0 --step-tok-s 30778
    # on a CPU, small, so it is known to work:
    .venv/bin/python benchmarks/bench_loader.py --ranks 2 --hidden 512 --batch-tokens 2048 --parts-per-rank 8 \\
        --vocab 8192 --draft-vocab 2048 --step-steps 6

Parts: `--ranks x --parts-per-rank` parts of `--part-tokens` tokens (by default one batch of positions each) (random hidden states in the extract
stage's format, tasks.formats.parts.PartBuffer), written once per dtype to a file:// store and to a SeaweedFS
server (tests/support/s3server.py) on this machine. Every rank is its own process (as under torchrun), reads its
share of the parts (the stream's deal, tasks/train/stream.py) with the training stream itself
(BatchStream over a PartReader: prefetch threads, packing into staging buffers, pinned on a GPU), and
turns each batch into the step's device inputs (`Batch.model_inputs`: the stored bytes copied to the
device, fp8 dequantized there; synchronized per batch on a GPU). Each rank runs `--passes` passes over its
share, each a fresh stream over exactly one epoch of batches:

- disk: the parts' files in the local store, their pages evicted from the page cache before each pass
  (os.posix_fadvise POSIX_FADV_DONTNEED after a sync), so every pass reads a cold disk;
- raw: the same files, evicted the same way, read plainly (8 MiB sequential reads, nothing else): the disk's
  ceiling, the baseline the disk row is divided by;
- warm: the loader with the files left in the page cache (the first pass reads what the earlier sources left;
  later passes read memory): the loader's own ceiling (CPU copies, pinned staging, PCIe);
- s3: through one node part cache (tasks/store/part_cache.py) shared by the ranks, empty before the first
  pass (which therefore streams every part from S3 and hashes it), its files evicted from the page
  cache before each later pass (a cold local cache).

Reported per (source, dtype): tokens/s per rank (each rank's tokens over its own time; median and
slowest rank), all ranks together, and the stored bytes read per second. With `--device cuda` (or
`--step-steps N` on a CPU) the training step of the same shape (speculators' Eagle3DraftModel on one
batch, forward + backward + AdamW, benchmarks/bench_train.py `run_bare_step`) is timed in the same run
after the loaders, and each loader figure is given as a ratio to it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "support"))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402


def evict(path: str) -> None:
    """Drop a file's pages from the page cache (they are clean: written and synced before)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def open_store(uri: str, env: dict[str, str]):
    from tasks.core.config import StoreConfig
    from tasks.store.artifacts import Store

    os.environ.update(env)
    return Store.from_config(StoreConfig(uri=uri))


def rank_main(a: dict, rank: int, barrier: Any, results: Any) -> None:
    """One rank's loader: `a["passes"]` passes over its share; puts its timings on `results`."""
    from tasks.store.part_cache import PartCache
    from tasks.train.stream import BatchStream, PartReader, PartSpec

    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // a["ranks"]))
        if a["device"] == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device = torch.device("cuda", rank % torch.cuda.device_count())
        else:
            device = torch.device("cpu")
        store = open_store(a["store"], a["env"])
        art = store.open("extract", a["digest"])
        parts = [PartSpec(index=i, shard=0, digest=a["digest"], name=n) for i, n in enumerate(a["names"])]
        cache = PartCache(a["cache"], cap_gib=1024) if a["cache"] else None
        reader = PartReader({a["digest"]: art}, a["layer_ids"], a["hidden"], cache=cache, dequantize=False)
        probe = BatchStream(parts, reader, batch_tokens=a["batch_tokens"], seed=0, rank=rank, world=a["ranks"])
        share = probe.share()
        n_batches = sum(a["positions"][p.name] for p in share) // a["batch_tokens"]
        passes = []
        barrier.wait()
        for p in range(a["passes"]):
            paths = [cache.path(art.manifest.file(spec.name).sha256) if cache else art.key(spec.name) for spec in share]
            if a["evict"]:  # a cold disk: this rank's files out of the page cache
                for path in paths:
                    if Path(path).exists():
                        evict(str(path))
            if a["raw"]:  # the baseline: the same files read whole, sequentially, in 8 MiB reads, nothing else
                buf, n = bytearray(8 << 20), 0
                t0 = time.perf_counter()
                for path in paths:
                    with open(path, "rb", buffering=0) as f:
                        while (k := f.readinto(buf)):
                            n += k
                passes.append({"tokens": n / a["bytes_per_token"], "seconds": time.perf_counter() - t0,
                               "first_batch_s": None, "fills": None})
                continue
            stream = BatchStream(parts, reader, batch_tokens=a["batch_tokens"], seed=0, rank=rank, world=a["ranks"],
                                 prefetch=a["prefetch"], pin_memory=device.type == "cuda")
            tokens, first = 0, None
            t0 = time.perf_counter()
            try:
                for _ in range(n_batches):
                    batch = stream.next()
                    x = batch.model_inputs(device)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    tokens += batch.tokens
                    del x, batch
                    if first is None:
                        first = time.perf_counter() - t0
            finally:
                stream.close()
            passes.append({"tokens": tokens, "seconds": time.perf_counter() - t0, "first_batch_s": first,
                           "fills": cache.stats.fills if cache else None})
        results.put({"rank": rank, "passes": passes, "share_parts": len(share),
                     "stored_bytes": sum(art.manifest.file(s.name).bytes for s in share)})
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        import traceback

        results.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})


def run_loaders(a: dict) -> dict:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(a["ranks"]), ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(a, r, barrier, results)) for r in range(a["ranks"])]
    for p in procs:
        p.start()
    got = [results.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
    bad = [g for g in got if "error" in g]
    if bad:
        raise RuntimeError(f"rank {bad[0]['rank']} failed: {bad[0]['error']}\n{bad[0]['trace']}")
    got.sort(key=lambda g: g["rank"])
    out: dict = {"ranks": got}
    labels = ["first pass", "later passes"] if a["passes"] > 1 else ["first pass"]
    for label in labels:
        sel = slice(0, 1) if label == "first pass" else slice(1, None)
        per_rank = [sum(p["tokens"] for p in g["passes"][sel]) / sum(p["seconds"] for p in g["passes"][sel])
                    for g in got]
        wall = max(sum(p["seconds"] for p in g["passes"][sel]) for g in got)
        tokens = sum(sum(p["tokens"] for p in g["passes"][sel]) for g in got)
        out[label] = {"tok_s_per_rank_median": statistics.median(per_rank), "tok_s_per_rank_min": min(per_rank),
                      "tok_s_all_ranks": tokens / wall,
                      "stored_gb_s_all_ranks": a["bytes_per_token"] * tokens / wall / 1e9}
    return out


def step_rate(args, tmp: Path, arts: dict, parts: list, preloaded_reader) -> dict:
    """speculators' Eagle3DraftModel step at this shape on one batch (bench_train.run_bare_step)."""
    from bench_train import random_target, run_bare_step

    from tasks.core.config import RunConfig
    from tasks.engine.target import load_hf_config

    target = random_target(tmp / "target", args.hidden, args.layers, args.vocab, args.device)
    cfg = RunConfig.model_validate({
        "target": {"model": target}, "extract": {"layer_ids": list(range(1, args.layers + 1))},
        "train": {"batch_tokens": args.batch_tokens, "device": args.device, "attn_impl": args.attn_impl,
                  "precision": "bf16" if args.device == "cuda" else "auto"}})
    k = args.draft_vocab
    t2d = torch.zeros(args.vocab, dtype=torch.bool)
    t2d[:k] = True
    inputs = SimpleNamespace(target_path=target, hf_config=load_hf_config(cfg.target, target),
                             layer_ids=list(range(1, args.layers + 1)), d2t=torch.zeros(k, dtype=torch.int64), t2d=t2d,
                             parts=parts)
    preloaded = {(p.digest, p.name): preloaded_reader(p) for p in parts}
    return run_bare_step(cfg, inputs, preloaded, args.attn_impl, args.step_steps, args.device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--layers", type=int, default=4, help="stored layers: 3 auxiliary + the last")
    ap.add_argument("--part-tokens", type=int, default=None,
                    help="default: --batch-tokens + --samples-per-part, so that a part holds exactly one batch of "
                         "training positions and a pass is exactly --parts-per-rank batches")
    ap.add_argument("--parts-per-rank", type=int, default=3)
    ap.add_argument("--samples-per-part", type=int, default=8)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--sources", default="disk,raw,warm,s3",
                    help="disk: the loader on a cold local disk; raw: the same files read plainly on the same cold "
                         "disk (the disk's ceiling, the loader's baseline); warm: the loader on parts in the page "
                         "cache (its own ceiling: CPU, copies, PCIe); s3: through the node part cache from S3")
    ap.add_argument("--vocab", type=int, default=163840, help="target vocabulary (the step)")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--attn-impl", choices=["sdpa", "flex_attention"], default=None,
                    help="the step's attention (default: flex_attention on cuda, sdpa on cpu)")
    ap.add_argument("--step-steps", type=int, default=None, help="time the step this many times (default: 8 on "
                    "cuda, 0 on cpu)")
    ap.add_argument("--workdir", default=None, help="where the parts, the S3 server's data and the cache go")
    ap.add_argument("--out", default=None)
    ap.add_argument("--step-tok-s", type=float, default=None,
                    help="a step rate measured by an earlier call on the same machine (skips timing the step; the "
                         "output says so)")
    args = ap.parse_args()
    args.part_tokens = args.part_tokens or args.batch_tokens + args.samples_per_part
    args.attn_impl = args.attn_impl or ("flex_attention" if args.device == "cuda" else "sdpa")
    args.step_steps = args.step_steps if args.step_steps is not None else (8 if args.device == "cuda" else 0)
    from bench_part_cache import write_parts
    from s3server import S3Server

    from tasks.store.artifacts import Store
    from tasks.train.stream import PartReader

    results: dict = {"config": vars(args), "machine": platform.processor() or platform.machine(),
                     "cpus": os.cpu_count(), "torch": torch.__version__, "date": dt.date.today().isoformat(),
                     "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "runs": {}}

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2, default=str))

    n_parts = args.ranks * args.parts_per_rank
    layer_ids = list(range(1, args.layers + 1))
    sources = args.sources.split(",")
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-loader-", dir=args.workdir)))
        env: dict[str, str] = {}
        if "s3" in sources:
            server = S3Server(tmp / "seaweedfs").start()
            stack.callback(server.stop)
            env = server.env()
            os.environ.update(env)
            server.make_bucket("bench")
        for dtype in args.dtypes.split(","):
            written: dict = {}  # the file store's parts, shared by the disk, raw and warm sources
            for source in sources:
                uri = f"s3://bench/{dtype}" if source == "s3" else f"file://{tmp}/store-{dtype}"
                store = open_store(uri, env)
                if uri not in written:
                    t0 = time.perf_counter()
                    written[uri] = write_parts(store, n_parts, args.part_tokens, args.hidden, args.layers,
                                               dtype, args.samples_per_part, vocab=args.vocab)
                    os.sync()
                    arts, parts, positions = written[uri]
                    (digest, art), = arts.items()
                    stored = sum(art.manifest.file(p.name).bytes for p in parts)
                    print(f"{dtype} parts on {'s3' if source == 's3' else 'disk'}: {n_parts} x {args.part_tokens} "
                          f"tokens, {stored / 1e9:.2f} GB ({time.perf_counter() - t0:.0f} s to write)", flush=True)
                arts, parts, positions = written[uri]
                (digest, art), = arts.items()
                cache = str(tmp / f"cache-{dtype}") if source == "s3" else None
                a = {"store": uri, "env": env, "digest": digest, "names": [p.name for p in parts],
                     "positions": positions, "cache": cache, "layer_ids": layer_ids, "hidden": args.hidden,
                     "ranks": args.ranks, "batch_tokens": args.batch_tokens, "passes": args.passes,
                     "prefetch": args.prefetch, "device": args.device, "evict": source != "warm",
                     "raw": source == "raw", "bytes_per_token": stored / (n_parts * args.part_tokens)}
                res = run_loaders(a)
                results["runs"][f"{source}/{dtype}"] = res
                save()
                for label in ("first pass", "later passes"):
                    if label in res:
                        r = res[label]
                        print(f"  {source} {dtype} {label}: {r['tok_s_per_rank_median']:,.0f} tok/s per rank (median; "
                              f"slowest {r['tok_s_per_rank_min']:,.0f}), {r['tok_s_all_ranks']:,.0f} all ranks, "
                              f"{r['stored_gb_s_all_ranks']:.2f} GB/s stored bytes", flush=True)
                if args.step_steps and "step" not in results and dtype == "bf16" and source == "disk":
                    # the step of the same shape, in the same run, once the loaders are done with the GPUs
                    step = step_rate(args, tmp, arts, parts[:2], PartReader(arts, layer_ids, args.hidden))
                    results["step"] = step
                    save()
                    print(f"training step at this shape ({args.attn_impl}, {args.batch_tokens} tokens): "
                          f"{step['tokens_per_s']:,.0f} tok/s", flush=True)
                if cache:
                    shutil.rmtree(cache, ignore_errors=True)
            for uri in written:  # room on the disk for the next dtype
                (digest, _), = written[uri][0].items()
                open_store(uri, env).delete("extract", digest)
        if "step" not in results and args.step_tok_s:
            results["step"] = {"tokens_per_s": args.step_tok_s, "measured": "by an earlier call (--step-tok-s)"}
            print(f"training step at this shape: {args.step_tok_s:,.0f} tok/s (given: --step-tok-s)")
        if "step" in results:
            step = results["step"]
            for key, res in results["runs"].items():
                for label in ("first pass", "later passes"):
                    if label in res:
                        res[label]["per_rank_over_step"] = res[label]["tok_s_per_rank_min"] / step["tokens_per_s"]
                        ratio = res[label]["per_rank_over_step"]
                        print(f"  {key} {label}: slowest rank's loader / step = {ratio:.2f}x")
            save()
        for dtype in args.dtypes.split(","):  # the loader against the plain read of the same cold files
            disk, raw = results["runs"].get(f"disk/{dtype}"), results["runs"].get(f"raw/{dtype}")
            if disk and raw:
                label = "later passes" if "later passes" in disk else "first pass"
                disk[label]["all_ranks_over_raw"] = disk[label]["tok_s_all_ranks"] / raw[label]["tok_s_all_ranks"]
                print(f"  {dtype}: the loader on a cold disk / a plain read of the same files = "
                      f"{disk[label]['all_ranks_over_raw']:.2f}x ({label}, all ranks)")
        save()


if __name__ == "__main__":
    main()
