"""Acceptance at an equal training budget: our train stage vs speculators' Trainer, measured in vLLM.

    .venv/bin/python benchmarks/bench_equal_budget.py                       # ours vs theirs, 10 CPU-min each, k 1-3
    .venv/bin/python benchmarks/bench_equal_budget.py --name curve --sides ours --budget-cpu-min 24 \\
        --exports 3,6,10,16,24 --ks 3                                      # MT-Bench acceptance against training time
    .venv/bin/python benchmarks/bench_equal_budget.py --name lr3e-3 --sides ours --set train.lr=3e-3 --ks 3
    .venv/bin/python benchmarks/bench_equal_budget.py --name X --measure-only   # measure drafts/ of an earlier run
    python3 benchmarks/bench_equal_budget.py --device cuda --name h200 --work /tmp/eq --steps 400 \\
        --set extract.backend=transformers                                 # a GPU without vLLM/Prefect: same steps
    .venv/bin/python benchmarks/bench_equal_budget.py --name h200 --measure-only  # then here, on the drafts brought back
    .venv/bin/python benchmarks/bench_equal_budget.py --config benchmarks/lk_equal_budget.yaml --work out/eqb \
        --set 'train.heads=[{kind: dflash, block_size: 4}]' --set train.precision=fp32 --name dflash-cpu \
        --steps 8 --ks 3 --mtbench 4 --heldout 4 --batch 4 --max-tokens 32     # a block head, ours vs theirs, on CPU

Block heads (DFlash, DSpark; issue 46, item 1): with a dflash or dspark head in train.heads (or --by-steps), both
sides train --steps steps on --device from the stored states of `draftline run --until extract` (the data path
below), ours through our Trainer, theirs through speculators 0.9's own `speculators train` CLI
(theirs_by_cli: their model construction, data loader, loss and Trainer, timed per step by
benchmarks/speculators_train.py; on a CPU with their sdpa attention, eager loss and fp32), then both are measured
in vLLM here with the draft's own method (dflash, dspark) at --ks. On the lent GPU, after `bash
benchmarks/gpu_vllm.sh chunk ... install pipeline` has filled /tmp/gv/store, one call per head:
    GV_KIND=dflash bash benchmarks/gpu_vllm.sh reference       # then GV_KIND=dspark
which runs, on the pipeline's stored states (block 8 is z-lab's; k 7 = block 8 less the anchor, what vLLM serves):
    python3 benchmarks/bench_equal_budget.py --config benchmarks/gpu_vllm_demo.yaml --device cuda --by-steps \
        --work /tmp/gv --name dflash-reference --steps 400 --set 'train.heads=[{kind: dflash, block_size: 8}]' \
        --ks 7 --mtbench 8 --heldout 8 --batch 8
and writes results.json (per side: steps, tokens, tokens/s median and mean, their exact command) and table.md.

--device cuda (the H200 run of benchmarks/RESULTS.md, "Equal steps on the H200"): no Prefect and no vLLM there, so
the data artifacts (prepare/regenerate, vocab) are copied onto `--work`/store beforehand and extraction runs in this
process with the extract stage's own code (prepare_direct); both trainers then run --steps steps each (lr annealed by
steps on both sides, train_steps), and each draft is also written without the target's frozen embedding
(model.slim.safetensors, 20 of its 76 MB, slim_draft) for a size-capped trip back; --measure-only puts the
embedding back from the target (unslim_draft) before measuring.

Data: `draftline run configs/demo.yaml --until extract` (plus any --set) on a store of its own,
`--work`/store (default out/equal-budget/store, git-ignored), so prepare, regenerate, vocab and
extract are computed once and shared by every run here, and the user's .draftline is untouched.
Both trainers read the same stored hidden states (theirs after bench_train.speculators_dataset
rewrites our parts in their layout, held-out rows kept out of their training split).

The budget is process CPU time, not wall time: the machine this was written on (2 cores) was shared
with other jobs, and CPU seconds are what a job gets of a core whatever the load. Wall time is
recorded beside it. Both sides run in this one process, one after the other, with torch's default
threads (2 on 2 cores) and the same precision (bf16 autocast on a bf16 CPU: ours via
`train.precision: auto`, theirs via their own autocast, see bench_train.run_speculators' bf16_cpu).

- ours: tasks.train.loop.Trainer, unchanged, with `train.max_minutes` = the budget and its clock
  (`build_trainer(clock=)`, `time.perf_counter` by default) this process's CPU clock, so the budget stop,
  the lr annealing by the clock and the step times all follow CPU time. `--exports M,...` also writes a
  snapshot draft when the clock passes M minutes (the lr is annealed to the full budget, so a snapshot is a
  lower bound on a run annealed to M minutes); the snapshot's export and held-out eval are not counted in
  the clock.
- theirs: speculators' Trainer (bench_train.run_speculators: their data format, dataset, collate,
  multipack sampler, AdamW, warm-up + cosine schedule by steps). Their schedule needs a step count, so a
  6-step calibration run measures their CPU seconds per step and the real run gets
  floor(budget / that) steps, stopping early if the budget runs out first.

Every draft is exported with tasks.train.loop.save_draft (speculators' format, what vLLM loads) into
`--work`/NAME/drafts/, then measured with the benchmark stage's own code (tasks.benchmark.stage:
load_eval_prompts, engine_kwargs, measure, acceptance_figures) in vLLM: one engine per draft and k, plus
a baseline engine for tokens/s, on `--mtbench` MT-Bench first turns and `--heldout` held-out prompts of
the training data, at batch `--batch`, `--max-tokens` new tokens, temperature 0. Engines run per k,
ours then theirs, so both meet the same load. Results: `--work`/NAME/results.json and a markdown table
printed and written to `--work`/NAME/table.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests" / "support"))

import torch  # noqa: E402

from bench_train import clear_checkpoints, free_memory, run_speculators, speculators_dataset  # noqa: E402
from tasks.address import digests  # noqa: E402
from tasks.core.config import EvalConfig, RunConfig  # noqa: E402
from tasks.core.config_load import load_config  # noqa: E402
from tasks.store.artifacts import Store  # noqa: E402
from tasks.train.dist import DistEnv  # noqa: E402
from tasks.train.inputs import resolve_inputs  # noqa: E402
from tasks.train.loop import Trainer, build_trainer, save_draft  # noqa: E402


class CpuClock:
    """This process's CPU seconds, minus the spans `paused()` leaves out (snapshot exports)."""

    def __init__(self) -> None:
        self.excluded = 0.0

    def __call__(self) -> float:
        return time.process_time() - self.excluded

    def paused(self):
        clock = self

        class _Pause:
            def __enter__(self):
                self.t0 = time.process_time()

            def __exit__(self, *exc):
                clock.excluded += time.process_time() - self.t0

        return _Pause()


def stage_digest(summary: dict, stage: str) -> str:
    return summary["stages"][stage]["artifact"].rstrip("/").rsplit("/", 1)[-1]


def prepare(config: str, sets: list[str], work: Path) -> tuple[RunConfig, Store, object, object, list]:
    """The data stages through the pipeline (cached on `work`/store), then their refs."""
    sets = [f"store.uri=file://{work / 'store'}", *sets]
    cmd = [sys.executable, "-m", "cli.app", "run", config, "--until", "extract", "--json"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect"),  # the GPU's vLLM comes on PYTHONPATH (/tmp/site)
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"draftline run --until extract failed:\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    status = ", ".join(f"{k} {v['status']}" for k, v in summary["stages"].items())
    print(f"data stages: {status} ({time.perf_counter() - t0:.0f}s)", flush=True)
    cfg = load_config(config, sets)
    store = Store.from_config(cfg.store)
    data_stage = "regenerate" if cfg.regenerate.enabled else "prepare"
    data = store.open(data_stage, stage_digest(summary, data_stage)).ref()
    vocab = store.open("vocab", stage_digest(summary, "vocab")).ref()
    layer_ids = store.open("extract", next(m.digest for m in store.list("extract")
                                           if m.inputs.get("data") == data.digest)).ref().stats["layer_ids"]
    shards = [store.open("extract", digests.extract_shard(cfg, layer_ids, data.digest, i)).ref()
              for i in range(cfg.data.num_shards)]
    return cfg, store, data, vocab, shards


def prepare_direct(config: str, sets: list[str], work: Path) -> tuple[RunConfig, Store, object, object, list]:
    """`--device cuda` (a GPU machine without vLLM or Prefect): the data artifacts copied beforehand onto
    `work`/store (one prepare or regenerate artifact, one vocab artifact), extraction here through the
    extract stage's own code (plan_extract, extract_shard) with the config's extract.backend
    (`--set extract.backend=transformers` there)."""
    from tasks.engine.settings import EnginePool, engine_for_group, engine_groups
    from tasks.extract.stage import extract_shard, plan_extract
    from tasks.engine.target import load_hf_config, resolve_model

    cfg = load_config(config, [f"store.uri=file://{work / 'store'}", *sets])
    store = Store.from_config(cfg.store)
    data_stage = "regenerate" if cfg.regenerate.enabled else "prepare"
    (data_m,), (vocab_m,) = store.list(data_stage), store.list("vocab")
    data, vocab = store.open(data_stage, data_m.digest).ref(), store.open("vocab", vocab_m.digest).ref()
    model = resolve_model(cfg.target)
    plans = plan_extract(cfg, data, load_hf_config(cfg.target, model))
    t0 = time.perf_counter()
    pool = EnginePool(lambda group: engine_for_group(cfg, model, group), engine_groups(cfg))
    try:
        shards = []
        for plan in plans:
            with pool.engine() as engine:
                shards.append(extract_shard(cfg, store, plan, engine))
    finally:
        pool.close()
    print(f"extract ({cfg.extract.backend}): {len(shards)} shards, "
          f"{sum(int(s.stats.get('tokens', 0)) for s in shards)} tokens in {time.perf_counter() - t0:.0f}s", flush=True)
    return cfg, store, data, vocab, shards


def train_steps(cfg: RunConfig, store: Store, vocab, shards, steps: int, drafts: Path, name: str,
                device: str) -> list[dict]:
    """`--device cuda`: both trainers for the same `steps` steps (no time budget: the lr anneals by steps
    on both sides), ours then theirs, each draft exported; wall time and tokens/s per side."""
    cfg = with_train(cfg, max_steps=steps, max_minutes=None, checkpoint_every=10**6)
    inputs = resolve_inputs(cfg, store, vocab, shards)
    clear_checkpoints(store, inputs.digest, steps)
    free_memory()
    recs: list[dict] = []
    trainer = build_trainer(cfg, store, inputs, DistEnv.from_env(cfg.train), recs.append)
    t0 = time.perf_counter()
    state = trainer.fit()
    wall = time.perf_counter() - t0
    folder = drafts / f"{name}-ours-{steps}steps"
    folder.mkdir(parents=True, exist_ok=True)
    save_draft(trainer.model, str(folder), cfg.target.dtype)
    timed = [r for r in recs if r.get("kind") == "train"][2:]
    ours = {"draft": folder.name, "side": "ours", "steps": state.step, "wall_s": round(wall, 1),
            "tokens": state.tokens_seen, "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in timed), 1),
            "mean_tokens_per_s": round(sum(r["tokens"] for r in timed) / sum(r["step_s"] for r in timed), 1),
            "precision": trainer.precision, "attn_impl": trainer.attn_impl, "stopped_reason": state.stopped_reason,
            **trainer.evaluate()}
    print(f"ours: {ours['steps']} steps in {wall:.1f}s, {ours['tokens_per_s']} tok/s, "
          f"sim AL {ours.get('simulated_acceptance_length')}", flush=True)
    held, eval_set = heldout(trainer), trainer.held_out.batches
    del trainer
    free_memory()
    folder = drafts / f"{name}-theirs-{steps}steps"
    if cfg.train.head.drafts_blocks:
        res = theirs_by_cli(cfg, store, inputs, held, steps, folder, device)
    else:
        res = run_speculators(cfg, store, inputs, held, eval_set, 0, device, keep_model=True)
        export_theirs(res, folder, cfg)
    theirs = {"draft": folder.name, "side": "theirs", **res}
    print(f"theirs: {res['steps']} steps in {res['wall_s']}s, {res['tokens_per_s']} tok/s, "
          f"sim AL {res.get('simulated_acceptance_length')}", flush=True)
    return [ours, theirs]


def theirs_by_cli(cfg: RunConfig, store: Store, inputs, held: set[str], steps: int, folder: Path,
                  device: str) -> dict:
    """A block head (DFlash, DSpark) trained by speculators 0.9's own `speculators train` (their CLI, model
    construction, data loader, loss and Trainer; benchmarks/speculators_train.py times its steps) on our stored
    hidden states rewritten in their layout (held-out rows last, their val split), with what ours trains with:
    the same steps, packed tokens per step, lr, warm-up + cosine schedule, seed, draft depth, block size, anchors,
    mask token, layers, vocabulary maps and loss (name, position weights, D-PACE alpha: our forward_kwargs). On a
    CPU their sdpa attention and eager loss (FACTS: no flex backward, no Triton); bf16 on a GPU, fp32 on a CPU."""
    import tempfile

    import numpy as np

    from tasks.train.loop import forward_kwargs
    from tasks.train.model import dflash_mask_token
    from tasks.engine.target import text_config

    t, head = cfg.train, cfg.train.head
    fk = forward_kwargs(t)
    s = head.dflash_settings()
    with tempfile.TemporaryDirectory(prefix="bench-speculators-cli-") as tmp:
        data = Path(tmp) / "data"
        n_train, n_all = speculators_dataset(data, store, inputs, held)
        np.save(Path(tmp) / "d2t.npy", inputs.d2t.numpy())
        np.save(Path(tmp) / "t2d.npy", inputs.t2d.numpy())
        # their Trainer runs every --epochs epoch (max_steps only ends the epoch it falls in, and each later epoch
        # trains a step): as many epochs as `steps` needs, counted low per epoch (packing fills batches less than
        # fully), so they train `steps` steps, at most one more; the steps they trained are recorded
        from datasets import load_from_disk

        train_tokens = int(sum(load_from_disk(str(data))["seq_len"][:n_train]))
        epochs = -(-steps // max(1, train_tokens // t.batch_tokens))
        mask = dflash_mask_token(head, inputs.target_path, int(text_config(inputs.hf_config).vocab_size),
                                 cfg.target.trust_remote_code)
        args = ["--speculator-type", head.kind, "--verifier-name-or-path", inputs.target_path,
                "--data-path", str(data), "--save-path", str(Path(tmp) / "ckpt"), "--seed", str(t.seed),
                "--num-layers", str(t.num_layers), "--draft-arch", "qwen3",
                "--target-layer-ids", *map(str, inputs.layer_ids[:-1]),
                "--draft-vocab-size", str(int(inputs.d2t.shape[0])), "--d2t-path", str(Path(tmp) / "d2t.npy"),
                "--t2d-path", str(Path(tmp) / "t2d.npy"), "--mask-token-id", str(mask),
                "--block-size", str(s["block_size"]), "--max-anchors", str(s["max_anchors"]),
                "--total-seq-len", str(t.batch_tokens), "--train-data-ratio", str((n_train + 0.5) / n_all),
                "--lr", str(t.lr), "--weight-decay", str(t.weight_decay), "--optimizer", "adamw",
                "--scheduler-type", "cosine", "--scheduler-warmup-steps", str(t.warmup_steps),
                "--scheduler-total-steps", str(steps), "--max-steps", str(steps), "--epochs", str(epochs),
                "--checkpoint-freq", str(10**6), "--no-resume-from-checkpoint", "--num-workers", "0",
                "--loss-fn", next(iter(fk["loss_config"])), "--per-position-loss-weight",
                fk["per_position_loss_weight"], "--dpace-alpha", str(fk["dpace_alpha"]),
                "--dflash-decay-gamma", str(fk["gamma"]),
                "--hidden-states-dtype", "bfloat16" if device == "cuda" else "float32",
                "--draft-attn-impl", "simple_flex_attention" if device == "cuda" else "sdpa",
                "--loss-implementation", t.loss_impl if device == "cuda" else "eager"]
        if head.kind == "dspark":
            args += ["--confidence-head-alpha", str(fk["confidence_head_alpha"])]
        timing = Path(tmp) / "timing.json"
        cmd = [sys.executable, str(REPO / "benchmarks" / "speculators_train.py"), "--timing", str(timing),
               *(["--cpu"] if device == "cpu" else []), "--", *args]
        print("theirs: " + " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.exit(f"speculators train failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        stamps = json.loads(timing.read_text())["steps"]
        per_step = [n / (b - a) for (n, a), (_, b) in zip(stamps, stamps[1:])][2:]  # first two: warm-up
        saved = sorted(Path(tmp, "ckpt").rglob("model.safetensors"), key=lambda p: p.stat().st_mtime)
        if not saved:
            sys.exit(f"speculators train saved no model.safetensors under {tmp}/ckpt:\n{proc.stderr[-2000:]}")
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "model.safetensors"):
            shutil.copy(saved[-1].parent / name, folder / name)
    return {"steps": len(stamps) - 1, "wall_s": round(wall, 1), "tokens": sum(n for n, _ in stamps),
            "tokens_per_s": round(statistics.median(per_step), 1) if per_step else None,
            "mean_tokens_per_s": round(sum(n for n, _ in stamps[2:-1]) / (stamps[-2][1] - stamps[2][1]), 1)
            if len(stamps) > 4 else None, "command": "speculators train " + " ".join(args)}


EMBED = "embed_tokens.weight"


def slim_draft(folder: Path, target: str) -> bool:
    """The draft's embed_tokens is the target's, frozen on both sides (57 of its 76 MB here): write
    model.slim.safetensors without it, so a draft comes back from a device whose files are size-capped;
    `unslim_draft` puts the target's back. False (nothing written) if the draft's embedding differs."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    w = load_file(str(folder / "model.safetensors"))
    with safe_open(str(Path(target) / "model.safetensors"), "pt") as f:
        if not torch.equal(w[EMBED], f.get_tensor("model.embed_tokens.weight").to(w[EMBED].dtype)):
            return False
    del w[EMBED]
    save_file(w, str(folder / "model.slim.safetensors"), metadata={"format": "pt"})
    return True


def unslim_draft(folder: Path, target: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    w = load_file(str(folder / "model.slim.safetensors"))
    with safe_open(str(Path(target) / "model.safetensors"), "pt") as f:
        w[EMBED] = f.get_tensor("model.embed_tokens.weight").to(w["lm_head.weight"].dtype)
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})


def export_theirs(res: dict, folder: Path, cfg: RunConfig) -> None:
    """run_speculators' kept model (popped from `res`) exported in speculators' format, then freed."""
    model = res.pop("_model")
    folder.mkdir(parents=True, exist_ok=True)
    save_draft(model, str(folder), cfg.target.dtype)
    del model
    free_memory()


def with_train(cfg: RunConfig, **update) -> RunConfig:
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=update)})


def heldout(trainer: Trainer) -> set[str]:
    """Sample ids of our held-out rows (the tail of the last part), which theirs must not train on."""
    from tasks.formats.parts import load_part

    spec = trainer.parts[-1]
    with trainer.inp.artifacts[spec.digest].local_copy(spec.name) as path:
        ids = load_part(path)["sample_ids"]
    return set(ids[len(ids) - spec.holdout:])


def train_ours(cfg: RunConfig, store: Store, vocab, shards, budget_min: float, exports: list[float],
               drafts: Path, name: str) -> tuple[list[dict], Trainer]:
    """Our Trainer on a CPU-time budget; a draft per export point (the budget itself included)."""
    cfg = with_train(cfg, max_minutes=budget_min, checkpoint_every=10**6)
    inputs = resolve_inputs(cfg, store, vocab, shards)
    clear_checkpoints(store, inputs.digest, cfg.train.max_steps)  # a stale checkpoint would be resumed
    free_memory()
    clock = CpuClock()
    points = sorted(set([m for m in exports if m < budget_min]))
    out: list[dict] = []
    holder: dict = {}
    def snapshot(minutes: float, rec: dict) -> None:
        w0 = time.perf_counter()
        with clock.paused():
            trainer = holder["trainer"]
            folder = drafts / f"{name}-{minutes:g}min"
            folder.mkdir(parents=True, exist_ok=True)
            save_draft(trainer.model, str(folder), cfg.target.dtype)
            ev = trainer.evaluate()
            out.append({"draft": folder.name, "side": "ours", "budget_cpu_min": minutes, "steps": rec["step"],
                        "cpu_s": round(rec["elapsed_s"], 1), "wall_s": round(rec["wall_s"], 1),
                        "tokens": sum(h["tokens"] for h in steps), "lr_at_snapshot": rec["lr"], **ev})
            print(f"ours snapshot {folder.name}: step {rec['step']}, {rec['elapsed_s']:.0f} CPU-s, "
                  f"{rec['wall_s']:.0f} wall-s, sim AL {ev.get('simulated_acceptance_length')}", flush=True)
        paused_wall[0] += time.perf_counter() - w0

    steps: list[dict] = []
    paused_wall = [0.0]

    def on_metrics(rec: dict) -> None:
        if rec.get("kind") == "start":
            wall0 = time.perf_counter()
            holder["wall0"] = wall0
        if rec.get("kind") != "train":
            return
        rec["wall_s"] = time.perf_counter() - holder["wall0"] - paused_wall[0]  # training only
        steps.append(rec)
        while points and rec["elapsed_s"] >= points[0] * 60:
            snapshot(points.pop(0), rec)

    trainer = build_trainer(cfg, store, inputs, DistEnv.from_env(cfg.train), on_metrics, clock=clock)
    holder["trainer"] = trainer
    state = trainer.fit()
    snapshot(budget_min, {**steps[-1], "elapsed_s": state.train_seconds})
    cpu_frac = state.train_seconds / steps[-1]["wall_s"]
    out[-1].update({"stopped_reason": state.stopped_reason, "precision": trainer.precision,
                    "attn_impl": trainer.attn_impl,
                    "cpu_s_per_step_median": statistics.median(r["step_s"] for r in steps[2:] or steps),
                    "cpu_tokens_per_s": round(state.tokens_seen / state.train_seconds, 1),
                    "wall_tokens_per_s": round(state.tokens_seen / steps[-1]["wall_s"], 1),
                    "cores_busy": round(cpu_frac, 2)})
    return out, trainer


def train_theirs(cfg: RunConfig, store: Store, vocab, shards, budget_min: float, trainer: Trainer,
                 drafts: Path, name: str, bf16_cpu: bool, steps: int | None = None) -> list[dict]:
    """speculators' Trainer: a 6-step calibration of CPU s/step, then floor(budget / that) steps
    (or `steps` given: no calibration; the budget still stops it)."""
    inputs = resolve_inputs(cfg, store, vocab, shards)
    held, eval_set = heldout(trainer), trainer.held_out.batches
    cpu: list[float] = []
    last = [0.0]

    def per_step(_trainer, _model) -> bool:
        now = time.process_time()
        cpu.append(now - last[0])
        last[0] = now
        return False

    free_memory()
    if steps:
        n, s_per_step = steps, budget_min * 60 / steps
    else:
        last[0] = time.process_time()
        cal = with_train(cfg, max_steps=6)
        run_speculators(cal, store, inputs, held, eval_set, 0, "cpu", bf16_cpu=bf16_cpu, after_step=per_step)
        # the first step also timed building their dataset (speculators_dataset), the second warms up
        s_per_step = statistics.median(cpu[2:])
        n = max(1, int(budget_min * 60 / s_per_step))
        print(f"speculators calibration: {s_per_step:.2f} CPU-s/step -> {n} steps in {budget_min:g} CPU-min",
              flush=True)
    free_memory()
    run_cfg = with_train(cfg, max_steps=n)
    first: list[float] = []

    def budget(_trainer, _model) -> bool:
        # counted from the first step on (their data conversion before it is not), the first step
        # credited with the calibrated cost
        if not first:
            first.append(time.process_time() - s_per_step)
        return time.process_time() - first[0] >= budget_min * 60

    res = run_speculators(run_cfg, store, inputs, held, eval_set, 0, "cpu", bf16_cpu=bf16_cpu,
                          after_step=budget, keep_model=True)
    cpu_s, wall = time.process_time() - first[0], res["wall_s"]  # their loop only (bench_train's wall_s)
    folder = drafts / f"{name}-theirs{f'-{steps}steps' if steps else ''}"
    export_theirs(res, folder, cfg)
    out = {"draft": folder.name, "side": "theirs", "budget_cpu_min": budget_min, "planned_steps": n,
           "calibration_cpu_s_per_step": round(s_per_step, 3), "cpu_s": round(cpu_s, 1),
           "wall_s": round(wall, 1), "cores_busy": round(cpu_s / wall, 2), "bf16_autocast": bf16_cpu, **res}
    print(f"theirs: {res['steps']} steps, {cpu_s:.0f} CPU-s, sim AL "
          f"{res.get('simulated_acceptance_length')}", flush=True)
    return [out]


def measure(cfg: RunConfig, store: Store, data, drafts: list[str], folder: Path, ks: list[int], n_mtbench: int,
            n_heldout: int, batch: int, max_tokens: int, baseline: bool) -> dict:
    """Each draft at each k in vLLM (the benchmark stage's code), plus the baseline for tokens/s."""
    from tasks.benchmark.stage import VLLM_METHODS, default_engine_factory
    from tasks.engine.settings import benchmark_kwargs as engine_kwargs
    from tasks.benchmark.measure import acceptance_figures, measure as measure_run
    from tasks.benchmark.prompts import load_eval_prompts
    from tasks.data.chat import make_masker
    from tasks.engine.target import resolve_model

    evals = [EvalConfig(name="mtbench", source={"preset": "mtbench"}, num_prompts=n_mtbench),
             EvalConfig(name="heldout", source="heldout", num_prompts=n_heldout)]
    masker = make_masker(cfg, template_kwargs={"enable_thinking": bool(cfg.regenerate.thinking)}
                         if cfg.regenerate.enabled else None)
    prompts = {ev.name: load_eval_prompts(cfg, store, data, ev, masker.prompt_ids).prompts for ev in evals}
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "seed": cfg.data.seed}
    model = resolve_model(cfg.target)
    factory = default_engine_factory(cfg, model)
    results: dict = {"prompts": {k: len(v) for k, v in prompts.items()}, "batch": batch, "max_tokens": max_tokens,
                     "runs": []}

    def serve(name: str, kwargs: dict, k: int | None, draft: str | None) -> None:
        engine = factory(name, kwargs)
        t0 = time.perf_counter()
        try:
            engine.start()
            start_s = time.perf_counter() - t0
            engine.generate([prompts["mtbench"][0]], {"max_tokens": 8, "temperature": 0.0})
            for ev, ps in prompts.items():
                run = measure_run(engine, ps, sampling, batch)
                row = {"draft": draft, "k": k, "eval": ev, **run.throughput(), "engine_start_s": round(start_s, 1),
                       "load_avg_1m": round(os.getloadavg()[0], 2), "outputs": run.outputs}
                if k is not None:
                    row.update(acceptance_figures(run.spec, k))
                    print(f"  {draft} k={k} {ev}: AL {row['mean_acceptance_length']:.3f} "
                          f"({row['accepted_tokens']}/{row['drafts']}), {row['output_tokens_per_s']:.1f} tok/s",
                          flush=True)
                else:
                    print(f"  baseline {ev}: {row['output_tokens_per_s']:.1f} tok/s", flush=True)
                results["runs"].append(row)
        finally:
            engine.close()

    if baseline:
        serve("baseline", engine_kwargs(cfg, None, model), None, None)
    for k in ks:
        for d in drafts:
            method = VLLM_METHODS[json.loads((folder / d / "config.json").read_text())["speculators_model_type"]]
            spec = {"method": method, "model": str(folder / d), "num_speculative_tokens": k}
            serve(f"{method}-{d}-k{k}", engine_kwargs(cfg, spec, model), k, d)
    return results


def vocab_coverage(measured: dict, drafts: Path) -> None:
    """Per run: the share of the generated tokens (the target's greedy output) inside the draft's vocabulary
    (its t2d), i.e. the tokens the draft could propose at all."""
    from safetensors.torch import load_file

    t2d: dict[str, torch.Tensor] = {}
    for r in measured["runs"]:
        if r["draft"] is None:
            continue
        if r["draft"] not in t2d:
            t2d[r["draft"]] = load_file(str(drafts / r["draft"] / "model.safetensors"))["t2d"].bool()
        ids = torch.tensor([t for o in r["outputs"] for t in o], dtype=torch.long)
        r["in_draft_vocab"] = round(float(t2d[r["draft"]][ids].float().mean()), 4) if len(ids) else None


def table(trained: list[dict], measured: dict) -> str:
    runs = measured["runs"]
    base = {r["eval"]: r["output_tokens_per_s"] for r in runs if r["k"] is None}
    n = measured["prompts"]
    lines = [f"| draft | steps | CPU s | wall s | sim. AL (k=3) | k | MT-Bench AL ({n['mtbench']} prompts) | "
             f"held-out AL ({n['heldout']}) | MT-Bench tok/s b{measured['batch']} | held-out tok/s | "
             "MT-Bench / held-out output tokens in the draft vocab |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    info = {t["draft"]: t for t in trained}
    for r in runs:
        if r["k"] is None or r["eval"] != "mtbench":
            continue
        h = next(x for x in runs if x["draft"] == r["draft"] and x["k"] == r["k"] and x["eval"] == "heldout")
        t = info.get(r["draft"], {})
        lines.append(f"| {r['draft']} | {t.get('steps', '')} | {t.get('cpu_s', '')} | {t.get('wall_s', '')} | "
                     f"{t.get('simulated_acceptance_length', '')} | {r['k']} | {r['mean_acceptance_length']:.3f} | "
                     f"{h['mean_acceptance_length']:.3f} | {r['output_tokens_per_s']:.1f} | "
                     f"{h['output_tokens_per_s']:.1f} | {r.get('in_draft_vocab')} / {h.get('in_draft_vocab')} |")
    if base:
        lines.append(f"\nbaseline tok/s at batch {measured['batch']}: MT-Bench {base.get('mtbench', 0):.1f}, "
                     f"held-out {base.get('heldout', 0):.1f}")
    sides = {t["side"]: t["draft"] for t in trained if t.get("side") == "theirs"}
    if "theirs" in sides and any(t["side"] == "ours" for t in trained):
        theirs = sides["theirs"]
        ours = [t["draft"] for t in trained if t["side"] == "ours"][-1]
        lines.append("\n| k | eval | ours AL | theirs AL | ours / theirs |\n|---:|---|---:|---:|---:|")
        for r in runs:
            if r["draft"] == ours:
                o = next(x for x in runs if x["draft"] == theirs and x["k"] == r["k"] and x["eval"] == r["eval"])
                lines.append(f"| {r['k']} | {r['eval']} | {r['mean_acceptance_length']:.3f} | "
                             f"{o['mean_acceptance_length']:.3f} | "
                             f"{r['mean_acceptance_length'] / o['mean_acceptance_length']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--set", action="append", default=[], dest="sets", help="config override (repeatable)")
    ap.add_argument("--name", default="equal")
    ap.add_argument("--work", default=str(REPO / "out" / "equal-budget"))
    ap.add_argument("--sides", default="ours,theirs")
    ap.add_argument("--budget-cpu-min", type=float, default=10.0, help="training budget, process CPU minutes")
    ap.add_argument("--exports", default="", help="ours: also export drafts at these CPU minutes")
    ap.add_argument("--their-precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--their-steps", type=int, default=None,
                    help="theirs: this many steps (cosine over them) instead of the calibrated count")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: no Prefect/vLLM; extract here (prepare_direct), train both sides --steps steps "
                         "(train_steps), export, no measuring (measure the drafts with --measure-only on vLLM)")
    ap.add_argument("--steps", type=int, default=400, help="--device cuda / --by-steps: training steps, both sides")
    ap.add_argument("--by-steps", action="store_true",
                    help="the data through draftline run, both sides --steps steps on --device (train_steps), then "
                         "measured in vLLM here; always so for a block head (DFlash, DSpark) in train.heads")
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--mtbench", type=int, default=80)
    ap.add_argument("--heldout", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--measure-only", action="store_true", help="measure the drafts of an earlier run of --name")
    ap.add_argument("--table-only", action="store_true", help="print the table of an earlier run of --name")
    args = ap.parse_args()
    work = Path(args.work).resolve()
    run_dir = work / args.name
    drafts = run_dir / "drafts"
    drafts.mkdir(parents=True, exist_ok=True)
    if args.table_only:
        results = json.loads((run_dir / "results.json").read_text())
        vocab_coverage(results["measured"], drafts)
        print(table(results["trained"], results["measured"]))
        return
    # block heads (DFlash, DSpark): equal steps on both sides, theirs by their own CLI, which needs a step count
    by_steps = args.by_steps or any(h.drafts_blocks for h in load_config(args.config, args.sets).train.heads)
    if args.device == "cuda" and not by_steps:
        cfg, store, data, vocab, shards = prepare_direct(args.config, args.sets, work)
        results = {"argv": sys.argv, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "train_digest_inputs": {"vocab": vocab.digest, "data": data.digest},
                   "trained": train_steps(cfg, store, vocab, shards, args.steps, drafts, args.name, "cuda")}
        from tasks.engine.target import resolve_model

        for t in results["trained"]:
            t["slim"] = slim_draft(drafts / t["draft"], resolve_model(cfg.target))
        (run_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
        return
    cfg, store, data, vocab, shards = prepare(args.config, args.sets, work)
    sides = args.sides.split(",")
    result_path = run_dir / "results.json"
    results = json.loads(result_path.read_text()) if args.measure_only else {
        "argv": sys.argv, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "train_digest_inputs": {"vocab": vocab.digest,
                                                                           "data": data.digest},
        "trained": []}
    if not args.measure_only:
        exports = [float(x) for x in args.exports.split(",") if x]
        trainer = None
        if by_steps:
            results["trained"] += train_steps(cfg, store, vocab, shards, args.steps, drafts, args.name, args.device)
            sides = []
        if "ours" in sides:
            rows, trainer = train_ours(cfg, store, vocab, shards, args.budget_cpu_min, exports, drafts,
                                       f"{args.name}-ours")
            results["trained"] += rows
            result_path.write_text(json.dumps(results, indent=2, default=str))
        if "theirs" in sides:
            if trainer is None:
                trainer = build_trainer(cfg, store, resolve_inputs(cfg, store, vocab, shards),
                                        DistEnv.from_env(cfg.train))
            results["trained"] += train_theirs(cfg, store, vocab, shards, args.budget_cpu_min, trainer, drafts,
                                               args.name, args.their_precision == "bf16", args.their_steps)
            result_path.write_text(json.dumps(results, indent=2, default=str))
        del trainer
        free_memory()
    names = [t["draft"] for t in results["trained"]]
    for n in names:  # drafts brought back slim from a device (slim_draft)
        if not (drafts / n / "model.safetensors").is_file() and (drafts / n / "model.slim.safetensors").is_file():
            from tasks.engine.target import resolve_model

            unslim_draft(drafts / n, resolve_model(cfg.target))
    t0 = time.perf_counter()
    results["measured"] = measure(cfg, store, data, names, drafts, [int(k) for k in args.ks.split(",")],
                                  args.mtbench, args.heldout, args.batch, args.max_tokens, not args.no_baseline)
    results["measure_wall_s"] = round(time.perf_counter() - t0, 1)
    vocab_coverage(results["measured"], drafts)
    result_path.write_text(json.dumps(results, indent=2, default=str))
    md = table(results["trained"], results["measured"])
    (run_dir / "table.md").write_text(md + "\n")
    print("\n" + md)


if __name__ == "__main__":
    main()
