"""Training throughput and accuracy: draftline's loop vs speculators' Trainer; store vs memory.

    .venv/bin/python benchmarks/bench_train.py                     # CPU, SmolLM2-135M-Instruct, file:// store
    .venv/bin/python benchmarks/bench_train.py --store s3          # parts streamed from a local SeaweedFS
    python3 benchmarks/bench_train.py --device cuda --target random --hidden 4096 --layers 4 --seq-len 2048 \
        --batch-tokens 8192 --draft-vocab 32000 --steps 20          # GPU: Llama-8B-wide random target

Data: the demo target (SmolLM2-135M-Instruct) answers --samples short questions
greedily; its hidden states (layers 2, 15, 27 + the last layer's pre-norm output)
are extracted with transformers hooks into parts on the store, exactly the
layout the extract stage writes. Both trainers get the same samples, draft
vocabulary, draft architecture (speculators' EAGLE-3 recipe, 1 layer, sdpa,
eager KL loss), optimizer (AdamW, no weight decay), warm-up + cosine schedule,
--batch-tokens packed tokens per step and --steps steps; both are evaluated on
the same held-out samples with the same function (per-position accuracy and the
simulated acceptance length, see tasks.formats.acceptance.simulated_acceptance_length).

Measured:
1. ours vs speculators' Trainer, tokens/s (median over steps after the first 2).
   speculators' Trainer is CUDA-only (it moves the model to device index 0 and
   calls torch.accelerator.synchronize); on CPU the benchmark patches exactly
   those two (device -> "cpu", synchronize -> no-op) and runs its loop unchanged,
   with its own data format (HF dataset + hs_{i}.safetensors), dataset, collate
   and multipack sampler (num_workers 0 on a 2-core machine: --their-workers).
   On a GPU nothing is patched (bf16 autocast both sides).
2. held-out accuracy per position and simulated acceptance length after the same steps.
3. ours streamed from the store (prefetch thread) vs the same loop on parts
   preloaded in memory: tokens/s ratio (goal >= 0.9). Runs alternate to share noise.
4. with --bare-steps N: the anchor, speculators' Eagle3DraftModel alone (forward, backward,
   AdamW) N times on one packed batch of ours already on the device (`run_bare_step`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "support"))

import torch  # noqa: E402

from tasks.core.config import RunConfig, TargetConfig  # noqa: E402
from tasks.store.artifacts import Store  # noqa: E402
from tasks.engine.target import load_tokenizer, resolve_model  # noqa: E402
from tasks.train.inputs import resolve_inputs  # noqa: E402
from tasks.train.checkpoints import checkpoint_digest  # noqa: E402
from tasks.train.dist import DistEnv  # noqa: E402
from tasks.train.evaluation import evaluate_model  # noqa: E402
from tasks.train.loop import build_trainer  # noqa: E402
from tasks.train.model import build_draft_model, flops_per_token, resolve_precision  # noqa: E402
from tasks.train.stream import BatchStream, PartReader  # noqa: E402
from train_data import generate_samples, write_extract, write_vocab  # noqa: E402

LAYER_IDS = [2, 15, 27, 30]
TOPICS = ["the moon", "bread", "rain", "cats", "the ocean", "music", "trees", "coffee", "winter", "bicycles",
          "volcanoes", "honey", "chess", "clouds", "trains", "gardens"]
TEMPLATES = ["Tell me about {}.", "Give me two facts about {}.", "Why do people like {}?"]


def questions(n: int) -> list[str]:
    out = [t.format(topic) for t in TEMPLATES for topic in TOPICS]
    return (out * (n // len(out) + 1))[:n]


def load_samples(target: str, n: int, new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """The target's greedy answers, cached (generation is the slow part on a CPU)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "draftline" / "bench"
    path = cache / f"train-samples-{n}-{new_tokens}.json"
    if path.is_file():
        return [tuple(s) for s in json.loads(path.read_text())]
    tok = load_tokenizer(TargetConfig(), target)
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]) for q in questions(n)]
    samples = generate_samples(target, n, new_tokens=new_tokens, prompts=prompts)
    cache.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(samples))
    return samples


def random_target(folder: Path, hidden: int, layers: int, vocab: int, device: str) -> str:
    """A random-init Llama of the given width (no generation needed: throughput runs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(3.5 * hidden),
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 128),
                      num_key_value_heads=max(1, hidden // 512), max_position_embeddings=8192,
                      tie_word_embeddings=True, rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(folder))
    return str(folder)


def random_samples(n: int, seq_len: int, vocab: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(seq_len // 2, seq_len + 1, (1,), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        prompt = length // 10
        out.append((ids, [0] * prompt + [1] * (length - prompt)))
    return out


def clear_checkpoints(store: Store, digest: str, steps: int) -> None:
    for m in store.list("checkpoint"):
        if m.inputs.get("train") == digest:
            store.delete("checkpoint", m.digest)
    assert store.find("checkpoint", checkpoint_digest(digest, steps)) is None


def memory_reader(preloaded: dict):
    """A part loader over {(digest, part name): PartData} (parts read from the store beforehand)."""
    def from_memory(spec):
        return dataclasses.replace(preloaded[(spec.digest, spec.name)], spec=spec)

    return from_memory


def run_ours(cfg: RunConfig, store: Store, inputs, preloaded: dict | None) -> dict:
    """One training run; preloaded = {(digest, part name): PartData} replaces the store reads."""
    load = memory_reader(preloaded) if preloaded is not None else None
    clear_checkpoints(store, inputs.digest, cfg.train.max_steps)
    free_memory()
    records: list[dict] = []
    trainer = build_trainer(cfg, store, inputs, DistEnv.from_env(cfg.train), records.append, load_part=load)
    t0 = time.perf_counter()
    state = trainer.fit()
    wall = time.perf_counter() - t0
    steps = [r for r in records if r["kind"] == "train"]
    timed = steps[2:] or steps
    out = {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "mean_tokens_per_s": sum(r["tokens"] for r in timed) / sum(r["step_s"] for r in timed),
        "data_wait_frac": sum(r["data_wait_s"] for r in timed) / sum(r["step_s"] for r in timed),
        "steps": state.step, "wall_s": round(wall, 1), "final_loss": steps[-1]["loss"],
    }
    out.update(trainer.evaluate())
    out["_eval"], out["_parts"] = trainer.held_out.batches, trainer.parts
    del trainer, state
    free_memory()
    return out


def run_bare_step(cfg: RunConfig, inputs, preloaded: dict, attn: str, steps: int, device: str) -> dict:
    """The anchor: speculators' Eagle3DraftModel alone, forward + backward + AdamW step, `steps` times on
    ONE packed batch of ours (the stream's first, `train.batch_tokens` positions) already on the device.
    No data loading, no DDP, no metric reductions, no gradient clipping, no checkpoints: what the model
    costs, which our loop and speculators' Trainer add their overheads to. The model is the one our
    Trainer builds (same config, verifier weights), with `attn` (sdpa / flex_attention) and
    `train.precision` (bf16 autocast on a GPU). tok/s is the median over the steps after the first 2
    (the first compiles)."""
    from speculators.losses import resolve_loss_config

    t = cfg.train
    free_memory()
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    model = build_draft_model(t, cfg.target, inputs.target_path, inputs.hf_config, inputs.layer_ids, inputs.d2t,
                              inputs.t2d, attn_impl=attn).to(dev)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=t.lr,
                                  weight_decay=t.weight_decay)
    stream = BatchStream(inputs.parts, memory_reader(preloaded), batch_tokens=t.batch_tokens, seed=t.seed, prefetch=0)
    batch = stream.next()
    stream.close()
    x = batch.model_inputs(dev)
    kwargs = {"ttt_steps": t.ttt_steps, "ttt_step_loss_decay": t.ttt_step_loss_decay,
              "loss_config": resolve_loss_config("kl_div", t.loss_impl)}
    precision = resolve_precision(t.precision, dev)
    cast = autocast(device) if precision == "bf16" else contextlib.nullcontext
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        with cast():
            _, loss, _ = model(**x, **kwargs)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    timed = times[2:] or times
    out = {"attn_impl": attn, "precision": precision, "tokens_per_step": batch.tokens, "documents":
           int(batch.document_ids.max()) + 1, "steps": steps, "first_step_s": round(times[0], 3),
           "median_step_s": round(statistics.median(timed), 4),
           "tokens_per_s": batch.tokens / statistics.median(timed), "flops_per_token": flops_per_token(model, t.ttt_steps),
           "final_loss": round(loss.item(), 6)}
    del model, optimizer, x
    free_memory()
    return out


def free_memory() -> None:
    import gc

    gc.collect()
    torch._dynamo.reset()  # each run compiles afresh: recompile limits must not carry over between runs
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def speculators_dataset(folder: Path, store: Store, inputs, held_ids: set[str]) -> tuple[int, int]:
    """Our parts rewritten in speculators' layout: a saved HF dataset (input_ids, loss_mask,
    seq_len, torch format) plus hidden_states/hs_{i}.safetensors ({hidden_states, token_ids}).
    Training rows first, held-out rows last (their val split)."""
    from datasets import Dataset
    from safetensors.torch import save_file

    from tasks.formats.parts import load_part

    rows: list[tuple[bool, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for spec in inputs.parts:
        with inputs.artifacts[spec.digest].local_copy(spec.name) as path:
            part = load_part(path)
        for i, sid in enumerate(part["sample_ids"]):
            a, b = int(part["offsets"][i]), int(part["offsets"][i + 1])
            rows.append((sid in held_ids, part["input_ids"][a:b].long(), part["loss_mask"][a:b].long(),
                         part["hidden_states"][a:b].clone()))
    rows.sort(key=lambda r: r[0])  # held-out last
    (folder / "hidden_states").mkdir(parents=True)
    for i, (_h, ids, _m, hs) in enumerate(rows):
        save_file({"hidden_states": hs, "token_ids": ids}, str(folder / "hidden_states" / f"hs_{i}.safetensors"))
    ds = Dataset.from_dict({"input_ids": [r[1].tolist() for r in rows], "loss_mask": [r[2].tolist() for r in rows],
                            "seq_len": [len(r[1]) for r in rows]})
    ds.set_format("torch")
    ds.save_to_disk(str(folder))
    n_train = sum(1 for r in rows if not r[0])
    return n_train, len(rows)


def speculators_on_cpu() -> None:
    """The two CUDA-only spots of speculators' Trainer, patched for a CPU: model.to(local rank) and
    torch.accelerator.synchronize."""
    import speculators.train.trainer as sp_trainer

    sp_trainer.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda *a, **k: None


def run_speculators(cfg: RunConfig, store: Store, inputs, held_ids: set[str], eval_batches, workers: int,
                    device: str, attn: str | None = None, *, bf16_cpu: bool = False,
                    after_step: Callable[[Any, Any], bool] | None = None, keep_model: bool = False) -> dict:
    """speculators' Trainer on our data and config; `attn` (sdpa / flex_attention) overrides
    `train.attn_impl`, whose auto means flex_attention on a GPU and sdpa on a CPU here.

    bf16_cpu: on a CPU, their Trainer's own autocast (`hidden_states_dtype`, on `device_type`) in bf16,
    as ours trains with `train.precision: auto` on a bf16 CPU (a third patch: `device_type` "cpu").
    after_step(trainer, model) runs after every step; True stops training there (a budget).
    keep_model: the trained model is returned as out["_model"] (for export)."""
    import speculators.train.trainer as sp_trainer
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.dataloader import create_train_val_loaders

    t = cfg.train
    target = inputs.target_path
    with tempfile.TemporaryDirectory(prefix="bench-speculators-") as tmp:
        data = Path(tmp) / "data"
        n_train, n_all = speculators_dataset(data, store, inputs, held_ids)
        # their recommended EAGLE-3 draft (speculators train defaults), sdpa + eager loss for CPU
        layer_cfg = create_transformer_layer_config(verifier_name_or_path=target, num_layers=t.num_layers,
                                                    draft_arch="llama", hidden_act="silu", sliding_window=2048,
                                                    full_attention_indices=[])
        attn = attn or (t.attn_impl if t.attn_impl != "auto" else "flex_attention" if device == "cuda" else "sdpa")
        attn = "simple_flex_attention" if attn == "flex_attention" else attn
        hs_dtype = torch.bfloat16 if device == "cuda" or bf16_cpu else torch.float32  # CPU: fp32 math, as ours
        torch.manual_seed(t.seed)
        model = Eagle3DraftModel.from_training_args(
            verifier_config=layer_cfg, t2d=inputs.t2d, d2t=inputs.d2t, verifier_name_or_path=target,
            draft_vocab_size=int(inputs.d2t.shape[0]), norm_before_residual=True, norm_before_fc=True,
            norm_output=True, ttt_steps=t.ttt_steps, target_layer_ids=inputs.layer_ids[:-1], draft_attn_impl=attn)
        train_loader, val_loader = create_train_val_loaders(
            data_path=str(data), total_seq_len=t.batch_tokens, hidden_states_dtype=hs_dtype, transfer=None,
            vllm_endpoint="http://127.0.0.1:9/v1", on_missing="raise", verifier_name_or_path=target,
            request_timeout=1.0, max_retries=0, generation_validation_retries=0,
            max_consecutive_generation_failures=1, hidden_size=inputs.hidden_size, num_target_layers=3,
            num_workers=workers, prefetch_factor=2, preprocess=shift_batch,
            train_data_ratio=(n_train + 0.5) / n_all, seed=t.seed)
        kwargs = {"ttt_steps": t.ttt_steps, "ttt_step_loss_decay": t.ttt_step_loss_decay,
                  "loss_config": resolve_loss_config("kl_div", "eager")}
        config = sp_trainer.TrainerConfig(
            lr=t.lr, num_epochs=10**6, save_path=str(Path(tmp) / "ckpt"), train_call_kwargs=kwargs,
            val_call_kwargs=kwargs, optimizer="adamw", weight_decay=t.weight_decay, scheduler_type="cosine",
            scheduler_warmup_steps=t.warmup_steps, scheduler_total_steps=t.max_steps,
            hidden_states_dtype=hs_dtype, max_steps=t.max_steps)
        if device == "cpu":
            speculators_on_cpu()
        trainer = sp_trainer.Trainer(model, config, train_loader, val_loader)
        if device == "cpu" and bf16_cpu:
            trainer.device_type = "cpu"  # their autocast(device_type, hidden_states_dtype) on a CPU

        tokens: list[int] = []
        stamps: list[float] = []
        model.register_forward_pre_hook(lambda _m, _a, kw: tokens.append(int((kw["document_ids"] != -1).sum())),
                                        with_kwargs=True)
        epoch = 0
        t0 = time.perf_counter()
        stamps.append(t0)
        stopped = []

        def step_done() -> None:
            stamps.append(time.perf_counter())
            if after_step is not None and after_step(trainer, model):
                stopped.append(trainer.global_step)
                raise _Stop

        with contextlib.suppress(_Stop):
            while trainer.global_step < t.max_steps:
                trainer.train_epoch(epoch, step_callback=step_done)
                epoch += 1
        wall = time.perf_counter() - t0
    step_s = [b - a for a, b in zip(stamps, stamps[1:])]
    per_step = [n / s for n, s in zip(tokens, step_s)]
    timed = slice(2, None) if len(per_step) > 2 else slice(None)
    out = {"attn_impl": attn, "tokens_per_s": statistics.median(per_step[timed]),
           "mean_tokens_per_s": sum(tokens[timed]) / sum(step_s[timed]), "steps": trainer.global_step,
           "wall_s": round(wall, 1), "tokens_per_step": statistics.mean(tokens), "epochs": epoch,
           "stopped_by_hook": bool(stopped)}
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    cast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if device == "cpu" and bf16_cpu else autocast(device)
    out.update(evaluate_model(model, eval_batches, dev, kwargs, cast))
    if keep_model:
        out["_model"] = model
    return out


class _Stop(Exception):
    """Raised from the step callback to end speculators' epoch loop (run_speculators' after_step)."""


def autocast(device: str):
    if device == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--part-samples", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="alternating streamed/in-memory runs of ours")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy 2-core box)")
    ap.add_argument("--their-workers", type=int, default=0)
    ap.add_argument("--store", choices=["file", "s3"], default="file")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--target", choices=["smollm2", "random"], default="smollm2")
    ap.add_argument("--hidden", type=int, default=4096, help="random target width")
    ap.add_argument("--layers", type=int, default=4, help="random target depth")
    ap.add_argument("--vocab", type=int, default=128256, help="random target vocabulary")
    ap.add_argument("--seq-len", type=int, default=2048, help="random samples: lengths in [seq_len/2, seq_len]")
    ap.add_argument("--attn-impl", choices=["sdpa", "flex_attention"], default="sdpa")
    ap.add_argument("--skip-speculators", action="store_true")
    ap.add_argument("--bare-steps", type=int, default=0,
                    help="also time speculators' bare Eagle3DraftModel step on one packed batch this many times "
                         "(the anchor: no data loading, no DDP, no clipping)")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default=None,
                    help="ours: bf16 autocast or float32 (default: what speculators' Trainer does on that device: "
                         "fp32 on CPU, bf16 on CUDA), so the comparison is like for like")
    ap.add_argument("--also-precision", choices=["bf16", "fp32"], default=None,
                    help="also train ours (streamed) at this precision, --rounds times, alternating with the others")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    torch.set_num_threads(args.threads)

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-train-")))
        t0 = time.perf_counter()
        if args.target == "smollm2":
            target, vocab, layer_ids = resolve_model(TargetConfig()), 49152, LAYER_IDS
            samples = load_samples(target, args.samples, args.new_tokens)
        else:
            target = random_target(tmp / "target", args.hidden, args.layers, args.vocab, args.device)
            vocab, layer_ids = args.vocab, list(range(1, args.layers + 1))
            samples = random_samples(args.samples, args.seq_len, vocab)
        print(f"data: {len(samples)} samples, {sum(len(s[0]) for s in samples)} tokens "
              f"({time.perf_counter() - t0:.0f}s)", flush=True)
        if args.store == "s3":
            from s3server import S3Server

            server = S3Server(tmp / "seaweedfs").start()
            stack.callback(server.stop)
            os.environ.update(server.env())
            server.make_bucket("bench")
            from tasks.core.config import StoreConfig

            store = Store.from_config(StoreConfig(uri="s3://bench/train"))
        else:
            store = Store(f"file://{tmp}/store")
        t0 = time.perf_counter()
        refs = write_extract(store, target, samples, layer_ids, shards=2, part_samples=args.part_samples,
                             tag="bench", device=args.device,
                             dtype=torch.bfloat16 if args.device == "cuda" else torch.float32)
        vref = write_vocab(store, samples, vocab, args.draft_vocab, tag="bench")
        print(f"extracted in {time.perf_counter() - t0:.0f}s", flush=True)
        cfg = RunConfig.model_validate({
            "target": {"model": target}, "extract": {"layer_ids": layer_ids},
            "train": {"max_steps": args.steps, "batch_tokens": args.batch_tokens, "warmup_steps": 2, "lr": 1e-3,
                      "min_lr_ratio": 0.0, "weight_decay": 0.0, "checkpoint_every": 10**6, "eval_batches": 2,
                      "prefetch": 2, "device": args.device, "attn_impl": args.attn_impl,
                      "precision": args.precision}})
        inputs = resolve_inputs(cfg, store, vref, refs)
        reader = PartReader(inputs.artifacts, inputs.layer_ids, inputs.hidden_size)
        preloaded = {(p.digest, p.name): reader(p) for p in inputs.parts}
        n_bytes = sum(p.hidden.numel() * 2 for p in preloaded.values())
        print(f"store: {store.uri}, {len(inputs.parts)} parts, {n_bytes / 1e6:.0f} MB of hidden states", flush=True)

        results: dict = {"config": {**vars(args), "layer_ids": layer_ids, "torch": torch.__version__,
                                    "cpus": os.cpu_count(),
                                    "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}}
        def save() -> None:
            if args.out:
                Path(args.out).write_text(json.dumps(results, indent=2, default=str))

        streamed, in_memory, other = [], [], []
        results["ours_streamed"] = streamed
        results["ours_in_memory"] = in_memory
        modes = [("streamed", streamed, cfg), ("in-memory", in_memory, cfg)]
        if args.also_precision and args.also_precision != args.precision:
            results[f"ours_streamed_{args.also_precision}"] = other
            alt = cfg.model_copy(update={"train": cfg.train.model_copy(update={"precision": args.also_precision})})
            modes.append((f"streamed {args.also_precision}", other, alt))
        for r in range(args.rounds):
            for mode, sink, run_cfg in modes:
                res = run_ours(run_cfg, store, inputs, preloaded if mode == "in-memory" else None)
                eval_set, parts = res.pop("_eval"), res.pop("_parts")
                sink.append(res)
                save()
                print(f"ours {mode} round {r}: {res['tokens_per_s']:.0f} tok/s median, "
                      f"{res['mean_tokens_per_s']:.0f} mean, data wait {res['data_wait_frac']:.1%}, "
                      f"acc {res.get('val_acc_per_pos')}", flush=True)
        held = parts[-1]
        last = preloaded[(held.digest, held.name)]
        meta_ids = reader.artifacts[held.digest]
        with meta_ids.local_copy(held.name) as path:
            from tasks.formats.parts import load_part

            sample_ids = load_part(path)["sample_ids"]
        held_ids = set(sample_ids[last.num_samples - held.holdout:])

        def med(rs, key):
            return statistics.median(x[key] for x in rs)

        if other:
            results[f"{args.also_precision}_over_{args.precision}"] = round(
                med(other, "tokens_per_s") / med(streamed, "tokens_per_s"), 3)
        results["streamed_over_in_memory"] = round(med(streamed, "tokens_per_s") / med(in_memory, "tokens_per_s"), 3)
        results["streamed_over_in_memory_mean"] = round(
            med(streamed, "mean_tokens_per_s") / med(in_memory, "mean_tokens_per_s"), 3)
        save()
        if args.bare_steps:
            bare = run_bare_step(cfg, inputs, preloaded, args.attn_impl, args.bare_steps, args.device)
            results["bare_model"] = bare
            results["ours_over_bare"] = round(med(streamed, "tokens_per_s") / bare["tokens_per_s"], 3)
            print(f"speculators' bare Eagle3DraftModel step ({args.attn_impl}): {bare['tokens_per_s']:.0f} tok/s; "
                  f"ours / bare {results['ours_over_bare']}", flush=True)
            save()
        del preloaded
        free_memory()
        if not args.skip_speculators:
            try:
                theirs = run_speculators(cfg, store, inputs, held_ids, eval_set, args.their_workers, args.device)
            except Exception as exc:  # report the baseline's failure instead of losing our numbers
                print(f"speculators Trainer failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                results["speculators"] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            else:
                print(f"speculators Trainer: {theirs['tokens_per_s']:.0f} tok/s median, "
                      f"{theirs['mean_tokens_per_s']:.0f} mean, acc {theirs.get('val_acc_per_pos')}", flush=True)
                results["speculators"] = theirs
                results["ours_over_speculators"] = round(med(streamed, "tokens_per_s") / theirs["tokens_per_s"], 3)
                results["ours_over_speculators_mean"] = round(
                    med(streamed, "mean_tokens_per_s") / theirs["mean_tokens_per_s"], 3)
            save()

    print("\n| run | tokens/s median | tokens/s mean | held-out acc per position | sim. acceptance length |")
    print("|---|---|---|---|---|")
    rows = [("ours, streamed from store", streamed[0], med(streamed, "tokens_per_s"), med(streamed, "mean_tokens_per_s")),
            ("ours, in memory", in_memory[0], med(in_memory, "tokens_per_s"), med(in_memory, "mean_tokens_per_s"))]
    if other:
        rows.append((f"ours, streamed, {args.also_precision}", other[0], med(other, "tokens_per_s"),
                     med(other, "mean_tokens_per_s")))
    theirs = results.get("speculators", {})
    if "tokens_per_s" in theirs:
        rows.append((f"speculators Trainer ({'CPU-patched' if args.device == 'cpu' else 'unpatched'})", theirs,
                     theirs["tokens_per_s"], theirs["mean_tokens_per_s"]))
    bare = results.get("bare_model")
    if bare:
        rows.append((f"speculators' bare Eagle3DraftModel step ({bare['attn_impl']}, one batch)", {},
                     bare["tokens_per_s"], bare["tokens_per_s"]))
    for name, r, tps, mean in rows:
        print(f"| {name} | {tps:.0f} | {mean:.0f} | {r.get('val_acc_per_pos')} | {r.get('simulated_acceptance_length')} |")
    if other:
        print(f"\n{args.also_precision} / {args.precision} (ours, streamed): "
              f"{results[f'{args.also_precision}_over_{args.precision}']} (median)")
    print(f"\nstreamed / in-memory: {results['streamed_over_in_memory']} (median), "
          f"{results['streamed_over_in_memory_mean']} (mean)")
    if "ours_over_bare" in results:
        print(f"ours / speculators' bare model step: {results['ours_over_bare']} (median)")
    if "ours_over_speculators" in results:
        print(f"ours / speculators: {results['ours_over_speculators']} (median), "
              f"{results['ours_over_speculators_mean']} (mean)")


if __name__ == "__main__":
    main()
