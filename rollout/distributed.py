"""Tensor-parallel communication for one scheduler process (no global state: pass a ``TPGroup``)."""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    """This process's place in its engine's tensor-parallel group.

    ``device_group`` carries tensors on the model's device (NCCL on GPU, gloo on CPU);
    ``cpu_group`` (gloo) carries Python objects (requests, control results) between ranks.
    With ``size == 1`` both are None and every collective is a no-op.
    """

    rank: int = 0
    size: int = 1
    device_group: Any = None
    cpu_group: Any = None

    @classmethod
    def init(cls, rank: int, size: int, backend: str, store_path: str, device: torch.device) -> "TPGroup":
        if size == 1:
            return cls()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # no device_id: an eagerly bound default group would make later groups (the weight-update
        # group, which includes the trainer) try to split from it
        dist.init_process_group(backend=backend, init_method=f"file://{store_path}", rank=rank,
                                world_size=size, timeout=datetime.timedelta(minutes=30))
        cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
        return cls(rank=rank, size=size, device_group=dist.group.WORLD, cpu_group=cpu_group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension, in rank order (into ``out`` if given)."""
        if self.size == 1:
            return x if out is None else out.copy_(x)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1, out=out)

    def broadcast_tensor(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size > 1:
            dist.broadcast(x, src=src, group=self.device_group)
        return x

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (over the CPU group)."""
        if self.size == 1:
            return obj
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.cpu_group)
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.cpu_group)
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` as a list on rank 0 (None elsewhere)."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.cpu_group)
        return out

    def all_true(self, flag: bool) -> bool:
        """True on every rank iff ``flag`` is True on every rank."""
        if self.size == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return bool(t.item())

    def destroy(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
