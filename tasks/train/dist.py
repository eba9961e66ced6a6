"""A rank's distributed environment: `DistEnv` (rank, world, device; the process group under torchrun)
and the collectives the training loop and its components use (sum, any, gather, barrier)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from tasks.core.config import TrainConfig
from tasks.train import TrainError, wants_cuda


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
        """Every rank's OBJ (a JSON value), on every rank. Sent as JSON bytes in plain tensors: nothing a peer
        sends is unpickled (all_gather_object would unpickle whatever a rank, or a stranger in its place, sent)."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        data = json.dumps(obj).encode()
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(self.world)]
        dist.all_gather(sizes, size)
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine)
        return [json.loads(bytes(t[:int(n)].cpu().numpy())) for t, n in zip(out, sizes)]

    def close(self) -> None:
        if self.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.owns_group = False
