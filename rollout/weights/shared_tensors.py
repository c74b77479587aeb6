"""Tensors shared with the scheduler processes without copying them through ZeroMQ.

CUDA tensors travel as CUDA IPC handles; CPU tensors are copied once into one POSIX shared-memory
buffer (the flattened-bucket layout of ``rollout.weights.buckets``) that the schedulers map. ``share`` runs
in the process that holds the tensors, ``open_shared`` in each scheduler.

A colocated trainer pushes the same parameters every step, and exporting a handle (sender) and mapping it
(receiver, ``cudaIpcOpenMemHandle``) cost more than copying a small tensor. So both sides remember the
last push: ``IpcHandleCache`` keeps each live tensor's ``reduce_tensor`` result and marks the tensors it
has shared before (a trainer's parameters, not freshly gathered buckets); ``OpenedIpcTensors`` keeps the
mappings of those marked tensors only, so a trainer's temporaries are not held open. Reuse is safe because
the sender synchronizes its device before sending (payload kind "cuda_ipc_synced": the receiver need not
wait on IPC events) and a receiver that holds a mapping keeps the sender's block from being reused
(torch's IPC reference count).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from rollout.dtypes import dtype_name
from rollout.weights.buckets import TensorSpec, unflatten

# rebuild_cuda_tensor's arguments (torch.multiprocessing.reductions): index of the storage's device
_IPC_STORAGE_DEVICE = 6


class IpcHandleCache:
    """The sender's ``reduce_tensor`` results of the last push, reused while each tensor's storage lives
    at the same address (keyed by storage, data pointer, offset, shape, stride and dtype)."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[Any, tuple]] = {}

    def export(self, tensors: list[torch.Tensor]) -> list[tuple[tuple, bool]]:
        """(``rebuild_cuda_tensor`` arguments, shared before) of each tensor; entries of tensors not in
        this push are dropped."""
        from torch.multiprocessing.reductions import StorageWeakRef, reduce_tensor

        entries, out = {}, []
        for t in tensors:
            storage = t.untyped_storage()
            key = (storage._cdata, storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            hit = self._entries.get(key) or entries.get(key)
            reused = hit is not None and not hit[0].expired()
            if not reused:
                hit = (StorageWeakRef(storage), reduce_tensor(t)[1])
            entries[key] = hit
            out.append((hit[1], reused))
        self._entries = entries
        return out


class OpenedIpcTensors:
    """The receiver's tensors rebuilt from handles the sender marked as shared before, reused when the
    same handles come again; mappings not in the newest push are closed (dropped)."""

    def __init__(self) -> None:
        self._tensors: dict[tuple, torch.Tensor] = {}

    def open(self, exported: list[tuple[tuple, bool]]) -> list[torch.Tensor]:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        kept, out = {}, []
        for args, reused in exported:
            t = self._tensors.get(args)
            if t is None:
                t = kept.get(args)
            if t is None:
                t = rebuild_cuda_tensor(*args)
            if reused:
                kept[args] = t
            out.append(t)
        self._tensors = kept
        return out

    def clear(self) -> None:
        self._tensors = {}


def share(named: list[tuple[str, torch.Tensor]], handles: IpcHandleCache | None = None
          ) -> tuple[list[tuple[str, str, list[int]]], Any, Callable[[], None]]:
    """(specs, payload, cleanup): call ``cleanup`` once every receiver is done. CUDA tensors: the device
    is synchronized first, so the receivers read finished values; ``handles`` reuses earlier exports."""
    if not named:
        raise ValueError("no tensors to update")
    specs = [(name, dtype_name(t.dtype), list(t.shape)) for name, t in named]
    tensors = [t.detach() for _, t in named]
    if all(t.is_cuda for t in tensors):
        tensors = [t.contiguous() for t in tensors]
        for device in {t.device for t in tensors}:
            torch.cuda.synchronize(device)
        payload = ("cuda_ipc_synced", (handles or IpcHandleCache()).export(tensors))
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


def open_shared(specs: list[TensorSpec], payload: Any, opened: OpenedIpcTensors | None = None
                ) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a ``share`` payload, in a scheduler: ("cuda_ipc_synced" | "cuda_ipc", [rebuild args])
    or ("shm", name: views of the sender's buffer, no copy). ``opened`` keeps "cuda_ipc_synced" mappings
    for the next push."""
    kind, data = payload
    if kind == "cuda_ipc_synced":
        return list(zip((spec.name for spec in specs), (opened or OpenedIpcTensors()).open(data)))
    if kind == "cuda_ipc":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return [(spec.name, rebuild_cuda_tensor(*args)) for spec, args in zip(specs, data)]
    if kind == "shm":  # views of the sender's buffer, mapped by torch (unmapped when the last view dies)
        nbytes = sum(s.nbytes for s in specs)
        flat = torch.from_file(f"/dev/shm/{data.lstrip('/')}", shared=True, size=max(nbytes, 1), dtype=torch.uint8)
        return unflatten(flat[:nbytes], specs)
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
