"""Weight-update process groups: the trainer (rank 0) and every TP rank of every engine
(``rank_offset + r``), formed by TCP rendezvous with no default group on either side.

``init_process_group`` is used by both sides (``weight_sync.init_process_group`` on the trainer); the group
it returns works with plain ``torch.distributed.broadcast(tensor, 0, group=group)``. ``WeightGroups`` is an
engine rank's registry of the groups it joined.
"""

from __future__ import annotations

import datetime
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

DEFAULT_TIMEOUT_S = 600.0


def init_process_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                       backend: str = "nccl", timeout: datetime.timedelta | float | None = None) -> Any:
    """Join the group ``group_name`` by TCP rendezvous at ``master_address:master_port`` (rank 0 hosts it).

    ``backend`` is "nccl" (GPU) or "gloo" (CPU); ``timeout`` (a timedelta or seconds) bounds the
    rendezvous and every collective on the group. Blocks until all ``world_size`` ranks have joined.
    """
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of {world_size}")
    timeout = _as_timedelta(timeout)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{master_address}:{int(master_port)}", rank, world_size,
                                                   timeout=timeout))
    store.set_timeout(timeout)
    return _new_group(dist.PrefixStore(group_name, store), rank, world_size, group_name, backend, timeout)


def _new_group(store: Any, rank: int, world_size: int, group_name: str, backend: str,
               timeout: datetime.timedelta) -> Any:
    """The one use of torch's private c10d API. torch has no public way to make a process group that is not
    split from the default group, and the weight-update group must span processes (trainer + engines) that
    have no common default group; ``dist.broadcast(..., group=g)`` then needs ``g`` registered in c10d's
    world with its rank map. This is what OpenRLHF's and vLLM's stateless weight-sync groups do too."""
    kwargs: dict[str, Any] = {"group_name": group_name, "timeout": timeout}
    if "group_desc" in inspect.signature(c10d._new_process_group_helper).parameters:
        kwargs["group_desc"] = group_name
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], backend, store, **kwargs)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_process_group(group: Any) -> None:
    """Leave and free a group made by ``init_process_group`` (also after a peer died: a broken group may
    refuse a clean teardown, and is then only unregistered)."""
    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001
        for registry in (c10d._world.pg_group_ranks, c10d._world.pg_map, c10d._world.pg_names):
            registry.pop(group, None)


def _as_timedelta(timeout: datetime.timedelta | float | None) -> datetime.timedelta:
    if timeout is None:
        return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


@dataclass
class WeightGroups:
    """The weight-update groups one engine rank joined, by name, with their timeouts; ``last`` is the group a
    call without a group name uses (OpenRLHF's per-tensor calls name none)."""

    groups: dict[str, Any] = field(default_factory=dict)
    timeouts: dict[str, float] = field(default_factory=dict)
    last: str | None = None

    def join(self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
             backend: str, timeout: float | None, device_type: str) -> None:
        if group_name in self.groups:
            raise ValueError(f"a weight-update group named {group_name!r} already exists; destroy it first")
        if backend == "nccl" and device_type != "cuda":
            raise ValueError("backend 'nccl' needs a CUDA device; use backend='gloo' on CPU")
        timeout_s = float(timeout) if timeout is not None else DEFAULT_TIMEOUT_S
        self.groups[group_name] = init_process_group(master_address, master_port, rank, world_size, group_name,
                                                     backend, timeout_s)
        self.timeouts[group_name] = timeout_s
        self.last = group_name

    def get(self, group_name: str | None) -> tuple[str, Any]:
        """(name, group) of ``group_name`` (None: the last joined); ValueError when there is no such group."""
        name = group_name or self.last
        if name is None or name not in self.groups:
            known = sorted(self.groups) or "none"
            raise ValueError(f"weight-update group {group_name!r} is not initialized (groups: {known}); "
                             "call init_process_group first")
        return name, self.groups[name]

    def timeout(self, group_name: str | None) -> float:
        return self.timeouts.get(group_name or "", DEFAULT_TIMEOUT_S)

    def leave(self, group_name: str) -> None:
        """Destroy a group this rank joined (ValueError if there is none by that name)."""
        if group_name not in self.groups:
            raise ValueError(f"no weight-update group named {group_name!r}")
        self.drop(group_name)

    def drop(self, group_name: str | None) -> None:
        """Forget and tear down a group whose trainer is gone, if it is registered."""
        group = self.groups.pop(group_name, None)
        self.timeouts.pop(group_name, None)
        if self.last == group_name:
            self.last = next(iter(self.groups), None)
        if group is not None:
            destroy_process_group(group)

    def names(self) -> list[str]:
        return sorted(self.groups)
