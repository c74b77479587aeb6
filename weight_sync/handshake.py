"""A trainer's side of a weight-update group's life: join it with the engines, leave it with them.

Every trainer that broadcasts into engines (``WeightSender``, ``broadcast_to_engines``) runs these steps
around its pushes: each engine joins asynchronously while the trainer joins as rank 0 (both block until
everyone has), and at the end both sides leave together (NCCL's destroy is collective).
"""

from __future__ import annotations

from typing import Any, Sequence

from rollout.ipc import free_port
from rollout.weights.group import destroy_process_group, init_process_group


def join_engines(engines: Sequence[Any], group_name: str, *, backend: str, tp_size: int = 1,
                 host: str = "127.0.0.1", port: int | None = None, timeout: float | None = 300.0) -> Any:
    """The weight-update group ``group_name`` of this process (rank 0) and every TP rank of ``engines``
    (engine i's ranks from ``1 + i * tp_size``), at ``host:port`` (a free port unless given). ``engines``:
    anything with the engine's ``init_process_group(..., async_op=True)`` (``Engine``, ``RemoteEngine``,
    ``trainer_adapters.ActorEngine``). ``timeout`` (seconds) bounds the rendezvous and every collective, on
    both sides. Returns the group once every rank has joined."""
    port = free_port() if port is None else port
    world = 1 + len(engines) * tp_size
    joined = [e.init_process_group(host, port, 1 + i * tp_size, world, group_name, backend=backend, timeout=timeout,
                                   async_op=True) for i, e in enumerate(engines)]
    group = init_process_group(host, port, 0, world, group_name, backend=backend, timeout=timeout)
    for fut in joined:
        fut.result()
    return group


def leave_engines(engines: Sequence[Any], group: Any, group_name: str) -> None:
    """Leave ``group`` on both sides together. Call it only after the group's last transfer succeeded: an NCCL
    group cannot be left after a failed collective without risking a hang (the engines drop a group whose
    transfer failed on their own)."""
    left = [e.destroy_process_group(group_name, async_op=True) for e in engines]
    destroy_process_group(group)
    for fut in left:
        fut.result()
