"""The training loop every rank of the train stage runs, read in phases like torchtitan's `train()`:
`Trainer.fit()` loads the newest checkpoint, announces the run, opens the batch stream, then per step asks
the schedule whether to stop and at what rate, takes a batch, steps the optimizer, records the step's
metrics and lets the checkpointer save when due; a final checkpoint when it ends. `Trainer.commit()`
evaluates the held-out batches and writes the draft for vLLM (`save_draft`) as the train artifact.

The components (`Schedule`, `Checkpointer`, `Meter`, `HeldOut`; tasks/train/__init__.py lists every part)
each live in their own module behind a small interface, siblings that share `RunState` and `DistEnv` and
never import each other. `build_trainer` makes the store reads a Trainer needs
(the part reader, the held-out split) and `train_here` is one rank's work: build, fit, commit.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any, Callable

import torch

from tasks.core.config import RunConfig, TrainConfig
from tasks.core.digest import VERSIONS
from tasks.core.faults import kill_point
from tasks.core.owners import owned_temporary_directory
from tasks.store.artifacts import ArtifactRef, Store
from tasks.train import STAGE, MetricsCallback, TrainError, log, rounded
from tasks.train.checkpoints import Checkpointer
from tasks.train.dist import DistEnv
from tasks.train.evaluation import HeldOut, early_check_record
from tasks.train.inputs import TrainInputs, resolve_inputs, train_head
from tasks.train.metrics import Meter
from tasks.train.head_kinds import passes_per_token
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
from tasks.train.schedule import Schedule, lr_at
from tasks.train.state import RunState
from tasks.train.stream import Batch, BatchStream, PartData, PartReader, PartSpec


# train.loss -> speculators' loss of that name (speculators.losses: LK^lambda is `lk_hybrid`, eta 3, LK^alpha `nla`)
LK_LOSSES = {"lk": "lk_hybrid", "lk_alpha": "nla"}


def forward_kwargs(t: TrainConfig) -> dict[str, Any]:
    """The loss settings a head's forward pass takes: speculators' defaults for its kind (EAGLE-3: KL
    divergence over `ttt_steps`; DFlash: cross-entropy, D-PACE position weights, `max_anchors` blocks;
    DSpark, as `speculators train` resolves it: KL divergence with exponentially decaying position weights
    (gamma 4), plus the confidence head's BCE against the total-variation acceptance rate, weight 1).
    `train.loss` lk / lk_alpha swaps the per-position divergence (KL or CE) for an LK loss of arXiv 2602.23881,
    which targets the acceptance rate; the position weights and DSpark's confidence head stay as they are."""
    from speculators.losses import resolve_loss_config

    def loss(default: str) -> Any:
        return resolve_loss_config(LK_LOSSES.get(t.loss, default), t.loss_impl)

    if not t.head.drafts_blocks:
        return {"ttt_steps": t.ttt_steps, "ttt_step_loss_decay": t.ttt_step_loss_decay, "loss_config": loss("kl_div")}
    block = {"gamma": 4.0, "max_anchors": t.head.dflash_settings()["max_anchors"], "dpace_alpha": 0.5}
    if t.head.kind == "dflash":
        return {**block, "loss_config": loss("ce"), "per_position_loss_weight": "dpace"}
    return {**block, "loss_config": loss("kl_div"),
            "tv_loss_fn": resolve_loss_config("tv", t.loss_impl)["tv"][0], "confidence_head_alpha": 1.0,
            "per_position_loss_weight": "fixed-exp-decay"}


def check_device(t: TrainConfig, device: torch.device) -> None:
    """Settings this device cannot train with, as an error naming the fix."""
    if device.type == "cpu" and t.attn_impl == "flex_attention":
        raise TrainError("train.attn_impl flex_attention has no backward pass on CPU; use sdpa (or eager, "
                         "or auto)")
    if device.type == "cpu" and t.loss_impl == "fused":
        raise TrainError("train.loss_impl fused needs Triton on a GPU; use eager on CPU")


class Trainer:
    """One training run over resolved inputs: the model (+DDP) and its optimizer, built here; the parts
    reader and the held-out split it is given (`build_trainer` makes them); the schedule, meter and
    checkpointer it makes around them. `clock` times steps and the budget (`time.perf_counter`)."""

    def __init__(self, cfg: RunConfig, store: Store, inputs: TrainInputs, env: DistEnv,
                 read_part: Callable[[PartSpec], PartData], held_out: HeldOut,
                 on_metrics: MetricsCallback | None = None, clock: Callable[[], float] = time.perf_counter):
        self.cfg, self.t, self.store, self.inp, self.env = cfg, cfg.train, store, inputs, env
        t = self.t
        check_device(t, env.device)
        self.head = train_head(cfg)
        self.read_part, self.held_out, self.parts = read_part, held_out, held_out.parts
        self.precision = resolve_precision(t.precision, env.device)

        # model (auto attention: flex_attention where it compiles for this shape, else sdpa)
        shape = attention_shape(draft_layer_config(t, cfg.target, inputs.target_path, inputs.hf_config,
                                                   kind=self.head.kind))
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

        # optimizer (lr is set every step from the schedule)
        self.optimizer = torch.optim.AdamW(self.params, lr=lr_at(0, t), weight_decay=t.weight_decay)
        self.forward_kwargs = forward_kwargs(t)

        # the components the loop calls
        self.schedule = Schedule(t, env, clock)
        self.meter = Meter(t, self.head, env, self.flops_per_token, on_metrics, clock, self.schedule.train_seconds)
        self.peak_flops = self.meter.peak_flops
        self.checkpointer = Checkpointer(store, inputs.digest, t, env, self.model, self.optimizer, self.names,
                                         on_saved=self.meter.emit)

    # ---------------------------------------------------------------- helpers
    def passes_per_token(self) -> float:
        """Draft decoder passes per trained token (tasks.train.head_kinds.passes_per_token)."""
        return passes_per_token(self.head, self.t)

    def _autocast(self):
        if self.precision == "bf16":
            return torch.autocast(self.env.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def evaluate(self, by_length: bool = False) -> dict[str, Any]:
        """Held-out loss, per-position accuracy and simulated acceptance length (rank 0's view); by_length: also
        per context-length bucket (the final evaluation: the benchmark's by-length table sets it beside vLLM's)."""
        return self.held_out.evaluate(self.model, self.env.device, self.forward_kwargs, self._autocast, by_length)

    # ---------------------------------------------------------------- the loop's phases
    def announce(self, state: RunState) -> None:
        """The run's log lines and its `start` record."""
        t, env = self.t, self.env
        n_params = sum(p.numel() for p in self.params)
        log.info("train %s: %d trainable parameters, %.3g FLOPs/token, device %s x%d, %s attention, %s, %d parts, "
                 "%d held-out samples", self.inp.digest, n_params, self.flops_per_token, env.device, env.world,
                 self.attn_impl, self.precision, len(self.parts), self.held_out.samples)
        log.info("train config: %s", json.dumps(t.model_dump(mode="json"), sort_keys=True))
        self.meter.emit({"kind": "start", "digest": self.inp.digest, "max_steps": t.max_steps, "step": state.step,
                         "resumed_from": state.resumed_from, "trainable_params": n_params,
                         "flops_per_token": self.flops_per_token, "peak_flops": self.peak_flops,
                         "device": str(env.device), "world_size": env.world, "layer_ids": self.inp.layer_ids,
                         "attn_impl": self.attn_impl, "attn_fallback": self.attn_fallback,
                         "precision": self.precision, "init_from": self.init_from})

    def open_stream(self, state: RunState) -> BatchStream:
        """This rank's batches from where the checkpoint left them (the epoch after, on another rank count)."""
        t, env = self.t, self.env
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
        stream = BatchStream(self.parts, self.read_part, batch_tokens=t.batch_tokens, seed=t.seed, rank=env.rank,
                             world=env.world, prefetch=t.prefetch, position=position,
                             pin_memory=env.device.type == "cuda")
        share = stream.share()
        log.info("data: rank %d of %d reads %d of %d parts every epoch%s", env.rank, env.world, len(share),
                 len(self.parts),
                 "" if len(share) == len(self.parts) else " (parts dealt to ranks once; the deal holds across epochs)")
        return stream

    def train_step(self, batch: Batch, lr: float) -> tuple[dict[str, Any], torch.Tensor]:
        """Forward, backward, clip, optimizer step at `lr`: the step's metrics (this rank's) and grad norm."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        inputs = batch.model_inputs(self.env.device)
        with self._autocast():
            _, loss, metrics = self.ddp(**inputs, **self.forward_kwargs)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.t.grad_clip)
        self.optimizer.step()
        return metrics, grad_norm

    # ---------------------------------------------------------------- the loop
    def fit(self) -> RunState:
        state = self.checkpointer.load()
        self.announce(state)
        if state.stopped_reason == "time_budget" or state.step >= self.t.max_steps:
            return state  # the last run already finished training; only eval and the commit remain
        stream = self.open_stream(state)
        self.schedule.start(state.train_seconds)
        try:
            while state.step < self.t.max_steps:
                if self.schedule.stop_now(state.step):
                    state.stopped_reason = "time_budget"
                    break
                self.meter.begin(stream)
                batch = stream.next()
                lr = self.schedule.lr(state.step)
                metrics, grad_norm = self.train_step(batch, lr)
                state.step += 1
                kill_point(f"train.rank{self.env.rank}.step")  # drills: DRAFTLINE_FAULT_KILL=train.rank1.step:3
                self.meter.record(state, metrics, batch.tokens, lr, grad_norm)
                if state.step == self.t.early_check_step:
                    self.early_check(state)
                self.checkpointer.save(state, stream)
            if state.stopped_reason is None:
                state.stopped_reason = "max_steps"
            self.checkpointer.save(state, stream, last_step=True)  # a crash during the commit never retrains
        finally:
            stream.close()
        return state

    def early_check(self, state: RunState) -> None:
        """The held-out figures at train.early_check_step (rank 0; the other ranks wait in their next step's
        all-reduce): kept in the run's state (checkpoints carry it), emitted, and a warning when under the
        head's early_check_min_acceptance. The evaluation forks the RNG, so training goes on as without it."""
        if self.env.rank != 0:
            return
        threshold = self.head.early_check_min_acceptance or self.t.early_check_min_acceptance  # the head's first
        rec = early_check_record(self.evaluate(), state.step, threshold)
        state.early_check = {k: v for k, v in rec.items() if k != "kind"}
        self.meter.emit(rec)
        if rec["below"]:
            log.warning("early check at step %d: held-out simulated acceptance length %s is under %s "
                        "(train.early_check_min_acceptance): this head is not on course", state.step,
                        rec["simulated_acceptance_length"], rec["threshold"])
        else:
            log.info("early check at step %d: held-out simulated acceptance length %s (threshold %s)", state.step,
                     rec["simulated_acceptance_length"], rec["threshold"])

    # ---------------------------------------------------------------- commit
    def commit(self, state: RunState) -> ArtifactRef:
        """Evaluate, write the vLLM draft folder and metrics, commit the train artifact (rank 0)."""
        env = self.env
        if env.rank == 0:
            val = self.evaluate(by_length=True)
            self.meter.emit({"kind": "eval", "step": state.step, **{k: v for k, v in val.items() if k != "val_by_length"}})
            if state.stopped_reason == "time_budget":
                log.warning("training stopped on the time budget (train.max_minutes=%s) at step %d of %d",
                            self.t.max_minutes, state.step, self.t.max_steps)
            stats = {
                "steps": state.step, "max_steps": self.t.max_steps, "tokens": state.tokens_seen,
                "tokens_per_s": rounded(state.tokens_seen / state.train_seconds, 1) if state.train_seconds else 0.0,
                "train_seconds": rounded(state.train_seconds, 2), "stopped_reason": state.stopped_reason,
                "val_acc_per_pos": val.get("val_acc_per_pos"), "val_loss": val.get("val_loss"),
                "simulated_acceptance_length": val.get("simulated_acceptance_length"),
                "val_by_length": val.get("val_by_length"),
                "val_tokens": val.get("val_tokens", 0), "heldout_samples": self.held_out.samples,
                "final_loss": state.history[-1]["loss"] if state.history else None,
                "layer_ids": self.inp.layer_ids, "draft_vocab_size": int(self.inp.d2t.shape[0]),
                "head": self.head.label, "head_kind": self.head.kind,
                "trainable_params": sum(p.numel() for p in self.params), "world_size": env.world,
                "device": env.device.type, "precision": self.precision, "attn_impl": self.attn_impl,
                "resumed_from_step": state.resumed_from, "early_check": state.early_check,
            }
            if self.init_from is not None:
                stats["init_from"] = self.init_from
            metrics = {"steps": state.history, "eval": val, "stopped_reason": state.stopped_reason}
            with owned_temporary_directory("draft") as tmp, \
                    self.store.write(STAGE, self.inp.digest, VERSIONS[STAGE], self.inp.inputs,
                                     self.cfg.train.model_dump(mode="json")) as w:
                save_draft(self.model, tmp, self.cfg.target.dtype)
                w.put_file("draft/config.json", os.path.join(tmp, "config.json"))
                w.put_file("draft/model.safetensors", os.path.join(tmp, "model.safetensors"))
                w.write_json("metrics.json", metrics)
                w.commit(stats)
            self.meter.emit({"kind": "done", **stats})
        env.barrier()
        return self.store.open(STAGE, self.inp.digest).ref()


def save_draft(model: Any, folder: str, dtype: str = "bfloat16") -> None:
    """`folder/config.json` + `folder/model.safetensors` in speculators' format, which vLLM
    loads as an EAGLE-3 draft (`speculative_config={"method": "eagle3", "model": folder}`); an MLA draft's
    config flat, as vLLM's deepseek_eagle3 loads it (`mla_draft_config`).
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
    with owned_temporary_directory("cfg") as tmp:
        model.config.save_pretrained(tmp)
        config = json.loads(open(os.path.join(tmp, "config.json")).read())
    config.pop("auto_map", None)  # speculators' custom-code hook; vLLM reads the format natively
    config["architectures"] = [type(model).__name__]  # what save_pretrained writes: "Eagle3DraftModel"
    config["dtype"] = dtype
    config["torch_dtype"] = dtype
    if (config.get("transformer_layer_config") or {}).get("model_type") == "deepseek_v3":  # an eagle3-mla head
        from tasks.formats.drafts import mla_draft_config

        config = mla_draft_config(config)
    if config.get("speculators_model_type") == "dspark":  # the fc size vLLM 0.26 reads (tasks/formats/drafts.py)
        from tasks.formats.drafts import dspark_vllm_config

        config = dspark_vllm_config(config)
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


def build_trainer(cfg: RunConfig, store: Store, inputs: TrainInputs, env: DistEnv,
                  on_metrics: MetricsCallback | None = None,
                  load_part: Callable[[PartSpec], PartData] | None = None,
                  clock: Callable[[], float] = time.perf_counter) -> Trainer:
    """A Trainer with the store reads it needs: the part reader (through the node's part cache; `load_part`
    replaces it) and the held-out split, which reads the last part."""
    check_device(cfg.train, env.device)  # before the first read: a setting this device lacks fails at once
    read_part = load_part or PartReader(inputs.artifacts, inputs.stored_layer_ids or inputs.layer_ids,
                                        inputs.hidden_size, keep=inputs.layer_ids,
                                        cache=part_cache(store, cfg.train), dequantize=False)
    held_out = HeldOut.split(inputs.parts, read_part, inputs.total_samples, cfg.train)
    return Trainer(cfg, store, inputs, env, read_part, held_out, on_metrics, clock)


def train_here(cfg: RunConfig, store: Store, vocab_ref: ArtifactRef, extract_refs: list[ArtifactRef],
               on_metrics: MetricsCallback | None = None, *, digest: str | None = None) -> ArtifactRef:
    """Train (or resume) this head in this process: one rank of `train.gpus`, or the only one; DIGEST: the
    train artifact's address when the caller has it (`resolve_inputs` computes it otherwise)."""
    env = DistEnv.from_env(cfg.train)
    try:
        inputs = resolve_inputs(cfg, store, vocab_ref, extract_refs, digest=digest)
        trainer = build_trainer(cfg, store, inputs, env, on_metrics)
        state = trainer.fit()
        return trainer.commit(state)
    finally:
        env.close()
