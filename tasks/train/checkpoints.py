"""Training checkpoints: what one holds, how it is loaded, when one is written and which are kept. The loop
calls the `Checkpointer` as `load()` before its steps, `save(state, stream)` after every step and
`save(state, stream, last_step=True)` when it ends.

Cadence: every `train.checkpoint_every` steps before the last, and once at the end unless that step is
already saved (so a crash during evaluation or the commit never retrains). Retention: the newest
`train.keep_checkpoints` of this train address (`checkpoint/<train digest[:20]>-s<step>`), older ones deleted
after a new one is committed. A checkpoint is one artifact, committed whole or not at all: the trainable
weights (`model.safetensors`, fp32), the optimizer's tensors (`optimizer.safetensors`, `<param>::<key>`) and
`state.json` (step, tokens, training seconds, every rank's data position and RNG state, the parameter names,
optimizer groups, the lr, the metrics history). `load()` takes the newest readable one (a corrupt one is
skipped for the one before it), restores weights, optimizer and, on the same number of ranks, each rank's
RNG; parameter names that differ from the model's mean the code changed without a `VERSIONS` bump.
"""

from __future__ import annotations

import base64
import json
import os
import random
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from tasks.core.config import TrainConfig
from tasks.core.digest import VERSIONS
from tasks.core.faults import kill_point
from tasks.core.owners import owned_temporary_directory
from tasks.store.artifacts import ArtifactCorrupt, Store
from tasks.train import CKPT_STAGE, TrainError, log
from tasks.train.dist import DistEnv
from tasks.train.state import RunState

if TYPE_CHECKING:
    from tasks.train.stream import BatchStream


def checkpoint_digest(digest: str, step: int) -> str:
    return f"{digest[:20]}-s{step:08d}"


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


class Checkpointer:
    """The checkpoints of one train address: the trainable parameters `names` of `model`, `optimizer`, and
    the run state; `on_saved(record)` hears of each one written (the metrics' emit)."""

    def __init__(self, store: Store, train_digest: str, train: TrainConfig, env: DistEnv, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, names: list[str],
                 on_saved: Callable[[dict[str, Any]], None] | None = None):
        self.store, self.train_digest, self.t, self.env = store, train_digest, train, env
        self.model, self.optimizer, self.names, self.on_saved = model, optimizer, names, on_saved
        self.every, self.keep, self.max_steps = train.checkpoint_every, train.keep_checkpoints, train.max_steps
        self.last_saved = -1

    def checkpoints(self) -> list[tuple[int, str]]:
        """(step, digest) of this train address's committed checkpoints, oldest first."""
        prefix = self.train_digest[:20] + "-s"
        out = []
        for m in self.store.list(CKPT_STAGE):
            if m.digest.startswith(prefix) and m.inputs.get("train") == self.train_digest:
                out.append((int(m.stats.get("step", -1)), m.digest))
        return sorted(out)

    def save(self, state: RunState, stream: "BatchStream | None", last_step: bool = False) -> str | None:
        """Write a checkpoint of `state.step` when one is due (every rank calls this: it gathers the ranks'
        data positions and RNG states); its digest, else None."""
        step = state.step
        due = self.last_saved != step if last_step else step % self.every == 0 and step < self.max_steps
        if not due:
            return None
        digest = self.write(state, stream)
        self.last_saved = step
        return digest

    def prune(self) -> None:
        """Delete all but the newest `keep` checkpoints (rank 0, after a commit)."""
        for _step, old in self.checkpoints()[:-self.keep]:
            self.store.delete(CKPT_STAGE, old)

    def write(self, state: RunState, stream: "BatchStream | None") -> str:
        """A checkpoint of `state` now (rank 0 writes it, every rank waits for it)."""
        from safetensors.torch import save_file

        env = self.env
        positions = env.gather(stream.position if stream is not None else None)
        rngs = env.gather(rng_state(env.device))
        digest = checkpoint_digest(self.train_digest, state.step)
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
                # the lr the last step used (under max_minutes it follows the clock, not the step): the loop
                # sets it on the optimizer's groups before each step, and the optimizer starts at the first one
                "scheduler": {"kind": "warmup_cosine", "step": state.step, "by_clock": self.t.max_minutes is not None,
                              "lr": state.history[-1]["lr"] if state.history else groups[0]["lr"]},
                "stopped_reason": state.stopped_reason, "history": state.history, "train_digest": self.train_digest,
                "early_check": state.early_check,
            }
            with owned_temporary_directory("ckpt") as tmp, \
                    self.store.write(CKPT_STAGE, digest, VERSIONS[CKPT_STAGE], {"train": self.train_digest},
                                     {"step": state.step}) as w:
                save_file(weights, os.path.join(tmp, "m.safetensors"))
                w.put_file("model.safetensors", os.path.join(tmp, "m.safetensors"))
                kill_point("train.checkpoint-file")
                save_file(opt_tensors, os.path.join(tmp, "o.safetensors"))
                w.put_file("optimizer.safetensors", os.path.join(tmp, "o.safetensors"))
                w.write_json("state.json", meta)
                w.commit({"step": state.step, "tokens_seen": state.tokens_seen})
            self.prune()
        env.barrier()
        if self.on_saved is not None:
            self.on_saved({"kind": "checkpoint", "step": state.step, "digest": digest})
        return digest

    def load(self) -> RunState:
        """The newest committed checkpoint of this run, loaded into the model, the optimizer and this
        process's RNG; a fresh state if there is none. Later saves count from the step it resumes."""
        from safetensors.torch import load as st_load

        for step, digest in reversed(self.checkpoints()):
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
                          stopped_reason=meta.get("stopped_reason"), resumed_from=step,
                          early_check=meta.get("early_check"))
            if rs.world == self.env.world and rs.rng:
                set_rng_state(rs.rng[self.env.rank], self.env.device)
            log.info("resumed from checkpoint %s (step %d)", art.uri, rs.step)
            self.last_saved = rs.step
            return rs
        self.last_saved = -1
        return RunState(world=self.env.world)
