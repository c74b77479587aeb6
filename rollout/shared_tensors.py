"""Sharing tensors with the scheduler processes without copying through ZeroMQ.

CUDA tensors travel as CUDA IPC handles; CPU tensors are copied once into one POSIX shared-memory
buffer (SGLang's flattened-bucket layout) that the schedulers map.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def share(named: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, str, list[int]]], Any, Callable[[], None]]:
    """(specs, payload, cleanup): call ``cleanup`` once every receiver is done."""
    if not named:
        raise ValueError("no tensors to update")
    specs = [(name, str(t.dtype).replace("torch.", ""), list(t.shape)) for name, t in named]
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
