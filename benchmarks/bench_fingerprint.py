"""What a plain model folder's fingerprint costs: its weight files hashed once on this node, then none.

    .venv/bin/python benchmarks/bench_fingerprint.py                  # 4 files x 256 MiB
    .venv/bin/python benchmarks/bench_fingerprint.py --files 8 --mib 1024 --dir /nvme/tmp

Writes --files random `*.safetensors` files of --mib MiB (plus a config.json) into a temporary folder under
--dir, then times `tasks.engine.weights.folder_fingerprint` three ways: the first call (every weight byte read
and sha256'd, in parallel threads, recorded in the node's cache), a second call in a new process's state (the
per-process cache cleared: the node's record answers, `hashed` counts no byte), and a hub cache's snapshot of
the same files (links to `blobs/<sha256>`; the names are not trusted since issue 45: the blobs are hashed once on
this node, like a plain folder's files, then the node's record answers). The files were just written, so the first
call reads them from the page cache: the figure is the hashing rate of this CPU; a cold disk adds its own read
rate (the slower of the two bounds a 600 GB folder's first fingerprint).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-fingerprint-", dir=args.dir))
    os.environ["DRAFTLINE_HOME"] = str(work / "node")
    from tasks.engine import weights

    try:
        folder = work / "model"
        folder.mkdir()
        (folder / "config.json").write_text('{"model_type": "llama"}\n')
        block = os.urandom(1 << 20)
        for i in range(args.files):
            with open(folder / f"model-{i:05d}.safetensors", "wb") as fh:
                for j in range(args.mib):
                    fh.write(hashlib.sha256(block + bytes([i]) + j.to_bytes(4, "little")).digest() + block[32:])
        total = args.files * args.mib * (1 << 20)

        t0 = time.perf_counter()
        first = weights.folder_fingerprint(folder)
        t_first = time.perf_counter() - t0
        assert weights.hashed["bytes"] == total, weights.hashed

        weights._folder_fingerprint.cache_clear()
        t0 = time.perf_counter()
        again = weights.folder_fingerprint(folder)
        t_again = time.perf_counter() - t0
        assert again == first and weights.hashed["bytes"] == total

        hub = work / "hub" / "snapshots" / ("0" * 40)
        (work / "hub" / "blobs").mkdir(parents=True)
        hub.mkdir(parents=True)
        record = weights.file_sha256s([str(p) for p in folder.glob("*.safetensors")])
        for p in folder.iterdir():
            blob = work / "hub" / "blobs" / (record.get(str(p)) or hashlib.sha1(p.read_bytes()).hexdigest())
            os.link(p, blob)
            (hub / p.name).symlink_to(os.path.relpath(blob, hub))
        t0 = time.perf_counter()
        snap = weights.folder_fingerprint(hub)
        t_hub_first = time.perf_counter() - t0
        read = weights.hashed["bytes"] - total
        weights._folder_fingerprint.cache_clear()
        t0 = time.perf_counter()
        assert weights.folder_fingerprint(hub) == snap == first
        t_hub = time.perf_counter() - t0
        assert weights.hashed["bytes"] == total + read  # the second reads nothing
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"machine: {platform.machine()} {cpu}, {os.cpu_count()} cores")
    print(f"first fingerprint of {args.files} x {args.mib} MiB: {t_first:.2f} s = {total / t_first / 1e6:,.0f} MB/s "
          f"(sha256 of every weight byte, page cache, {min(8, os.cpu_count() or 1, args.files)} threads)")
    print(f"second fingerprint (node record): {t_again * 1e3:.1f} ms, 0 bytes read")
    print(f"hub cache snapshot: first {t_hub_first:.2f} s ({read / 1e6:,.0f} MB read: the blobs hashed once, their "
          f"names not trusted), then {t_hub * 1e3:.1f} ms, 0 bytes read")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
