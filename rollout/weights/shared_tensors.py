"""Tensors shared with the scheduler processes without copying them through ZeroMQ.

CUDA tensors travel as CUDA IPC handles; CPU tensors are copied once into one POSIX shared-memory
buffer (the flattened-bucket layout of ``rollout.weights.buckets``) that the schedulers map. ``share`` runs
in the process that holds the tensors, ``open_shared`` in each scheduler.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from rollout.dtypes import dtype_name
from rollout.weights.buckets import TensorSpec, unflatten

# rebuild_cuda_tensor's arguments (torch.multiprocessing.reductions): index of the storage's device
_IPC_STORAGE_DEVICE = 6


def share(named: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, str, list[int]]], Any, Callable[[], None]]:
    """(specs, payload, cleanup): call ``cleanup`` once every receiver is done."""
    if not named:
        raise ValueError("no tensors to update")
    specs = [(name, dtype_name(t.dtype), list(t.shape)) for name, t in named]
    tensors = [t.detach() for _, t in named]
    if all(t.is_cuda for t in tensors):
        from torch.multiprocessing.reductions import reduce_tensor

        tensors = [t.contiguous() for t in tensors]
        payload = ("cuda_ipc", [reduce_tensor(t)[1] for t in tensors])
        return specs, payload, lambda: tensors.clear()
    if any(t.is_cuda for t in tensors):
        raise ValueError("update_weights_from_tensor takes all-CUDA or all-CPU tensors, not a mix")
    from multiprocessing import shared_memory

    total = sum(t.numel() * t.element_size() for t in tensors)
    shm = shared_memory.SharedMemory(create=True, size=max(total, 1))
    flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=total)
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        flat[offset:offset + n].copy_(t.contiguous().view(-1).view(torch.uint8))
        offset += n
    del flat

    def cleanup() -> None:
        shm.close()
        shm.unlink()

    return specs, ("shm", shm.name), cleanup


def open_shared(specs: list[TensorSpec], payload: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a ``share`` payload, in a scheduler: ("cuda_ipc", [rebuild args]) or ("shm", name)."""
    kind, data = payload
    if kind == "cuda_ipc":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return [(spec.name, rebuild_cuda_tensor(*args)) for spec, args in zip(specs, data)]
    if kind == "shm":
        from multiprocessing import resource_tracker, shared_memory

        shm = shared_memory.SharedMemory(name=data, create=False)
        resource_tracker.unregister(shm._name, "shared_memory")  # the sender owns and unlinks it
        try:
            flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=sum(s.nbytes for s in specs))
            tensors = [(n, t.clone()) for n, t in unflatten(flat, specs)]
            del flat  # release the buffer export before closing the mapping
            return tensors
        finally:
            shm.close()
    raise ValueError(f"unknown shared tensor payload {kind!r}")


def ipc_args_on_device(ipc_handle: Any, device_index: int) -> tuple:
    """The ``rebuild_cuda_tensor`` arguments of ``reduce_tensor(t)`` (``ipc_handle``), with the storage device
    replaced by ``device_index``: a trainer may number its GPUs differently from the engine (its own
    CUDA_VISIBLE_DEVICES), so the index in its handle is not the engine's. torch has no public API to
    re-target a handle; this positional rewrite is the one place that relies on the argument layout (as
    OpenRLHF's and vLLM's CUDA-IPC weight loaders do)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    func, args = ipc_handle
    if func is not rebuild_cuda_tensor:
        raise ValueError("ipc_handle must come from reduce_tensor() of a CUDA tensor")
    args = list(args)
    args[_IPC_STORAGE_DEVICE] = device_index
    return tuple(args)
