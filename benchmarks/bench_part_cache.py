"""Bytes read from S3 over a 3-epoch run, with and without the node-local part cache.

    .venv/bin/python benchmarks/bench_part_cache.py                    # 2 nodes x 2 ranks, 3 epochs
    .venv/bin/python benchmarks/bench_part_cache.py --nodes 1 --ranks 8 --parts 32

A real SeaweedFS server (tests/support/s3server.py) holds --parts extraction parts (random hidden states in
the extract stage's format, tasks.formats.parts.PartBuffer). Every rank runs the training stream
(tasks.train.stream.BatchStream over a PartReader, the loop's own data path) until it has finished
--epochs epochs of its share (its positions, counted; prefetch 0, so nothing is read ahead but
the part the last batch runs into); the ranks of a node are threads of this process sharing one cache folder
(tasks/store/part_cache.py), as a node's ranks share its disk. The bytes are counted on the client: every
GET of a part's range (`fs.cat_file`, through which both the cache's fills and the uncached temporary
copies read) adds the bytes it returned. Not counted: the manifests, and the held-out part the
trainer reads once per rank at its start (the same with and without the cache).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "support"))

import torch  # noqa: E402

from tasks.store.part_cache import PartCache  # noqa: E402
from tasks.formats.parts import PartBuffer  # noqa: E402
from tasks.store.artifacts import Store  # noqa: E402
from tasks.store.reader import Artifact  # noqa: E402
from tasks.train.stream import BatchStream, PartReader, PartSpec  # noqa: E402


def write_parts(store: Store, parts: int, tokens: int, hidden: int, layers: int, dtype: str = "bf16",
                samples_per_part: int = 8, seed: int = 0,
                vocab: int = 32000) -> tuple[dict[str, Artifact], list[PartSpec], dict[str, int]]:
    """One extract-like artifact of `parts` parts of `tokens` tokens each (random hidden states, each part's
    its own rotation of one random block so that no two parts are alike, random sample lengths), written
    as the extract stage writes them. Returns ({digest: artifact}, part specs,
    {part name: training positions in it})."""
    g = torch.Generator().manual_seed(seed)
    layer_ids = list(range(1, layers + 1))
    buf = PartBuffer(layer_ids, hidden, dtype, capacity=tokens)
    names, positions = [], {}
    base = torch.randn(tokens, layers, hidden, generator=g).to(torch.bfloat16)  # each part: rolled by its own shift
    with store.write("extract", f"bench{seed:04d}{dtype}{hidden}x{tokens}"[:60], "bench") as w:
        for p in range(parts):
            buf.reset()
            states = torch.roll(base, shifts=1 + p * 7919 % tokens, dims=0) if p else base
            cuts = sorted(torch.randperm(tokens - 1, generator=g)[:samples_per_part - 1].add(1).tolist())
            for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, tokens])):
                n = b - a
                buf.add(f"p{p}-s{i}", torch.randint(3, vocab, (n,), generator=g), [0] + [1] * (n - 1), states[a:b])
            name = f"part-{p:05d}.safetensors"
            positions[name] = tokens - samples_per_part  # a sample of n tokens trains n - 1 positions
            with w.open(name) as fh:
                buf.write(fh)
            names.append(name)
        art = w.commit({"layer_ids": layer_ids, "hidden_size": hidden, "storage_dtype": dtype})
    specs = [PartSpec(index=i, shard=0, digest=art.digest, name=n) for i, n in enumerate(names)]
    return {art.digest: art}, specs, positions


def count_gets(store: Store) -> list[int]:
    got: list[int] = []
    real = store.fs.cat_file

    def cat_file(path, start=None, end=None, **kw):
        data = real(path, start=start, end=end, **kw)
        got.append(len(data))
        return data

    store.fs.cat_file = cat_file
    return got


def run(store: Store, arts: dict, parts: list[PartSpec], positions: dict[str, int], *, nodes: int, ranks: int,
        epochs: int, hidden: int,
        layers: int, batch_tokens: int, cache_root: Path | None) -> dict:
    got = count_gets(store)
    world = nodes * ranks
    caches = [PartCache(cache_root / f"node{n}", cap_gib=1024) if cache_root else None for n in range(nodes)]
    errors: list[BaseException] = []
    batches = [0] * world

    def rank_main(rank: int) -> None:
        try:
            reader = PartReader(arts, list(range(1, layers + 1)), hidden, cache=caches[rank // ranks])
            # prefetch 0: a part is read when the packer needs it, so stopping after exactly `epochs` epochs of
            # the share's positions reads at most the one part that the last batch runs into
            s = BatchStream(parts, reader, batch_tokens=batch_tokens, seed=0, rank=rank, world=world, prefetch=0)
            want = epochs * sum(positions[p.name] for p in s.share())
            done = 0
            try:
                while done < want:
                    done += s.next().tokens
                    batches[rank] += 1
            finally:
                s.close()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    store.fs.cat_file = type(store.fs).cat_file.__get__(store.fs)
    out = {"bytes_from_s3": sum(got), "gets": len(got), "wall_s": round(time.perf_counter() - t0, 2),
           "batches": sum(batches)}
    if cache_root:
        out["per_node_fetched"] = [c.stats.fetched_bytes for c in caches]
        out["per_node_hits"] = [c.stats.hits for c in caches]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2, help="ranks per node")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--parts", type=int, default=16)
    ap.add_argument("--part-tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from s3server import S3Server

    from tasks.core.config import StoreConfig

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-cache-")))
        server = S3Server(tmp / "seaweedfs").start()
        stack.callback(server.stop)
        os.environ.update(server.env())
        server.make_bucket("bench")
        store = Store.from_config(StoreConfig(uri="s3://bench/cache"))
        arts, parts, positions = write_parts(store, args.parts, args.part_tokens, args.hidden, args.layers, args.dtype)
        stored = sum(a.manifest.file(p.name).bytes for p in parts for a in [arts[p.digest]])
        print(f"{len(parts)} parts, {stored / 1e6:.1f} MB on {store.uri}; {args.nodes} nodes x {args.ranks} ranks, "
              f"{args.epochs} epochs", flush=True)
        common = dict(nodes=args.nodes, ranks=args.ranks, epochs=args.epochs, hidden=args.hidden, layers=args.layers,
                      batch_tokens=args.batch_tokens)
        without = run(store, arts, parts, positions, cache_root=None, **common)
        print(f"without the cache: {without['bytes_from_s3'] / 1e6:.1f} MB from S3 ({without['gets']} GETs, "
              f"{without['wall_s']} s)", flush=True)
        with_cache = run(store, arts, parts, positions, cache_root=tmp / "caches", **common)
        print(f"with the cache:    {with_cache['bytes_from_s3'] / 1e6:.1f} MB from S3 ({with_cache['gets']} GETs, "
              f"{with_cache['wall_s']} s); per node {[round(b / 1e6, 1) for b in with_cache['per_node_fetched']]} MB",
              flush=True)
    ratio = without["bytes_from_s3"] / with_cache["bytes_from_s3"]
    print(f"bytes read from S3, without / with the cache: {ratio:.2f}x "
          f"(stored {stored / 1e6:.1f} MB; with the cache {with_cache['bytes_from_s3'] / stored:.2f}x the stored "
          "bytes)")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "config": vars(args), "stored_bytes": stored, "without": without, "with": with_cache, "ratio": ratio,
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "date": dt.date.today().isoformat()}, indent=2))


if __name__ == "__main__":
    main()
