"""The extraction write path against the medium's own rate, side by side in one run (issue 47).

    .venv/bin/python benchmarks/bench_write.py [--media tmp,shm,s3] [--part-mb 64,256] [--writers 1,2,4]
        [--upload-mb 8,16,64] [--concurrency 8] [--total-mb 1024] [--rounds 2] [--disk-dir DIR] [--json OUT]

The store path is the stage's own: `tasks.extract.stage._PartWriter` (its `write_workers` threads, each
serializing a `PartBuffer` with `write_safetensors_stream`, hashing it with sha256 while it is written, and
writing it through `ArtifactWriter.open` into a Store), fed `total-mb` of already-collected parts of the 8B
shape (4 layers x hidden 4096, bf16; random bytes). The medium's own rate, on the same bytes (one part
serialized once into a file in RAM):
- file:// on a disk folder (`tmp`: --disk-dir, default $TMPDIR) and on /dev/shm (`shm`): `writers` concurrent
  `dd` loops copying it into the same folder (benchmarks/media.py; no fsync on either side);
- s3:// on a local SeaweedFS (tests/support/s3server.py, its data on the disk folder): a bare multipart
  upload of the same bytes through s3fs's client (create, upload_part of `upload-mb` slices with
  `concurrency` in flight, complete), `writers` objects at once, as many objects as the store path writes.
  The store path runs with the same store.upload_part_mb / upload_concurrency; once per writer count it also
  runs through s3fs's own `fs.open(key, "wb")` writer (what ArtifactWriter used before), for comparison.
Each configuration runs `rounds` times, the order of the two sides alternating; reported are the medians
and store/medium ratios. Every figure carries where its bytes went (`medium`: the folder's df line and type).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support"), str(ROOT / "benchmarks")]

from media import dd_rate, medium  # noqa: E402

LAYERS, HIDDEN = 4, 4096  # the 8B shape's stored width: 3 auxiliary layers + the last, hidden 4096
SAMPLE_TOKENS = 512


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def filled_part(part_bytes: int):
    """A PartBuffer of ~part_bytes of random bf16 states, and its metadata (to refill it after _PartWriter empties it)."""
    import torch

    from tasks.formats.parts import PartBuffer

    per_token = LAYERS * HIDDEN * 2 + 5
    n = max(1, part_bytes // per_token // SAMPLE_TOKENS)
    buf = PartBuffer([2, 16, 29, 32], HIDDEN, "bf16", n * SAMPLE_TOKENS)
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        hs = torch.randn(SAMPLE_TOKENS, LAYERS, HIDDEN, generator=g).to(torch.bfloat16)
        buf.add(f"s{i}", list(range(SAMPLE_TOKENS)), [1] * SAMPLE_TOKENS, hs)
    return buf, (list(buf.sample_ids), list(buf.lengths), list(buf.next_tokens), buf.tokens)


def refill(buf, meta) -> None:
    """Give an emptied buffer its samples back: its memory still holds them (bench only)."""
    buf.sample_ids, buf.lengths, buf.next_tokens, buf.tokens = list(meta[0]), list(meta[1]), list(meta[2]), meta[3]


def store_rate(store, template, parts: int, writers: int) -> dict:
    """`parts` parts through the stage's _PartWriter with `writers` workers (write_queue = writers)."""
    from tasks.extract.stage import _PartWriter
    from tasks.formats.parts import PartBuffer

    buf0, meta = template
    spare = []
    for _ in range(writers):  # the stage holds write_queue + 1 buffers; copies of the template
        b = PartBuffer(buf0.layer_ids, buf0.hidden_size, "bf16", buf0.capacity)
        b._reserve(meta[3])
        b._hidden[:meta[3]].copy_(buf0._hidden[:meta[3]])
        b._ids[:meta[3]].copy_(buf0._ids[:meta[3]])
        b._mask[:meta[3]].copy_(buf0._mask[:meta[3]])
        refill(b, meta)
        spare.append(b)
    spare.append(buf0)
    with store.write("bench-write", uuid.uuid4().hex[:16], "1") as w:
        t0 = time.perf_counter()
        with _PartWriter(w, writers, "bench-writer", writers) as pw:
            for _ in range(parts):
                buf = pw.take() or spare.pop()
                if not buf.tokens:
                    refill(buf, meta)
                pw.put(buf)
            pw.finish()
        secs = time.perf_counter() - t0
        nbytes = sum(f.bytes for f in w.files)
        w.commit({})
    return {"bytes": nbytes, "seconds": round(secs, 3), "gb_per_s": round(nbytes / secs / 1e9, 3), "writers": writers,
            "parts": parts, "write_s_summed": round(pw.write_s, 3)}


def bare_multipart(fs, bucket: str, prefix: str, data: bytes, copies: int, writers: int, part: int, conc: int) -> dict:
    """`copies` objects of `data`, `writers` at a time, each a multipart upload of `part`-byte slices with
    `conc` parts in flight (s3fs's client on its own loop: no copy into a buffer, no hashing)."""
    from fsspec.asyn import sync

    async def one(key: str) -> None:
        if len(data) <= part:
            await fs._call_s3("put_object", Bucket=bucket, Key=key, Body=data)
            return
        mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
        sem = asyncio.Semaphore(conc)

        async def up(i: int) -> dict:
            async with sem:
                return await fs._call_s3("upload_part", Bucket=bucket, Key=key, PartNumber=i + 1,
                                         UploadId=mpu["UploadId"], Body=data[i * part:(i + 1) * part])
        out = await asyncio.gather(*[up(i) for i in range((len(data) + part - 1) // part)])
        await fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=mpu["UploadId"],
                          MultipartUpload={"Parts": [{"PartNumber": i + 1, "ETag": o["ETag"]} for i, o in enumerate(out)]})

    async def all_of() -> None:
        sem = asyncio.Semaphore(writers)

        async def limited(i: int) -> None:
            async with sem:
                await one(f"{prefix}/bare-{i}.bin")
        await asyncio.gather(*[limited(i) for i in range(copies)])

    t0 = time.perf_counter()
    sync(fs.loop, all_of)
    secs = time.perf_counter() - t0
    fs.rm(f"{bucket}/{prefix}", recursive=True)
    return {"bytes": len(data) * copies, "seconds": round(secs, 3), "gb_per_s": round(len(data) * copies / secs / 1e9, 3),
            "writers": writers, "copies": copies}


@contextlib.contextmanager
def s3fs_own_writer():
    """ArtifactWriter.open through s3fs's `fs.open(key, "wb")` (the writer before tasks/store/uploads.py)."""
    import tasks.store.writer as writer

    @contextlib.contextmanager
    def plain(fs, path):
        with fs.open(path, "wb") as fh:
            yield fh
    old = writer.open_for_write
    writer.open_for_write = plain
    try:
        yield
    finally:
        writer.open_for_write = old


def side_by_side(name: str, rounds: int, store_fn, medium_fn, extra: dict) -> dict:
    runs: dict[str, list[dict]] = {"store": [], "medium": []}
    for r in range(rounds):
        order = [("store", store_fn), ("medium", medium_fn)]
        for side, fn in (order if r % 2 == 0 else order[::-1]):
            runs[side].append(fn())
    s = statistics.median(x["gb_per_s"] for x in runs["store"])
    m = statistics.median(x["gb_per_s"] for x in runs["medium"])
    row = {**extra, "store_gb_s": round(s, 3), "medium_gb_s": round(m, 3), "ratio": round(s / m, 3),
           "bytes_per_run": runs["store"][0]["bytes"], "runs": runs}
    log(f"{name}: store {s:.3f} GB/s, medium {m:.3f} GB/s, ratio {s / m:.3f}")
    return row


def bench_file(kind: str, folder: Path, args, out: list) -> None:
    from tasks.store.artifacts import Store

    where = medium(folder)
    log(f"{kind}: {where['df']}")
    for part_mb in args.part_mb:
        template = filled_part(part_mb << 20)
        src = Path(tempfile.mkdtemp(prefix="bench-write-src-", dir="/dev/shm")) / "part.bin"
        with open(src, "wb") as fh:
            template[0].write(fh)
        try:
            parts = max(1, (args.total_mb << 20) // os.path.getsize(src))
            for wr in args.writers:
                def st() -> dict:
                    root = folder / f"store-{uuid.uuid4().hex[:8]}"
                    try:
                        return store_rate(Store(f"file://{root}"), template, parts, wr)
                    finally:
                        shutil.rmtree(root, ignore_errors=True)
                row = side_by_side(f"{kind} part {part_mb} MiB, {wr} writer(s)", args.rounds, st,
                                   lambda: dd_rate(src, folder / "dd", parts, wr),
                                   {"medium": kind, "where": where, "part_mb": part_mb, "writers": wr, "parts": parts,
                                    "baseline": "dd (concurrent loops, bs=16M)"})
                out.append(row)
        finally:
            shutil.rmtree(src.parent, ignore_errors=True)


def bench_s3(folder: Path, args, out: list) -> None:
    from s3server import S3Server

    from tasks.core.config import StoreConfig
    from tasks.store.artifacts import Store

    data_dir = Path(tempfile.mkdtemp(prefix="bench-write-s3-", dir=folder))
    server = S3Server(data_dir).start()
    try:
        os.environ.update(server.env())
        server.make_bucket("bench")
        where = {**medium(data_dir), "server": "SeaweedFS (weed mini) on loopback, its volumes in this folder"}
        warm = Store.from_config(StoreConfig(uri="s3://bench/warm-up"))  # connections, the bucket's first volume
        store_rate(warm, filled_part(8 << 20), 2, 1)
        warm.fs.rm(warm.root, recursive=True)
        log(f"s3: SeaweedFS at {server.endpoint}, data on {where['df']}")
        for part_mb in args.part_mb:
            template = filled_part(part_mb << 20)
            import io
            fh = io.BytesIO()
            template[0].write(fh)
            data = fh.getvalue()
            parts = max(1, (args.total_mb << 20) // len(data))
            for wr in args.writers:
                for up in args.upload_mb:
                    for conc in args.concurrency:
                        cfg = StoreConfig(uri=f"s3://bench/{uuid.uuid4().hex[:8]}", upload_part_mb=up,
                                          upload_concurrency=conc)
                        store = Store.from_config(cfg)
                        row = side_by_side(
                            f"s3 part {part_mb} MiB, {wr} writer(s), upload parts {up} MiB x{conc}", args.rounds,
                            lambda: store_rate(store, template, parts, wr),
                            lambda: bare_multipart(store.fs, "bench", f"bare-{uuid.uuid4().hex[:8]}", data, parts, wr,
                                                   up << 20, conc),
                            {"medium": "s3", "where": where, "part_mb": part_mb, "writers": wr, "parts": parts,
                             "upload_part_mb": up, "upload_concurrency": conc,
                             "baseline": "bare multipart upload, same part size and concurrency"})
                        out.append(row)
                        store.fs.rm(store.root, recursive=True)
                if args.s3fs_writer:
                    store = Store.from_config(StoreConfig(uri=f"s3://bench/{uuid.uuid4().hex[:8]}"))
                    up, conc = args.upload_mb[0], args.concurrency[0]
                    with s3fs_own_writer():
                        row = side_by_side(
                            f"s3 part {part_mb} MiB, {wr} writer(s), s3fs's own fs.open writer", 1,
                            lambda: store_rate(store, template, parts, wr),
                            lambda: bare_multipart(store.fs, "bench", f"bare-{uuid.uuid4().hex[:8]}", data, parts, wr,
                                                   up << 20, conc),
                            {"medium": "s3", "where": where, "part_mb": part_mb, "writers": wr, "parts": parts,
                             "writer": "s3fs fs.open(key, 'wb') (before)", "upload_part_mb": up,
                             "upload_concurrency": conc,
                             "baseline": "bare multipart upload, upload_part_mb x upload_concurrency"})
                    out.append(row)
                    store.fs.rm(store.root, recursive=True)
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--media", default="tmp,shm,s3")
    ap.add_argument("--part-mb", type=ints, default=[64, 256], help="extraction part sizes (MiB)")
    ap.add_argument("--writers", type=ints, default=[1, 2, 4], help="extract.write_workers")
    ap.add_argument("--upload-mb", type=ints, default=[16], help="store.upload_part_mb (S3)")
    ap.add_argument("--concurrency", type=ints, default=[8], help="store.upload_concurrency (S3)")
    ap.add_argument("--total-mb", type=int, default=1024, help="bytes written per run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-s3fs-writer", dest="s3fs_writer", action="store_false",
                    help="skip the runs through s3fs's own writer")
    ap.add_argument("--disk-dir", default=None, help="a folder on disk (default: $TMPDIR)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    disk = Path(tempfile.mkdtemp(prefix="bench-write-", dir=args.disk_dir))
    shm = Path(tempfile.mkdtemp(prefix="bench-write-", dir="/dev/shm"))
    out: list = []
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
           "command": " ".join([".venv/bin/python", "benchmarks/bench_write.py", *sys.argv[1:]]),
           "load_before": os.getloadavg()}
    try:
        for m in args.media.split(","):
            if m == "tmp":
                bench_file("disk", disk, args, out)
            elif m == "shm":
                bench_file("tmpfs", shm, args, out)
            elif m == "s3":
                bench_s3(disk, args, out)
            else:
                raise SystemExit(f"unknown medium {m!r}: use tmp, shm, s3")
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    env["load_after"] = os.getloadavg()
    print("\n| medium (where) | part MiB | writers | upload | store GB/s | medium GB/s | store / medium |")
    print("|---|---|---|---|---|---|---|")
    for r in out:
        up = (f"{r['upload_part_mb']} MiB x{r['upload_concurrency']}" if "upload_part_mb" in r else "-")
        up += " (s3fs's writer)" if "writer" in r else ""
        print(f"| {r['medium']} ({r['where']['fstype']} {r['where']['mount']}) | {r['part_mb']} | {r['writers']} | {up} "
              f"| {r['store_gb_s']} | {r['medium_gb_s']} | {r['ratio']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "rows": out}, indent=2, default=str))


if __name__ == "__main__":
    main()
