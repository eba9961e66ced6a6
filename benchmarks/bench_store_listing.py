"""`draftline ls`, `check` and `plan --from-store` on a store the size of the Kimi preset's (issue 43, item 4).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_store_listing.py [--shards 128 1024] [--stores s3 file]
        [--baseline DIR] [--out FILE] [--index-regenerate]

For each count SHARDS and each kind of store (a real SeaweedFS with its request counters on, and a file://
folder) the store is built through the store's own writer (Store.writer, tiny files, the manifests what a run
commits, stats included), 16 commits at a time: the prepare artifact of benchmarks/rehearsal.yaml with
regeneration on and SHARDS/2 shards (one file per shard, as prepare writes them; at 1,024 the preset's 512),
its SHARDS/2 regeneration shards at their addresses (as a run killed before the regenerate artifact leaves
them; with --index-regenerate also the index a regeneration stage's end writes), SHARDS extraction shards with
their self-check figures and the index of their manifests that the stage's end writes
(tasks/store/manifest_index.py), and a train artifact naming every extraction shard. Then each command runs as a
user runs it (a fresh process, so the import time is in the figure;
`draftline --help` is timed beside it as that floor), three times: the median wall seconds, the CPU seconds
of that run, and (on S3) the store's requests by kind (SeaweedFS's counters; it counts HEAD as GET). With
--baseline DIR (a checkout of the code before a change, e.g. `git archive BASE | tar -x -C DIR`) each
command also runs from that code, side by side, in the same loop.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

from prefect_server import free_port  # noqa: E402
from rehearse import conversations, store_counters  # noqa: E402
from s3server import S3Server  # noqa: E402

# The preset's shape with a target this machine holds (the preset's own address needs Kimi-K2.5's snapshot)
CONFIG = ROOT / "benchmarks" / "rehearsal.yaml"
DATA = Path(tempfile.gettempdir()) / "bench-listing-conversations.jsonl"  # the config's source (its content is addressed)


def sets(shards: int) -> list[str]:
    """The overrides every command gets: the preset's shape at SHARDS/2 data shards, the generated source."""
    if not DATA.exists():
        conversations(DATA, 64)
    return ["regenerate.enabled=true", f"data.num_shards={shards // 2}", "data.max_samples=600000",
            f"data.sources=[{{path: {DATA}, name: rehearsal}}]"]


def hexd(*parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def build(uri: str, shards: int, index_regenerate: bool = False) -> str:
    """The store; returns the train digest. INDEX_REGENERATE: the regeneration shards indexed too."""
    from tasks.address import digests
    from tasks.core.config import StoreConfig
    from tasks.core.config_load import load_config
    from tasks.store.artifacts import ArtifactRef, Store

    cfg = load_config(CONFIG, [*sets(shards), f"store.uri={uri}"])
    store = Store.from_config(StoreConfig(uri=uri))
    data_shards = shards // 2

    def commit(stage: str, digest: str, stats: dict, inputs: dict | None = None,
               files: dict[str, bytes] | None = None) -> ArtifactRef:
        w = store.writer(stage, digest, "rehearsal", inputs or {})
        for name, data in (files or {"part.bin": b"x" * 64}).items():
            w.write_bytes(name, data)
        return w.commit(stats).ref()

    prep = commit("prepare", digests.prepare(cfg), {"samples": 600000, "tokens": 900_000_000,
                                                     "masked_tokens": 500_000_000, "num_shards": data_shards},
                  files={f"shard-{i:05d}.parquet": b"x" * 64 for i in range(data_shards)})
    reg = digests.regenerate(cfg, prep)
    per = 600000 // data_shards
    ext = [hexd("extract", i) for i in range(shards)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: commit(digests.REGENERATE_SHARD, digests.regenerate_shard(reg, i), {
            "shard": i, "samples": per, "tokens": per * 3000, "generated_tokens": per * 2400}), range(data_shards)))
        list(pool.map(lambda i: commit("extract", ext[i], {
            "shard": i, "samples": per // 2, "tokens": per * 1500, "seconds": 60.0,
            "verified": {"positions": 256, "agree": 254, "rate": 0.992}}, {"data": prep.digest}), range(shards)))
    store.write_index("extract", ext)  # as the extract stage's end writes it (flows/shard_nodes.py); the regeneration
    if index_regenerate:  # shards have none (their run was killed before its end) unless asked: that stage ended
        store.write_index(digests.REGENERATE_SHARD, [digests.regenerate_shard(reg, i) for i in range(data_shards)])
    train = hexd("train", shards)
    import numpy as np
    from safetensors.numpy import save

    # a draft folder with one tensor (no d2t/t2d: the maps check has nothing to compare), the vocab not stored
    commit("train", train, {"steps": 60000, "stopped_reason": "max_steps"},
           {"extract": ",".join(ext), "vocab": hexd("vocab")},
           files={"draft/model.safetensors": save({"w": np.zeros(4, np.float32)}), "draft/config.json": b"{}"})
    return train


def timed(argv: list[str], env: dict[str, str], code: Path, metrics: int | None, repeat: int = 3) -> dict:
    """The command from CODE, REPEAT times: the median run's wall and CPU seconds and store requests."""
    runs = []
    env = dict(env, PYTHONPATH=str(code))
    for _ in range(repeat):
        c0, r0, t0 = store_counters(metrics) if metrics else {}, resource.getrusage(resource.RUSAGE_CHILDREN), \
            time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "cli.app", *argv], cwd=code, env=env, capture_output=True,
                             text=True, timeout=900)
        wall = time.perf_counter() - t0
        r1, c1 = resource.getrusage(resource.RUSAGE_CHILDREN), store_counters(metrics) if metrics else {}
        runs.append({"s": round(wall, 2), "cpu_s": round(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime, 2),
                     "requests": {k: int(v - c0.get(k, 0)) for k, v in c1.items()
                                  if not k.startswith("bytes") and v != c0.get(k, 0)},
                     "rc": out.returncode, "out_chars": len(out.stdout),
                     "err_tail": out.stderr[-300:] if out.returncode not in (0, 1) else ""})
    mid = sorted(runs, key=lambda r: r["s"])[len(runs) // 2]
    return {**mid, "runs": [r["s"] for r in runs]}


def commands(uri: str, train: str, shards: int) -> dict[str, list[str]]:
    return {"help": ["--help"], "ls": ["ls", "--store", uri, "--json"], "ls_table": ["ls", "--store", uri],
            "ls_extract": ["ls", "--store", uri, "--stage", "extract"],
            "check": ["check", train, "--store", uri, "--json"],
            "plan_from_store": ["plan", str(CONFIG), "--from-store", *(x for v in sets(shards) for x in ("--set", v)),
                                "--set", f"store.uri={uri}", "--json"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, nargs="+", default=[1024])
    ap.add_argument("--stores", nargs="+", default=["s3", "file"], choices=["s3", "file"])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--baseline", type=Path, default=None, help="a checkout of the code to compare with")
    ap.add_argument("--index-regenerate", action="store_true",
                    help="also index the regeneration shards, as a run whose regeneration stage ended leaves them")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-listing-"))
    metrics = free_port()
    s3 = S3Server(tmp / "s3", metrics_port=metrics).start()
    results = []
    try:
        s3.make_bucket("draftline-test")
        os.environ.update(s3.env())
        env = dict(os.environ, COLUMNS="200", HF_HUB_OFFLINE="1")
        env.pop("PREFECT_API_URL", None)
        for shards in a.shards:
            for kind in a.stores:
                uri = (f"s3://draftline-test/listing-{uuid.uuid4().hex[:8]}" if kind == "s3"
                       else f"file://{tmp}/store-{shards}")
                t0 = time.perf_counter()
                train = build(uri, shards, a.index_regenerate)
                res = {"shards": shards, "store": kind, "build_s": round(time.perf_counter() - t0, 1),
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
                for name, argv in commands(uri, train, shards).items():
                    res[name] = timed(argv, env, ROOT, metrics if kind == "s3" else None)
                    if a.baseline:
                        res[name + "_baseline"] = timed(argv, env, a.baseline, metrics if kind == "s3" else None)
                    print(shards, kind, name, json.dumps(res[name]), json.dumps(res.get(name + "_baseline")),
                          flush=True)
                results.append(res)
        print(json.dumps(results), flush=True)
        if a.out:
            a.out.write_text(json.dumps(results, indent=1))
    finally:
        s3.stop()


if __name__ == "__main__":
    main()
