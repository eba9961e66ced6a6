"""The training loop that every rank of the train stage runs: `Trainer` (model, optimizer, packed
batches from the store, checkpoints that resume exactly, held-out evaluation, export for vLLM), the
learning-rate schedule, the distributed environment of a rank, and `train_here`, one rank's work."""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from tasks.formats.acceptance import simulated_acceptance_length
from tasks.core.config import RunConfig, TrainConfig
from tasks.core.digest import VERSIONS
from tasks.core.faults import kill_point
from tasks.core.owners import owned_temporary_directory
from tasks.store.artifacts import ArtifactCorrupt, ArtifactRef, Store
from tasks.train import CKPT_STAGE, STAGE, MetricsCallback, TrainError, log, wants_cuda
from tasks.train.checkpoints import Checkpointer, checkpoint_digest
from tasks.train.inputs import TrainInputs, resolve_inputs, train_head
from tasks.train.model import (
    attention_shape,
    build_draft_model,
    draft_layer_config,
    flex_attention_compiles,
    flops_per_token,
    resolve_attn_impl,
    resolve_precision,
    trainable_names,
)
from tasks.train.stream import (
    Batch,
    BatchStream,
    PartData,
    PartReader,
    PartSpec,
    eval_batches,
    holdout_plan,
    tail_copy,
)

# Dense bf16 peak of the GPUs we know, for MFU (None elsewhere: CPU MFU is not meaningful).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12,
                   "B300": 2250e12, "L40S": 362e12}


def lr_at(step: int, train: TrainConfig, elapsed_s: float | None = None) -> float:
    """Learning rate for the step with 0-based index `step`: linear warm-up over
    `warmup_steps`, then cosine decay from `lr` to `min_lr_ratio * lr` at `max_steps`.

    With a wall-clock budget (`max_minutes`) and the training seconds spent so far, the decay
    follows whichever end comes first, steps or time: a run that the budget stops at step 110
    of 400 has still annealed, instead of stopping at almost the peak rate."""
    if train.warmup_steps and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    span = max(1, train.max_steps - train.warmup_steps)
    progress = (step - train.warmup_steps) / span
    if train.max_minutes and elapsed_s is not None:
        progress = max(progress, elapsed_s / (train.max_minutes * 60))
    progress = min(1.0, max(0.0, progress))
    return train.lr * (train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _ratios(metrics: dict[str, float], ttt_steps: int) -> dict[str, Any]:
    """Per-position numbers from speculators' summed counters (after any all-reduce)."""
    chain = []
    for k in range(ttt_steps):
        tot = metrics.get(f"full_acc_{k}_total", 0.0)
        chain.append(metrics.get(f"full_acc_{k}_sum", 0.0) / tot if tot > 0 else 0.0)
    cond = [chain[0]] + [chain[k] / chain[k - 1] if chain[k - 1] > 0 else 0.0 for k in range(1, ttt_steps)]
    losses = [metrics.get(f"loss_{k}_sum", 0.0) / max(metrics.get(f"loss_{k}_total", 1.0), 1e-12)
              for k in range(ttt_steps)]
    return {"acc_per_pos": cond, "chain_acc_per_pos": chain, "loss_per_pos": losses}


def step_ratios(metrics: dict[str, float], head: Any, ttt_steps: int) -> dict[str, Any]:
    """A training step's per-position numbers. EAGLE-3 heads: `_ratios`. DFlash: speculators' accuracy per
    drafted slot of a block (slot 1 = the first token after the anchor, each slot on its own) and its
    expected accepted length (per block: the leading run of right slots plus the bonus token)."""
    if head.kind != "dflash":
        return _ratios(metrics, ttt_steps)
    slots = sorted(int(k.split("_")[1]) for k in metrics if k.startswith("position_") and k.endswith("_acc_sum"))
    acc = [metrics[f"position_{i}_acc_sum"] / metrics[f"position_{i}_acc_total"]
           if metrics.get(f"position_{i}_acc_total") else 0.0 for i in slots]
    eal = metrics.get("eal_sum", 0.0) / metrics["eal_total"] if metrics.get("eal_total") else 0.0
    return {"acc_per_pos": acc, "chain_acc_per_pos": [], "loss_per_pos": [], "expected_acceptance_length": eal}


def forward_kwargs(t: TrainConfig) -> dict[str, Any]:
    """The loss settings a head's forward pass takes: speculators' defaults for its kind (EAGLE-3: KL
    divergence over `ttt_steps`; DFlash: cross-entropy, D-PACE position weights, `max_anchors` blocks)."""
    from speculators.losses import resolve_loss_config

    if t.head.kind != "dflash":
        return {"ttt_steps": t.ttt_steps, "ttt_step_loss_decay": t.ttt_step_loss_decay,
                "loss_config": resolve_loss_config("kl_div", t.loss_impl)}
    return {"loss_config": resolve_loss_config("ce", t.loss_impl), "gamma": 4.0,
            "max_anchors": t.head.dflash_settings()["max_anchors"], "per_position_loss_weight": "dpace",
            "dpace_alpha": 0.5}


def _r(x: float, nd: int = 6) -> float:
    return float(round(float(x), nd))


@dataclass
class DistEnv:
    """Rank, world and device; DDP when launched under torchrun (WORLD_SIZE > 1)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    owns_group: bool = False

    @classmethod
    def from_env(cls, train: TrainConfig) -> "DistEnv":
        use_cuda = wants_cuda(train)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if use_cuda:
            torch.cuda.set_device(local)
            device = torch.device("cuda", local)
        else:
            device = torch.device("cpu")
        env = cls(rank=rank, world=world, local_rank=local, device=device)
        if world > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group(backend="nccl" if use_cuda else "gloo")
                env.owns_group = True
            if dist.get_world_size() != world:
                raise TrainError(f"WORLD_SIZE={world} but the process group has {dist.get_world_size()} ranks")
        return env

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        if not self.distributed or not values:
            return values
        import torch.distributed as dist

        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))

    def any(self, flag: bool) -> bool:
        """True on every rank if it is True on any (rank 0 decides time-budget stops)."""
        if not self.distributed:
            return flag
        return self.sum({"f": 1.0 if flag else 0.0})["f"] > 0

    def gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.owns_group = False


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states as JSON (torch states base64)."""
    state: dict[str, Any] = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": json.loads(json.dumps(random.getstate())),
    }
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    if device.type == "cuda":
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state(device).numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8),
                                 device)


@dataclass
class RunState:
    """What a checkpoint restores besides weights and optimizer moments."""

    step: int = 0
    tokens_seen: int = 0
    train_seconds: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    positions: list[dict[str, int]] | None = None
    rng: list[dict[str, Any]] | None = None
    world: int = 1
    stopped_reason: str | None = None
    resumed_from: int | None = None


class Trainer:
    """One training run over resolved inputs. Parts (see the module docstring):
    env, model (+ddp), optimizer, stream / eval batches, checkpoints, metrics."""

    def __init__(self, cfg: RunConfig, store: Store, inputs: TrainInputs, env: DistEnv,
                 on_metrics: MetricsCallback | None = None,
                 load_part: Callable[[PartSpec], PartData] | None = None):
        self.cfg, self.t, self.store, self.inp, self.env = cfg, cfg.train, store, inputs, env
        self.on_metrics = on_metrics
        t = self.t
        if env.device.type == "cpu" and t.attn_impl == "flex_attention":
            raise TrainError("train.attn_impl flex_attention has no backward pass on CPU; use sdpa (or eager, "
                             "or auto)")
        if env.device.type == "cpu" and t.loss_impl == "fused":
            raise TrainError("train.loss_impl fused needs Triton on a GPU; use eager on CPU")
        self.head = train_head(cfg)
        self.read_part = load_part or PartReader(inputs.artifacts, inputs.stored_layer_ids or inputs.layer_ids,
                                                 inputs.hidden_size, keep=inputs.layer_ids,
                                                 cache=part_cache(store, t), dequantize=False)
        self.precision = resolve_precision(t.precision, env.device)

        # model (auto attention: flex_attention where it compiles for this shape, else sdpa)
        shape = attention_shape(draft_layer_config(t, cfg.target, inputs.target_path, inputs.hf_config,
                                                   dflash=self.head.kind == "dflash"))
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
        self.attn_impl, self.attn_fallback = resolve_attn_impl(
            t.attn_impl, env.device, lambda: flex_attention_compiles(env.device, *shape, dtype=dtype))
        self.model = build_draft_model(t, cfg.target, inputs.target_path, inputs.hf_config, inputs.layer_ids,
                                       inputs.d2t, inputs.t2d, attn_impl=self.attn_impl)
        self.init_from: dict[str, Any] | None = None
        if t.init_from:  # a published draft's weights as the start (a resumed run overwrites them below)
            from tasks.formats.drafts import DraftError, warm_start

            try:
                self.init_from = warm_start(self.model, t.init_from, layer_ids=inputs.layer_ids,
                                            kind=self.head.kind, num_layers=t.num_layers)
            except DraftError as exc:
                raise TrainError(str(exc)) from None
            log.info("train.init_from %s: %s", t.init_from, self.init_from["note"])
        self.model = self.model.to(env.device)
        self.model.train()
        self.names = trainable_names(self.model)
        self.params = [p for n, p in self.model.named_parameters() if p.requires_grad]
        self.ddp: torch.nn.Module = self.model
        if env.distributed:
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = DistributedDataParallel(self.model, device_ids=[env.local_rank] if env.device.type == "cuda"
                                               else None)
        self.flops_per_token = flops_per_token(self.model, self.passes_per_token())
        self.peak_flops = self._peak_flops()

        # optimizer (lr is set every step from lr_at)
        self.optimizer = torch.optim.AdamW(self.params, lr=lr_at(0, t), weight_decay=t.weight_decay)
        self.forward_kwargs = forward_kwargs(t)

        # held-out data: the tail of the last part
        last_spec = inputs.parts[-1]
        last = self.read_part(last_spec)
        held = holdout_plan(inputs.parts, last, inputs.total_samples, t)
        self.parts = inputs.parts[:-1] + [PartSpec(**{**last_spec.__dict__, "holdout": held})]
        self.eval: list[Batch] = []
        if held:
            tail = tail_copy(last, last.num_samples - held)
            self.eval = eval_batches(tail, 0, t.batch_tokens, t.eval_batches)
        self.heldout_samples = held
        del last
        self.checkpointer = Checkpointer(store, inputs.digest, t.checkpoint_every, t.keep_checkpoints, t.max_steps)

    # ---------------------------------------------------------------- helpers
    def passes_per_token(self) -> float:
        """Draft decoder passes per trained token: the TTT steps (EAGLE-3), or a DFlash block per sampled
        anchor (at most one anchor per token)."""
        if self.head.kind != "dflash":
            return float(self.t.ttt_steps)
        s = self.head.dflash_settings()
        return s["block_size"] * min(1.0, s["max_anchors"] / self.t.batch_tokens)

    def _peak_flops(self) -> float | None:
        if self.env.device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(self.env.device)
        return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)

    def _autocast(self):
        if self.precision == "bf16":
            return torch.autocast(self.env.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _emit(self, rec: dict[str, Any]) -> None:
        if self.env.rank == 0 and self.on_metrics is not None:
            self.on_metrics(rec)

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, state: RunState, stream: BatchStream | None) -> str:
        from safetensors.torch import save_file

        env = self.env
        positions = env.gather(stream.position if stream is not None else None)
        rngs = env.gather(rng_state(env.device))
        digest = checkpoint_digest(self.inp.digest, state.step)
        if env.rank == 0:
            named = dict(self.model.named_parameters())
            weights = {n: named[n].detach().float().cpu().contiguous() for n in self.names}
            opt_state = self.optimizer.state_dict()
            index = {i: n for i, n in enumerate(self.names)}
            opt_tensors: dict[str, torch.Tensor] = {}
            for i, s in opt_state["state"].items():
                for key, value in s.items():
                    v = value if torch.is_tensor(value) else torch.tensor(value)
                    opt_tensors[f"{index[i]}::{key}"] = v.detach().cpu().contiguous()
            groups = [{k: v for k, v in g.items() if k != "params"} for g in opt_state["param_groups"]]
            meta = {
                "step": state.step, "tokens_seen": state.tokens_seen, "train_seconds": state.train_seconds,
                "world": env.world, "positions": positions, "rng": rngs, "param_names": self.names,
                "optimizer": {"param_groups": groups},
                # the lr the last step used (under max_minutes it follows the clock, not the step)
                "scheduler": {"kind": "warmup_cosine", "step": state.step, "by_clock": self.t.max_minutes is not None,
                              "lr": state.history[-1]["lr"] if state.history else lr_at(state.step, self.t)},
                "stopped_reason": state.stopped_reason, "history": state.history, "train_digest": self.inp.digest,
            }
            with owned_temporary_directory("draftline-ckpt-") as tmp, \
                    self.store.write(CKPT_STAGE, digest, VERSIONS[CKPT_STAGE], {"train": self.inp.digest},
                                     {"step": state.step}) as w:
                save_file(weights, os.path.join(tmp, "m.safetensors"))
                w.put_file("model.safetensors", os.path.join(tmp, "m.safetensors"))
                kill_point("train.checkpoint-file")
                save_file(opt_tensors, os.path.join(tmp, "o.safetensors"))
                w.put_file("optimizer.safetensors", os.path.join(tmp, "o.safetensors"))
                w.write_json("state.json", meta)
                w.commit({"step": state.step, "tokens_seen": state.tokens_seen})
            self.checkpointer.prune()
        env.barrier()
        self._emit({"kind": "checkpoint", "step": state.step, "digest": digest})
        return digest

    def resume(self) -> RunState:
        """The newest committed checkpoint of this run, loaded; a fresh state if there is none."""
        from safetensors.torch import load as st_load

        for step, digest in reversed(self.checkpointer.checkpoints()):
            art = self.store.find(CKPT_STAGE, digest)
            if art is None:
                continue
            try:
                meta = art.read_json("state.json")
                weights = st_load(art.read_bytes("model.safetensors"))
                opt_tensors = st_load(art.read_bytes("optimizer.safetensors"))
            except ArtifactCorrupt as exc:
                log.warning("checkpoint %s unreadable (%s); trying an older one", digest, exc)
                continue
            if meta.get("param_names") != self.names:
                raise TrainError(f"checkpoint {art.uri} holds parameters {meta.get('param_names')[:4]}... but this "
                                 f"model has {self.names[:4]}...; the code changed: bump VERSIONS['train']")
            named = dict(self.model.named_parameters())
            with torch.no_grad():
                for n in self.names:
                    named[n].copy_(weights[n])
            state_by_idx: dict[int, dict[str, torch.Tensor]] = {}
            for key, value in opt_tensors.items():
                name, item = key.split("::", 1)
                state_by_idx.setdefault(self.names.index(name), {})[item] = value.to(self.env.device) \
                    if item != "step" else value
            groups = [dict(g, params=list(range(len(self.names)))) for g in meta["optimizer"]["param_groups"]]
            self.optimizer.load_state_dict({"state": state_by_idx, "param_groups": groups})
            rs = RunState(step=int(meta["step"]), tokens_seen=int(meta["tokens_seen"]),
                          train_seconds=float(meta["train_seconds"]), history=list(meta.get("history", [])),
                          positions=meta.get("positions"), rng=meta.get("rng"), world=int(meta.get("world", 1)),
                          stopped_reason=meta.get("stopped_reason"), resumed_from=step)
            if rs.world == self.env.world and rs.rng:
                set_rng_state(rs.rng[self.env.rank], self.env.device)
            log.info("resumed from checkpoint %s (step %d)", art.uri, rs.step)
            return rs
        return RunState(world=self.env.world)

    # ---------------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, Any]:
        """Held-out loss, per-position accuracy and simulated acceptance length (rank 0's view)."""
        out = evaluate_model(self.model, self.eval, self.env.device, self.forward_kwargs, self._autocast)
        return {**out, "val_samples": self.heldout_samples} if out else {}

    # ---------------------------------------------------------------- the loop
    def fit(self) -> RunState:
        t, env = self.t, self.env
        state = self.resume()
        position = None
        if state.positions:
            if state.world == env.world:
                position = state.positions[env.rank]
            else:
                epoch = max(p["epoch"] for p in state.positions if p) + 1
                log.warning("checkpoint was written by %d ranks, this run has %d: data restarts at epoch %d, "
                            "with the parts dealt anew to %d ranks (each rank's share changes, so node caches fill "
                            "with their new shares)", state.world, env.world, epoch, env.world)
                position = {"epoch": epoch, "cursor": 0, "sample": 0, "offset": 0}
        n_params = sum(p.numel() for p in self.params)
        log.info("train %s: %d trainable parameters, %.3g FLOPs/token, device %s x%d, %s attention, %s, %d parts, "
                 "%d held-out samples", self.inp.digest, n_params, self.flops_per_token, env.device, env.world,
                 self.attn_impl, self.precision, len(self.parts), self.heldout_samples)
        log.info("train config: %s", json.dumps(t.model_dump(mode="json"), sort_keys=True))
        self._emit({"kind": "start", "digest": self.inp.digest, "max_steps": t.max_steps, "step": state.step,
                    "resumed_from": state.resumed_from, "trainable_params": n_params,
                    "flops_per_token": self.flops_per_token, "peak_flops": self.peak_flops,
                    "device": str(env.device), "world_size": env.world, "layer_ids": self.inp.layer_ids,
                    "attn_impl": self.attn_impl, "attn_fallback": self.attn_fallback, "precision": self.precision,
                    "init_from": self.init_from})
        budget = t.max_minutes * 60 if t.max_minutes else None
        if state.stopped_reason == "time_budget" or state.step >= t.max_steps:
            return state  # the last run already finished training; only eval/export remain

        stream = BatchStream(self.parts, self.read_part, batch_tokens=t.batch_tokens, seed=t.seed, rank=env.rank,
                             world=env.world, prefetch=t.prefetch, position=position,
                             pin_memory=env.device.type == "cuda")
        share = stream.share()
        log.info("data: rank %d of %d reads %d of %d parts every epoch%s", env.rank, env.world, len(share),
                 len(self.parts),
                 "" if len(share) == len(self.parts) else " (parts dealt to ranks once; the deal holds across epochs)")
        session_t0 = time.perf_counter()
        seconds_before = state.train_seconds
        self.checkpointer.resumed_at(state.step if state.resumed_from is not None else None)
        save = lambda: self.save_checkpoint(state, stream)  # noqa: E731 - what a checkpoint holds: this trainer's
        every = max(1, t.max_steps // 20)
        try:
            while state.step < t.max_steps:
                elapsed = seconds_before + time.perf_counter() - session_t0
                if budget is not None:  # rank 0's clock for every rank: the same stop and the same lr
                    elapsed = env.sum({"s": elapsed if env.rank == 0 else 0.0})["s"]
                if budget is not None and elapsed >= budget:
                    state.stopped_reason = "time_budget"
                    log.info("stopping at step %d: the time budget of %.3g min is spent", state.step, t.max_minutes)
                    break
                t0 = time.perf_counter()
                wait0 = stream.wait_s
                batch = stream.next()
                wait = stream.wait_s - wait0
                lr = lr_at(state.step, t, elapsed)
                for g in self.optimizer.param_groups:
                    g["lr"] = lr
                inputs = batch.model_inputs(env.device)
                with self._autocast():
                    _, loss, metrics = self.ddp(**inputs, **self.forward_kwargs)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, t.grad_clip)
                self.optimizer.step()
                state.step += 1
                kill_point(f"train.rank{env.rank}.step")  # drills: DRAFTLINE_FAULT_KILL=train.rank1.step:3

                sums = {k: float(v) for k, v in metrics.items()}
                sums["tokens"] = float(batch.tokens)
                sums = env.sum(sums)
                step_s = time.perf_counter() - t0
                tokens = int(sums["tokens"])
                state.tokens_seen += tokens
                state.train_seconds = seconds_before + time.perf_counter() - session_t0
                r = step_ratios(sums, self.head, t.ttt_steps)
                tps = tokens / step_s if step_s > 0 else 0.0
                rec = {"kind": "train", "step": state.step, "max_steps": t.max_steps,
                       "loss": _r(sums["loss_sum"] / max(sums["loss_total"], 1.0)),
                       "loss_per_pos": [_r(x) for x in r["loss_per_pos"]],
                       "acc_per_pos": [_r(x) for x in r["acc_per_pos"]],
                       "chain_acc_per_pos": [_r(x) for x in r["chain_acc_per_pos"]],
                       "lr": lr, "grad_norm": _r(float(grad_norm)), "tokens": tokens, "tokens_per_s": _r(tps, 1),
                       "step_s": _r(step_s, 4), "data_wait_s": _r(wait, 4), "tflops": _r(tps * self.flops_per_token
                                                                                         / 1e12, 4),
                       "elapsed_s": _r(state.train_seconds, 2)}
                if "expected_acceptance_length" in r:
                    rec["expected_acceptance_length"] = _r(r["expected_acceptance_length"], 4)
                if self.peak_flops:
                    rec["mfu"] = _r(tps * self.flops_per_token / env.world / self.peak_flops, 4)
                state.history.append(rec)
                self._emit(rec)
                if state.step == 1 or state.step % every == 0 or state.step == t.max_steps:
                    log.info("step %d/%d loss %.4f acc %s lr %.3g %.0f tok/s wait %.3fs", state.step, t.max_steps,
                             rec["loss"], rec["acc_per_pos"], lr, tps, wait)
                self.checkpointer.save(state.step, save)
            if state.stopped_reason is None:
                state.stopped_reason = "max_steps"
            self.checkpointer.save(state.step, save, last_step=True)  # a crash during export never retrains
        finally:
            stream.close()
        return state

    # ---------------------------------------------------------------- export
    def export(self, state: RunState) -> ArtifactRef:
        """Evaluate, write the vLLM draft folder and metrics, commit the train artifact (rank 0)."""
        env = self.env
        if env.rank == 0:
            val = self.evaluate()
            self._emit({"kind": "eval", "step": state.step, **val})
            if state.stopped_reason == "time_budget":
                log.warning("training stopped on the time budget (train.max_minutes=%s) at step %d of %d",
                            self.t.max_minutes, state.step, self.t.max_steps)
            stats = {
                "steps": state.step, "max_steps": self.t.max_steps, "tokens": state.tokens_seen,
                "tokens_per_s": _r(state.tokens_seen / state.train_seconds, 1) if state.train_seconds else 0.0,
                "train_seconds": _r(state.train_seconds, 2), "stopped_reason": state.stopped_reason,
                "val_acc_per_pos": val.get("val_acc_per_pos"), "val_loss": val.get("val_loss"),
                "simulated_acceptance_length": val.get("simulated_acceptance_length"),
                "val_tokens": val.get("val_tokens", 0), "heldout_samples": self.heldout_samples,
                "final_loss": state.history[-1]["loss"] if state.history else None,
                "layer_ids": self.inp.layer_ids, "draft_vocab_size": int(self.inp.d2t.shape[0]),
                "head": self.head.label, "head_kind": self.head.kind,
                "trainable_params": sum(p.numel() for p in self.params), "world_size": env.world,
                "device": env.device.type, "precision": self.precision, "attn_impl": self.attn_impl,
                "resumed_from_step": state.resumed_from,
            }
            if self.init_from is not None:
                stats["init_from"] = self.init_from
            metrics = {"steps": state.history, "eval": val, "stopped_reason": state.stopped_reason}
            with owned_temporary_directory("draftline-draft-") as tmp, \
                    self.store.write(STAGE, self.inp.digest, VERSIONS[STAGE], self.inp.inputs,
                                     self.cfg.train.model_dump(mode="json")) as w:
                export_draft(self.model, tmp, self.cfg.target.dtype)
                w.put_file("draft/config.json", os.path.join(tmp, "config.json"))
                w.put_file("draft/model.safetensors", os.path.join(tmp, "model.safetensors"))
                w.write_json("metrics.json", metrics)
                w.commit(stats)
            self._emit({"kind": "done", **stats})
        env.barrier()
        return self.store.open(STAGE, self.inp.digest).ref()


@torch.no_grad()
def evaluate_model(model: Any, batches: Sequence[Batch], device: torch.device, forward_kwargs: dict[str, Any],
                   autocast: Callable[[], Any] = contextlib.nullcontext) -> dict[str, Any]:
    """Loss, per-position accuracy (see `simulated_acceptance_length`) and the simulated
    acceptance length of any Eagle3DraftModel over packed batches; {} without batches."""
    if not batches:
        return {}
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    loss, tokens = 0.0, 0
    dflash = "max_anchors" in forward_kwargs
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(0)  # DFlash samples its anchors: the same ones on every evaluation
            for b in batches:
                with autocast():
                    if dflash:
                        batch_loss, m = _dflash_eval_batch(model, b.model_inputs(device), forward_kwargs)
                    else:
                        _, batch_loss, m = model(**b.model_inputs(device), **forward_kwargs)
                loss += float(batch_loss)
                tokens += b.tokens
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
    finally:
        model.train(was_training)
    r = _ratios(sums, int(model.block_size) - 1 if dflash else int(forward_kwargs.get("ttt_steps", 3)))
    return {"val_loss": _r(loss / len(batches)), "val_acc_per_pos": [_r(a) for a in r["acc_per_pos"]],
            "val_chain_acc_per_pos": [_r(a) for a in r["chain_acc_per_pos"]],
            "simulated_acceptance_length": _r(simulated_acceptance_length(r["acc_per_pos"]), 4), "val_tokens": tokens}


def _dflash_eval_batch(model: Any, inputs: dict[str, torch.Tensor],
                       kw: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """A DFlash head's loss on one batch, and per drafted slot i the share of blocks whose slots 1..i are
    all right (`full_acc_{i-1}`, as EAGLE-3 counts its steps), so `_ratios` gives the same conditional
    accuracies and the benchmark's simulated acceptance length means the same for both kinds."""
    from speculators.models.dflash.metrics import compute_metrics

    _, logits, targets, mask, _ = model._backbone_forward(**inputs, max_anchors=kw["max_anchors"])
    loss, _ = compute_metrics(logits, targets, mask, model.block_size, gamma=kw["gamma"],
                              loss_config=kw["loss_config"], per_position_loss_weight=kw["per_position_loss_weight"],
                              dpace_alpha=kw["dpace_alpha"])
    n = int(model.block_size)
    right = (logits.argmax(-1) == targets.argmax(-1)).reshape(-1, n)[:, 1:]
    valid = mask.to(torch.bool).reshape(-1, n)[:, 1:]
    run = (right & valid).to(torch.int64).cumprod(dim=-1)
    out: dict[str, float] = {}
    for i in range(n - 1):
        out[f"full_acc_{i}_sum"] = float(run[:, i].sum())
        out[f"full_acc_{i}_total"] = float(valid[:, i].sum())
    return loss, out


def export_draft(model: Any, folder: str, dtype: str = "bfloat16") -> None:
    """`folder/config.json` + `folder/model.safetensors` in speculators' format, which vLLM
    loads as an EAGLE-3 draft (`speculative_config={"method": "eagle3", "model": folder}`).
    Weights in `dtype` except d2t/t2d; the verifier's copies (verifier_lm_head/norm) are left out."""
    from safetensors.torch import save_file

    to = getattr(torch, dtype)
    skip = set(getattr(model, "_keys_to_ignore_on_save", None) or [])
    tensors = {}
    for name, value in model.state_dict().items():
        if name in skip or value is None:
            continue
        v = value.detach().cpu()
        tensors[name] = (v.to(to) if v.is_floating_point() else v).contiguous()
    with tempfile.TemporaryDirectory(prefix="draftline-cfg-") as tmp:
        model.config.save_pretrained(tmp)
        config = json.loads(open(os.path.join(tmp, "config.json")).read())
    config.pop("auto_map", None)  # speculators' custom-code hook; vLLM reads the format natively
    config["architectures"] = [type(model).__name__]  # what save_pretrained writes: "Eagle3DraftModel"
    config["dtype"] = dtype
    config["torch_dtype"] = dtype
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def part_cache(store: Store, t: TrainConfig) -> Any:
    """The node's part cache for reads from `store` (None for a local store or train.cache_gib 0)."""
    from tasks.store.part_cache import PartCache, PartCacheError

    try:
        return PartCache.for_store(store, t.cache_gib)
    except PartCacheError as exc:
        raise TrainError(str(exc)) from None


def train_here(cfg: RunConfig, store: Store, vocab_ref: ArtifactRef, extract_refs: list[ArtifactRef],
               on_metrics: MetricsCallback | None = None) -> ArtifactRef:
    """Train (or resume) this head in this process: one rank of `train.gpus`, or the only one."""
    env = DistEnv.from_env(cfg.train)
    try:
        inputs = resolve_inputs(cfg, store, vocab_ref, extract_refs)
        trainer = Trainer(cfg, store, inputs, env, on_metrics)
        state = trainer.fit()
        return trainer.export(state)
    finally:
        env.close()
