"""`draftline ls`, `check` and `plan --from-store` on a store the size of the Kimi preset's (issue 43, item 4).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_store_listing.py [--shards 1024] [--out FILE]

The store is built on a real SeaweedFS through the store's own writer (Store.writer, one tiny file per
artifact, the manifests what a run commits, stats included), 16 commits at a time: the prepare artifact of
benchmarks/rehearsal.yaml with regeneration on (the preset's 512 shards, at their addresses; the preset's
own addresses need Kimi-K2.5's snapshot on this machine), its 512 regeneration shards at their addresses
(as a run killed before the regenerate artifact leaves them), SHARDS extraction shards with their
self-check figures, and a train artifact naming every extraction shard. Then each command runs as a user
runs it (a fresh process, so the import time is in the figure; `draftline --help` is timed beside it as
that floor), three times, and the median is kept; with --baseline DIR (a checkout of the code before a
change, e.g. `git archive BASE | tar -x -C DIR`) each command also runs from that code, side by side.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

from s3server import S3Server  # noqa: E402

# The preset's shape with a target this machine holds (the preset's own address needs Kimi-K2.5's snapshot)
CONFIG = ROOT / "benchmarks" / "rehearsal.yaml"
SETS = ["regenerate.enabled=true", "data.num_shards=512", "data.max_samples=600000"]
DATA = Path(tempfile.gettempdir()) / "bench-listing-conversations.jsonl"  # the config's source (its content is addressed)


def sets() -> list[str]:
    """The overrides every command gets: the preset's shape and the generated source."""
    if not DATA.exists():
        from rehearse import conversations
        conversations(DATA, 64)
    return [*SETS, f"data.sources=[{{path: {DATA}, name: rehearsal}}]"]


def hexd(*parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def build(uri: str, shards: int) -> str:
    """The store; returns the train digest."""
    from tasks.address import digests
    from tasks.core.config import StoreConfig, load_config
    from tasks.store.artifacts import ArtifactRef, Store

    cfg = load_config(CONFIG, [*sets(), f"store.uri={uri}"])
    store = Store.from_config(StoreConfig(uri=uri))

    def commit(stage: str, digest: str, stats: dict, inputs: dict | None = None,
               files: dict[str, bytes] | None = None) -> ArtifactRef:
        w = store.writer(stage, digest, "rehearsal", inputs or {})
        for name, data in (files or {"part.bin": b"x" * 64}).items():
            w.write_bytes(name, data)
        return w.commit(stats).ref()

    prep = commit("prepare", digests.prepare(cfg), {"samples": 600000, "tokens": 900_000_000,
                                                     "masked_tokens": 500_000_000, "num_shards": 512})
    reg = digests.regenerate(cfg, prep)
    per = 600000 // 512
    ext = [hexd("extract", i) for i in range(shards)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: commit(digests.REGENERATE_SHARD, digests.regenerate_shard(reg, i), {
            "shard": i, "samples": per, "tokens": per * 3000, "generated_tokens": per * 2400}), range(512)))
        list(pool.map(lambda i: commit("extract", ext[i], {
            "shard": i, "samples": per, "tokens": per * 3000, "seconds": 60.0,
            "verified": {"positions": 256, "agree": 254, "rate": 0.992}}, {"data": prep.digest}), range(shards)))
    train = hexd("train", shards)
    import torch
    from safetensors.torch import save

    # a draft folder with one tensor (no d2t/t2d: the maps check has nothing to compare), the vocab not stored
    commit("train", train, {"steps": 60000, "stopped_reason": "max_steps"},
           {"extract": ",".join(ext), "vocab": hexd("vocab")},
           files={"draft/model.safetensors": save({"w": torch.zeros(4)}), "draft/config.json": b"{}"})
    return train


def timed(argv: list[str], env: dict[str, str], code: Path, repeat: int = 3) -> dict:
    runs, out = [], None
    env = dict(env, PYTHONPATH=str(code))
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = subprocess.run([str(Path(sys.executable).parent / "draftline"), *argv], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=900)
        runs.append(time.perf_counter() - t0)
    return {"s": round(statistics.median(runs), 2), "runs": [round(r, 2) for r in runs], "rc": out.returncode,
            "out_chars": len(out.stdout), "err_tail": out.stderr[-300:] if out.returncode not in (0, 1) else ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--baseline", type=Path, default=None, help="a checkout of the code to compare with")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-listing-"))
    s3 = S3Server(tmp / "s3").start()
    try:
        s3.make_bucket("draftline-test")
        os.environ.update(s3.env())
        uri = f"s3://draftline-test/listing-{uuid.uuid4().hex[:8]}"
        t0 = time.perf_counter()
        train = build(uri, a.shards)
        res = {"shards": a.shards, "regenerate_shards": 512, "build_s": round(time.perf_counter() - t0, 1),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        env = dict(os.environ, COLUMNS="200", HF_HUB_OFFLINE="1")
        env.pop("PREFECT_API_URL", None)
        cmds = {"help": ["--help"], "ls": ["ls", "--store", uri, "--json"],
                "ls_extract": ["ls", "--store", uri, "--stage", "extract"],
                "check": ["check", train, "--store", uri, "--json"],
                "plan_from_store": ["plan", str(CONFIG), "--from-store", *(x for v in sets() for x in ("--set", v)),
                                    "--set", f"store.uri={uri}", "--json"]}
        for name, argv in cmds.items():
            res[name] = timed(argv, env, ROOT)
            if a.baseline:
                res[name + "_baseline"] = timed(argv, env, a.baseline)
            print(name, res[name], res.get(name + "_baseline"), flush=True)
        print(json.dumps(res), flush=True)
        if a.out:
            a.out.write_text(json.dumps(res, indent=1))
    finally:
        s3.stop()


if __name__ == "__main__":
    main()
