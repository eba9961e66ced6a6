"""Why the extraction stage's part writers lag the store path alone (issue 47), on the CPU, side by side in one run.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_stagewrite.py [--requests 16] [--vocab 128256] [--workers 2]

Feeds the stage's own part-writing code (`_PartWriter` with its `StateCheck`, `PartBuffer`, `ArtifactWriter`)
with per-request safetensors files in /dev/shm of the vLLM connector's layout (hidden_states [2048, 4, 4096] bf16,
token_ids int64), read with the engine's reader (`read_safetensors`), parts of 4,096 tokens into a file:// store in
the temp folder; the lm_head of the 8B shape (vocab 128,256 x 4,096, bf16) for the extraction check. Timed per
step for one part (read, add, check, write+sha256+close), then the whole writer without the check, with it scored per part (`batch_rows=1`: before)
and batched (the default: after), and
the store path alone (bench_gpu.write_ceiling: the same bytes through ArtifactWriter.open).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from safetensors.torch import save_file  # noqa: E402

from bench_gpu import write_ceiling  # noqa: E402

from tasks.engine.process import read_safetensors  # noqa: E402
from tasks.extract.stage import _PartWriter  # noqa: E402
from tasks.extract.verify import StateCheck  # noqa: E402
from tasks.formats.parts import PartBuffer  # noqa: E402
from tasks.store.artifacts import Store  # noqa: E402

H, LAYERS, SEQ, PART = 4096, [1, 2, 3, 4], 2048, 4096


class _Head:
    """The verifier head's arithmetic (tasks/engine/target.py VerifierHead.logits) on a random lm_head."""

    def __init__(self, vocab: int):
        from tasks.engine.target import VerifierHead

        self.impl = VerifierHead.__new__(VerifierHead)
        self.impl.norm = torch.nn.RMSNorm(H, eps=1e-5)
        self.impl.lm_head = (torch.randn(vocab, H) * 0.02).to(torch.bfloat16)

    def logits(self, hidden):
        return self.impl.logits(hidden)


def make_requests(folder: Path, n: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = folder / f"req-{i}.safetensors"
        save_file({"hidden_states": torch.randn(SEQ, len(LAYERS), H).to(torch.bfloat16),
                   "token_ids": torch.randint(0, 1000, (SEQ,), dtype=torch.int64)}, str(p))
        paths.append(str(p))
    return paths


def fill(buf: PartBuffer, paths: list[str], start: int, times: dict) -> None:
    for k, p in enumerate(paths):
        t0 = time.perf_counter()
        data, _ = read_safetensors(p)
        hs = data["hidden_states"].to(torch.bfloat16)
        ids = data["token_ids"].tolist()
        t1 = time.perf_counter()
        buf.add(f"s{start + k}", ids, [1] * len(ids), hs, next_token=int(ids[-1]))
        t2 = time.perf_counter()
        times["read"] += t1 - t0
        times["add"] += t2 - t1


def run_writer(store: Store, paths: list[str], workers: int, check) -> dict:
    per = PART // SEQ
    times = {"read": 0.0, "add": 0.0, "wait": 0.0}
    with store.write("bench", f"w-{time.monotonic_ns()}", "1") as w:
        t0 = time.perf_counter()
        with _PartWriter(w, max(2, workers), "bench-writer", workers, check) as writer:
            buf = PartBuffer(LAYERS, H, "bf16", PART)
            for a in range(0, len(paths), per):
                fill(buf, paths[a:a + per], a, times)
                t1 = time.perf_counter()
                writer.put(buf)
                times["wait"] += time.perf_counter() - t1
                buf = writer.take() or PartBuffer(LAYERS, H, "bf16", PART)
            t1 = time.perf_counter()
            writer.finish()
            if check is not None:
                check.flush()  # the stage's `failure` scores what is pending, inside its wall
            times["wait"] += time.perf_counter() - t1
        secs = time.perf_counter() - t0
        nbytes = sum(f.bytes for f in w.files)
        w.files.sort(key=lambda f: f.path)
        shas = [f.sha256 for f in w.files] if hasattr(w.files[0], "sha256") else []
        verify = check.stats() if check is not None else None
        w.commit({})
    return {"seconds": round(secs, 3), "gb_per_s": round(nbytes / secs / 1e9, 3), "bytes": nbytes,
            "write_s": round(writer.write_s, 3), **{k + "_s": round(v, 3) for k, v in times.items()},
            "verify": verify, "shas": shas}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--positions", type=int, default=64)
    a = ap.parse_args()
    shm = Path(tempfile.mkdtemp(prefix="bench-stagewrite-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    tmp = Path(tempfile.mkdtemp(prefix="bench-stagewrite-store-"))
    try:
        paths = make_requests(shm, a.requests)
        head = _Head(a.vocab)
        store = Store(f"file://{tmp}")
        print(f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}, {a.requests} requests of {SEQ} tokens "
              f"in {shm}, store in {tmp}", flush=True)
        # one part, step by step
        times = {"read": 0.0, "add": 0.0}
        buf = PartBuffer(LAYERS, H, "bf16", PART)
        fill(buf, paths[:PART // SEQ], 0, times)
        check = StateCheck(head, a.positions, 0.0, batch_rows=1)  # scored at once, as every part was before
        t0 = time.perf_counter()
        check.add_part(buf)
        t_check = time.perf_counter() - t0
        with store.write("one", f"o-{time.monotonic_ns()}", "1") as w:
            t0 = time.perf_counter()
            with w.open("part-00000.safetensors") as fh:
                part_bytes = buf.write(fh)
            t_write = time.perf_counter() - t0
            w.commit({})
        print(f"one part ({part_bytes / 1e6:.0f} MB): read {times['read']:.3f} s, add {times['add']:.3f} s, "
              f"check {t_check:.3f} s, write+sha256+close {t_write:.3f} s", flush=True)
        parts = a.requests * SEQ // PART
        for rep in range(2):
            res = {"store alone": write_ceiling(store, part_bytes, parts, a.workers),
                   "stage writers, no check": run_writer(store, paths, a.workers, None),
                   "stage writers + check per part (before)": run_writer(
                       store, paths, a.workers, StateCheck(head, a.positions, 0.0, batch_rows=1)),
                   "stage writers + check batched (after)": run_writer(
                       store, paths, a.workers, StateCheck(head, a.positions, 0.0))}
            for k, v in res.items():
                extra = {x: v[x] for x in ("read_s", "add_s", "wait_s", "write_s") if x in v}
                ver = v.get("verify") or {}
                print(f"rep {rep} {k}: {v['gb_per_s']} GB/s in {v['seconds']} s {extra} "
                      + (f"check {ver.get('seconds')} s, agreement {ver.get('top1_agreement')}, gap "
                         f"{ver.get('mean_logit_gap')}" if ver else ""), flush=True)
            alone = res["store alone"]["gb_per_s"]
            before, after = res["stage writers + check per part (before)"], res["stage writers + check batched (after)"]
            same = (before["shas"] == after["shas"] and {k: before["verify"][k] for k in ("positions", "top1_agreement",
                    "mean_logit_gap")} == {k: after["verify"][k] for k in ("positions", "top1_agreement", "mean_logit_gap")})
            print(f"rep {rep} over store alone: no check {res['stage writers, no check']['gb_per_s'] / alone:.3f}, "
                  f"check per part (before) {before['gb_per_s'] / alone:.3f}, check batched (after) "
                  f"{after['gb_per_s'] / alone:.3f}; after/before {after['gb_per_s'] / before['gb_per_s']:.2f}x; "
                  f"same parts and check figures: {same}", flush=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
