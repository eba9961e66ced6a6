"""The extraction check (tasks/extract/verify.py) on the demo's target: how often correct stored states reproduce
the engine's next token, how often planted faults do, and what the check costs.

    .venv/bin/python benchmarks/bench_verify.py [--backend transformers|vllm] [--dtype float32|bfloat16]
        [--samples 128] [--max-tokens 512] [--storage bf16|fp8] [--cost-rounds N] [--no-planted]

The offline SmolLM2-135M-Instruct preset (30 layers) over `--samples` chitchat conversations (the demo's source,
rendered with the chat template; the last ones of the set, away from the demo's 512), each cut to --max-tokens.
1. The extract stage runs the samples as one shard (--storage), every sample checked
   (extract.verify_positions = --samples, threshold 0): tokens/s, the check's share of the shard's time (its
   own clock, in the manifest), top-1 agreement and mean logit gap.
2. The same samples once more through `engine.extract` with layer ids [2, 15, 29, 30]: the target's norm and
   lm_head (`VerifierHead`) over the correct last layer as bf16 and as fp8 would store it, and over planted
   faults, against the engine's next tokens: layer 29 (a layer id shifted by one), layer 15 (a wrapper's
   offset), the states after the final norm (the norm applied twice), the values saturated at a tenth of each
   token's largest magnitude (a cut), scaled x8.
3. With --cost-rounds N, the check's cost in one run: N rounds on the same engine, each extracting the same shard
   twice into fresh stores (the address leaves the check's keys out), after one unmeasured round, once with the
   default check
   (extract.verify_positions 64) and once with it off (verify_positions 0), in an order rotated from round to round:
   tokens/s of each (wall clock around extract_shard: reading, extracting, writing, committing) and their ratio.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="transformers", choices=["transformers", "vllm"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--storage", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--cost-rounds", type=int, default=0)
    ap.add_argument("--no-planted", action="store_true", help="skip parts 1 and 2 (only --cost-rounds)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from tasks.core.config import RunConfig, SourceConfig
    from tasks.core.digest import VERSIONS, stage_digest
    from tasks.data.chat import make_masker
    from tasks.data.sources import load_source
    from tasks.engine.settings import engine_for_group
    from tasks.engine.target import VerifierHead, load_hf_config, resolve_model
    from tasks.extract.stage import extract_shard, plan_extract
    from tasks.formats.parts import quantize_fp8, dequantize_fp8
    from tasks.store.artifacts import Store

    cfg = RunConfig.model_validate({"target": {"max_model_len": 2048, "dtype": args.dtype}, "extract": {
        "backend": args.backend, "layer_ids": [2, 15, 29, 30], "batch_tokens": 4096}})
    model = resolve_model(cfg.target)
    masker = make_masker(cfg)
    convs = load_source(SourceConfig(preset="chitchat"), keep_thinking=False, require_assistant=True,
                        system_prompt=cfg.data.system_prompt, seen=None).conversations[-args.samples:]
    rows = []
    for c in convs:
        ids, mask = masker.encode(c.messages)
        rows.append((c.sample_id, ids[:args.max_tokens], mask[:args.max_tokens]))
    tokens = sum(len(r[1]) for r in rows)
    hf = load_hf_config(cfg.target, model)
    n = int(hf.num_hidden_layers)

    def data_artifact(store: Store):
        table = pa.table({"sample_id": [r[0] for r in rows], "source": ["chitchat"] * len(rows),
                          "messages": ["[]"] * len(rows),
                          "input_ids": pa.array([r[1] for r in rows], pa.list_(pa.int32())),
                          "loss_mask": pa.array([r[2] for r in rows], pa.list_(pa.int8()))})
        buf = io.BytesIO()
        pq.write_table(table, buf)
        with store.write("prepare", stage_digest("prepare", {"bench": "verify"}), VERSIONS["prepare"]) as w:
            w.write_bytes("shard-00000.parquet", buf.getvalue())
            return w.commit({"num_shards": 1, "samples": len(rows), "tokens": tokens}).ref()

    with tempfile.TemporaryDirectory(prefix="bench-verify-") as tmp:
        engine = engine_for_group(cfg, model, [])
        engine.start(timeout_s=900)
        try:
            engine.extract([rows[0][1]], cfg.extract.layer_ids)  # warm
            print(f"target {cfg.target.model} ({n} layers), engine {args.backend} {args.dtype}, {len(rows)} samples, "
                  f"{tokens:,} tokens")
            if args.cost_rounds:
                cost(cfg, engine, data_artifact, hf, args, Path(tmp))
            if args.no_planted:
                return 0
            c = cfg.model_copy(deep=True)
            c.extract.storage_dtype, c.extract.verify_positions = args.storage, args.samples
            c.extract.verify_min_agreement = 0.0
            store = Store(f"file://{tmp}/store")
            plan = plan_extract(c, data_artifact(store), hf)[0]
            ref = extract_shard(c, store, plan, engine)
            st, v = ref.stats, ref.stats["verify"]
            print(f"  stage, {args.storage} storage: {st['tokens_per_s']:,.0f} tok/s ({st['seconds']:.1f} s), of which "
                  f"the check {v['seconds']:.2f} s ({v['seconds'] / st['seconds']:.1%}); top-1 agreement "
                  f"{v['top1_agreement']:.4f} on {v['positions']} positions, mean logit gap {v['mean_logit_gap']:.4f}")

            head = VerifierHead(model, hf)
            hidden = []
            want = []
            for i in range(0, len(rows), 16):
                chunk = [r[1] for r in rows[i:i + 16]]
                hs = engine.extract(chunk, cfg.extract.layer_ids)
                want += list(engine.last_next_tokens)
                hidden += [h[-1].float().clone() for h in hs]  # [L, H] at each sample's last position
        finally:
            engine.close()
    last = torch.stack(hidden)  # [S, L, H]
    want_t = torch.tensor(want)

    def agree(h):
        return float((head.logits(h).argmax(-1) == want_t).float().mean())

    x = last[:, -1]
    fp8 = dequantize_fp8(*quantize_fp8(x[:, None]))[:, 0]
    cut = torch.maximum(torch.minimum(x, 0.1 * x.abs().amax(-1, keepdim=True)), -0.1 * x.abs().amax(-1, keepdim=True))
    planted = {"correct (bf16 as stored)": x.to(torch.bfloat16), "correct, fp8 as stored": fp8,
               "layer 29 (id shifted by one)": last[:, 2], "layer 15 (a wrapper's offset)": last[:, 1],
               "after the final norm (norm twice)": head.norm(x).detach(), "saturated at 0.1 x max": cut,
               "scaled x8": 8 * x}
    print(f"  planted, {len(want)} last positions:")
    for name, h in planted.items():
        print(f"    {name}: top-1 agreement {agree(h):.4f}")
    return 0


def cost(cfg, engine, data_artifact, hf, args, tmp: Path) -> None:
    """Part 3: the same shard extracted with the default check and without it, rounds rotated."""
    import statistics
    import time

    from tasks.core.config import ExtractConfig
    from tasks.extract.stage import extract_shard, plan_extract
    from tasks.store.artifacts import Store

    rates: dict[str, list[float]] = {"checked": [], "unchecked": []}
    check_s: list[float] = []
    for r in range(-1, args.cost_rounds):  # round -1 warms the engine and the check's lm_head up, not counted
        order = ["checked", "unchecked"] if r % 2 == 0 else ["unchecked", "checked"]
        for mode in order:
            c = cfg.model_copy(deep=True)
            c.extract.storage_dtype = args.storage
            c.extract.verify_positions = ExtractConfig().verify_positions if mode == "checked" else 0
            store = Store(f"file://{tmp}/cost-{r}-{mode}")
            plan = plan_extract(c, data_artifact(store), hf)[0]
            t0 = time.perf_counter()
            ref = extract_shard(c, store, plan, engine)
            wall = time.perf_counter() - t0
            if r < 0:
                print(f"  warm-up: {mode} {ref.stats['tokens'] / wall:,.0f} tok/s ({wall:.1f} s)")
                continue
            rates[mode].append(ref.stats["tokens"] / wall)
            if mode == "checked":
                check_s.append(float(ref.stats["verify"]["seconds"]))
            print(f"  round {r}: {mode:9s} {rates[mode][-1]:,.0f} tok/s ({wall:.1f} s)"
                  + (f", the check {check_s[-1]:.2f} s on {ref.stats['verify']['positions']} positions"
                     if mode == "checked" else ""))
    med = {m: statistics.median(v) for m, v in rates.items()}
    print(f"  cost: median checked {med['checked']:,.0f} tok/s, unchecked {med['unchecked']:,.0f} tok/s, "
          f"checked / unchecked = {med['checked'] / med['unchecked']:.3f}; per round "
          + ", ".join(f"{a / b:.3f}" for a, b in zip(rates["checked"], rates["unchecked"])))


if __name__ == "__main__":
    raise SystemExit(main())
