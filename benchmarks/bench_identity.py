"""Greedy identity in vLLM's CPU build: the baseline against itself across batch shapes, and EAGLE-3 against it.

    .venv/bin/python benchmarks/bench_identity.py [--k 0,3] [--prompts 8] [--max-tokens 64]
        [--batch-sizes 1,2,4,8] [--dtype bfloat16] [--json out.json]

benchmarks/RESULTS.md lists the exact commands behind its figures (issue 20: "outputs differ from the
baseline at temperature 0 (batch 1: 7 of 8 (first at token 5))" in the demo's report).

The offline SmolLM2-135M-Instruct preset at temperature 0 on `--prompts` MT-Bench first turns (spread
over the categories, as the benchmark stage picks them) and `--prompts` chitchat first turns (held out of
the demo's 512), rendered with the chat template. One engine per entry of `--k` (0 = no draft; k > 0 =
EAGLE-3 with k speculative tokens and an UNTRAINED draft head: the verifier still scores k+1 tokens per
step, which is what changes the kernels' shapes; acceptance is beside the point here). Each engine
decodes every prompt set at every batch size in `--batch-sizes`, then once more at the first and the
last (the repeat: run-to-run noise). Printed, per engine and prompt set: for every decode, the requests
whose outputs differ from the baseline's decode at the largest batch size and the first differing token.
Engine settings are the benchmark stage's (`tasks.engine.settings.benchmark_kwargs`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]


def first_differences(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    from tasks.benchmark.identity import identical

    return identical(a, b)[1]


def prompt_sets(cfg, n: int) -> dict[str, list[list[int]]]:
    from tasks.benchmark.prompts import first_turn, load_eval_prompts
    from tasks.core.config import EvalConfig, SourceConfig
    from tasks.data.sources import load_source
    from tasks.data.prepare import make_masker

    masker = make_masker(cfg)
    mt = load_eval_prompts(cfg, None, None, EvalConfig(name="mtbench", source=SourceConfig(preset="mtbench"),
                                                       num_prompts=n), masker.prompt_ids).prompts
    chit = load_source(SourceConfig(preset="chitchat"), keep_thinking=False, require_assistant=False,
                       system_prompt=cfg.data.system_prompt, seen=None).conversations
    # the demo takes 512 of 7,168 conversations: the last ones are far from them
    ch = [masker.prompt_ids(first_turn(c.messages)) for c in chit[-n:]]
    return {"mtbench": mt, "chitchat": ch}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", default="0,3", help="engines: 0 = no draft, k = EAGLE-3 with k tokens (untrained head)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    from tasks.benchmark.stage import default_engine_factory
    from tasks.core.config import RunConfig
    from tasks.engine.settings import benchmark_kwargs
    from tasks.engine.target import resolve_model
    from tests.unit.benchmark.test_benchmark import make_random_draft

    cfg = RunConfig()
    cfg.target.max_model_len = 2048
    cfg.target.dtype = args.dtype
    model = resolve_model(cfg.target)
    sets = prompt_sets(cfg, args.prompts)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    sampling = {"max_tokens": args.max_tokens, "temperature": 0.0, "seed": cfg.data.seed}
    runs = [(f"batch {bs}", bs) for bs in sizes] + [(f"batch {sizes[0]} again", sizes[0]),
                                                    (f"batch {sizes[-1]} again", sizes[-1])]
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-identity-") as tmp:
        for k in (int(x) for x in args.k.split(",")):
            spec = None
            if k:
                draft = Path(tmp, "draft")
                if not draft.exists():
                    make_random_draft(model, draft)
                spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": k}
            name = "baseline" if not k else f"eagle3 k={k}"
            kw = benchmark_kwargs(cfg, spec, model)
            engine = default_engine_factory(cfg, model)(name, kw)
            engine.start()
            try:
                engine.generate([sets["mtbench"][0]], {"max_tokens": 8, "temperature": 0.0})
                out[name] = {"dtype": kw["dtype"]}
                for set_name, prompts in sets.items():
                    decodes = {}
                    for label, bs in runs:
                        t0 = time.time()
                        got: list[list[int]] = []
                        for i in range(0, len(prompts), bs):
                            got += [o["token_ids"] for o in engine.generate(prompts[i:i + bs], sampling)]
                        decodes[label] = {"outputs": got, "seconds": round(time.time() - t0, 2)}
                    out[name][set_name] = decodes
            finally:
                engine.close()
    ref_label = f"batch {sizes[-1]}"
    base = out.get("baseline")
    for name, res in out.items():
        print(f"\n{name} ({res['dtype']}): requests that differ from the {'baseline' if base else name}'s "
              f"{ref_label} decode (first differing token)")
        for set_name in sets:
            ref = (base or res)[set_name][ref_label]["outputs"]
            for label, d in res[set_name].items():
                diffs = first_differences(d["outputs"], ref)
                hits = [(i, f) for i, f in enumerate(diffs) if f is not None]
                what = ", ".join(f"#{i}@{f}" for i, f in hits) or "none"
                print(f"  {set_name:9s} {label:15s} {len(hits)} of {len(diffs)} differ: {what}  ({d['seconds']} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
