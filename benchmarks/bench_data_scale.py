"""prepare and vocab at the hero run's count: time and peak memory (RSS) as the sample count grows.

    .venv/bin/python benchmarks/bench_data_scale.py --samples 10000 100000 [600000] [--workers 1 2] [--json out.json]

The rows are built from the offline chitchat-dataset (7,168 human conversations): each sample is one user turn
and one assistant turn made of chitchat messages joined until they reach a drawn length, so that the mix has the
Kimi preset's assumed lengths (configs/rates.yaml: a mean 600-token prompt and an answer of 0.6 x 4,096 = 2,458
tokens; drawn uniformly in 300-900 and 1,200-3,700 here), and every sample is distinct (a numbered first line),
so dedupe keeps them all. One JSONL is written for the largest count; each smaller count reads its first rows
(`data.sources[].max_samples`). The tokenizer is the demo target's (SmolLM2-135M-Instruct; Kimi's is not on
this offline machine): token counts are that tokenizer's.

Each stage runs in its own fresh Python process (`run_prepare` into a file:// store with the preset's 512 shards and
its held-out share (2,000 of 600,000), then `run_vocab` on that artifact); reported per count: the stage's own wall time and CPU time (imports and the
tokenizer's loading excluded; on a shared machine the CPU time is the figure to compare), samples per second, and the process's peak RSS (getrusage ru_maxrss) with what it was before
the stage started (imports), so the stage's own growth shows, and the peak bytes of the stage's local spill files
(tasks/data/spill.py, in its temp folder: TMPDIR is set to a folder of its own and polled every 0.2 s).

`--workers N [N ...]`: prepare once per count at each `data.workers` (tasks/data/encoding.py; each into a store of
its own, vocab on the first). With workers above 1 the CPU time adds the worker processes' (getrusage
RUSAGE_CHILDREN: they are joined when the stage ends), their start (imports and tokenizer, ~6 CPU-seconds each)
included, and the memory is reported three ways: the parent's peak RSS, the largest worker's (RUSAGE_CHILDREN
ru_maxrss) and the peak of the parent's and its workers' RSS summed (psutil, polled every 0.2 s).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

CHILD = r"""
import json, os, resource, sys, tempfile, threading, time
import psutil
stage, rows, store_dir, n, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
scratch_peak = [0]
tree_peak = [0]
def watch_tree():  # this process and its encoding workers: peak RSS summed
    me = psutil.Process()
    while True:
        total = 0
        for p in [me] + me.children(recursive=True):
            try:
                total += p.memory_info().rss
            except psutil.Error:  # gone between the listing and the look
                pass
        tree_peak[0] = max(tree_peak[0], total)
        time.sleep(0.2)
def size_of(path):
    try:
        return os.path.getsize(path)
    except OSError:  # deleted between the listing and the look
        return 0
def watch_scratch():  # the stage's local spill files (its own temp folder, TMPDIR here): peak bytes on disk
    while True:
        size = sum(size_of(os.path.join(d, f)) for d, _, fs in os.walk(tempfile.gettempdir()) for f in fs)
        scratch_peak[0] = max(scratch_peak[0], size)
        time.sleep(0.2)
threading.Thread(target=watch_scratch, daemon=True).start()
threading.Thread(target=watch_tree, daemon=True).start()
from tasks.core.config import RunConfig
from tasks.store.artifacts import Store
from tasks.address import digests
from tasks.data.prepare import make_masker, run_prepare
from tasks.data.vocab import run_vocab
cfg = RunConfig.model_validate({
    "target": {"max_model_len": 12288, **({"model": os.environ["BDS_TARGET"]} if os.environ.get("BDS_TARGET") else {})},
    "data": {"sources": [{"path": rows, "max_samples": n}], "heldout": max(1, n // 300), "num_shards": 512,
             "max_length": 12287, "dedupe": True, "workers": workers},
    "regenerate": {"enabled": False}, "vocab": {"draft_vocab_size": 32000}})
store = Store("file://" + store_dir)
make_masker(cfg)  # the tokenizer loaded before the clock starts
r0 = resource.getrusage(resource.RUSAGE_SELF)
c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
before = r0.ru_maxrss
t = time.time()
if stage == "prepare":
    ref = run_prepare(cfg, store)
else:
    data = store.find("prepare", digests.prepare(cfg)).ref()
    ref = run_vocab(cfg, store, data)
secs = time.time() - t
r1 = resource.getrusage(resource.RUSAGE_SELF)
c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
st = ref.stats
print("RESULT " + json.dumps({"seconds": secs, "workers": workers,
      "cpu_seconds": r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
                     + c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime,
      "workers_cpu_seconds": c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime, "rss_before_mib": before / 1024,
      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
      "worker_peak_rss_mib": c1.ru_maxrss / 1024, "tree_peak_rss_mib": tree_peak[0] / 2**20,
      "samples": st.get("samples"), "heldout": st.get("heldout"), "tokens": st.get("tokens"),
      "dropped": st.get("dropped"), "masked_tokens": st.get("masked_tokens"),
      "scratch_peak_mib": scratch_peak[0] / 2**20}))
"""


def chitchat_messages(texts: Path | None = None) -> list[str]:
    """The texts rows are made of: chitchat-dataset's messages, or TEXTS (a JSON list of strings, plain or
    gzipped: a machine without that package, e.g. a node)."""
    if texts is not None:
        import gzip

        with (gzip.open(texts, "rt") if texts.suffix == ".gz" else texts.open()) as fh:
            return [str(t) for t in json.load(fh)]
    sys.path.insert(0, str(ROOT))
    from tasks.core.config import SourceConfig
    from tasks.data.sources import load_source

    convs = load_source(SourceConfig(preset="chitchat"), keep_thinking=False).conversations
    return [m["content"] for c in convs for m in c.messages if m["role"] != "system"]


def write_rows(path: Path, n: int, seed: int = 0, texts_file: Path | None = None) -> None:
    """N distinct two-turn samples at the preset's assumed lengths (~4 characters per token)."""
    texts = chitchat_messages(texts_file)
    rng = random.Random(seed)

    def text_of(tokens: int) -> str:
        out, size = [], 0
        while size < 4 * tokens:
            t = texts[rng.randrange(len(texts))]
            out.append(t)
            size += len(t) + 1
        return "\n".join(out)

    part = path.with_suffix(".part")  # renamed when whole: a killed run leaves no short file to reuse
    with open(part, "w") as fh:
        for i in range(n):
            prompt = f"Request {i}:\n" + text_of(rng.randint(300, 900))
            answer = text_of(rng.randint(1200, 3700))
            fh.write(json.dumps({"messages": [{"role": "user", "content": prompt},
                                              {"role": "assistant", "content": answer}]}) + "\n")
    part.rename(path)


def run_stage(stage: str, rows: Path, store: Path, n: int, log: Path, workers: int = 1) -> dict:
    tmp = log.parent / f"tmp-{stage}-{n}-w{workers}"  # the stage's temp folder, watched for its spill files
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "TMPDIR": str(tmp)}
    with open(log, "a") as fh:
        proc = subprocess.run([PY, "-c", CHILD, stage, str(rows), str(store), str(n), str(workers)], stdout=subprocess.PIPE,
                              stderr=fh, text=True, env=env, cwd=str(ROOT))
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"{stage} at {n} failed (rc {proc.returncode}); see {log}")
    out = json.loads(line[len("RESULT "):])
    out["samples_per_s"] = n / out["seconds"]
    out["samples_per_cpu_s"] = n / out["cpu_seconds"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_data_scale"))
    ap.add_argument("--workers", type=int, nargs="+", default=[1],
                    help="data.workers values to run prepare at, each count (default: 1)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--target", default=None,
                    help="a model folder whose tokenizer and chat template prepare uses (default: the demo model)")
    ap.add_argument("--texts", type=Path, default=None,
                    help="a JSON list of texts (.json or .json.gz) to build the rows from, instead of chitchat-dataset")
    args = ap.parse_args()
    if args.target:
        os.environ["BDS_TARGET"] = args.target
    args.work.mkdir(parents=True, exist_ok=True)
    biggest = max(args.samples)
    rows = args.work / f"rows-{biggest}.jsonl"
    if not rows.exists():
        t = time.time()
        write_rows(rows, biggest, texts_file=args.texts)
        print(f"wrote {biggest:,} rows ({rows.stat().st_size / 2**20:,.0f} MiB) in {time.time() - t:.0f} s")
    results = {}
    for n in sorted(args.samples):
        got: dict = {}
        for w in args.workers:
            store = args.work / (f"store-{n}" if w == 1 else f"store-{n}-w{w}")  # one address: a store each
            p = got[f"prepare-w{w}"] = run_stage("prepare", rows, store, n, args.work / "log.txt", w)
            print(f"{n:>8,} samples, workers {w}: prepare {p['seconds']:8.1f} s ({p['samples_per_s']:6.1f} samples/s, "
                  f"{p['samples_per_cpu_s']:6.1f} per CPU-second, {p['tokens'] / max(p['samples'], 1):,.0f} tok/sample), "
                  f"peak RSS {p['peak_rss_mib']:7.0f} MiB (before {p['rss_before_mib']:.0f}; largest worker "
                  f"{p['worker_peak_rss_mib']:.0f}, all together {p['tree_peak_rss_mib']:.0f}), scratch disk peak "
                  f"{p['scratch_peak_mib']:.0f} MiB", flush=True)
            if w != args.workers[0]:
                first = got[f"prepare-w{args.workers[0]}"]
                print(f"{'':>8} workers {w} / workers {args.workers[0]}: {first['seconds'] / p['seconds']:.2f}x the "
                      f"samples/s, {p['cpu_seconds'] / first['cpu_seconds']:.2f}x the CPU seconds", flush=True)
        first_store = args.work / (f"store-{n}" if args.workers[0] == 1 else f"store-{n}-w{args.workers[0]}")
        v = got["vocab"] = run_stage("vocab", rows, first_store, n, args.work / "log.txt", args.workers[0])
        got["prepare"] = got[f"prepare-w{args.workers[0]}"]
        results[n] = got
        print(f"{n:>8,} samples: vocab {v['seconds']:7.1f} s, peak RSS {v['peak_rss_mib']:6.0f} MiB "
              f"(before {v['rss_before_mib']:.0f})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
