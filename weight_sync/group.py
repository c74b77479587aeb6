"""A named process group for weight updates that needs (and touches) no default group.

Both sides use it: the trainer joins as rank 0, TP rank ``r`` of an engine as ``rank_offset + r``.
The returned group works with plain ``torch.distributed.broadcast(tensor, 0, group=group)``.
"""

from __future__ import annotations

import datetime
import inspect
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


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
    url = f"tcp://{master_address}:{int(master_port)}"
    store, rank, world_size = next(c10d.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore(group_name, store)
    kwargs: dict[str, Any] = {"group_name": group_name, "timeout": timeout}
    params = inspect.signature(c10d._new_process_group_helper).parameters
    if "group_desc" in params:
        kwargs["group_desc"] = group_name
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], backend, store, **kwargs)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_process_group(group: Any) -> None:
    """Leave and free a group made by ``init_process_group`` (also after a peer died)."""
    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - a broken group may refuse a clean teardown
        c10d._world.pg_group_ranks.pop(group, None)
        c10d._world.pg_map.pop(group, None)
        c10d._world.pg_names.pop(group, None)


def _as_timedelta(timeout: datetime.timedelta | float | None) -> datetime.timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))
