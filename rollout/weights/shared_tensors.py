"""Tensors shared with the scheduler processes without copying them through ZeroMQ.

CUDA tensors travel as CUDA IPC handles, under the protocol of ``rollout.weights.ipc_protocol`` (each
storage exported once per push at most, mappings kept while the trainer reuses them); CPU tensors are copied
once into one POSIX shared-memory buffer (the flattened-bucket layout of ``rollout.weights.buckets``) that the
schedulers map. ``share`` runs in the process that holds the tensors, ``open_shared`` and ``close_shared`` in
each scheduler.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from rollout.dtypes import dtype_name
from rollout.weights.buckets import TensorSpec, unflatten
from rollout.weights.ipc_protocol import IpcHandleCache, OpenedIpcTensors

# rebuild_cuda_tensor's arguments (torch.multiprocessing.reductions): index of the storage's device
_IPC_STORAGE_DEVICE = 6


def share(named: list[tuple[str, torch.Tensor]], handles: IpcHandleCache | None = None, ends_push: bool = True
          ) -> tuple[list[tuple[str, str, list[int]]], Any, Callable[[bool], None]]:
    """(specs, payload, done): call ``done(ok)`` once every receiver has replied (``ok``: all succeeded).
    CUDA tensors: the devices are synchronized first, so the receivers read finished values; ``handles``
    (one receiver unless given) remembers what the receivers have open; ``ends_push``: this call completes
    the update (``ipc_protocol``)."""
    if not named:
        raise ValueError("no tensors to update")
    for name, t in named:
        if t.is_meta or t.layout != torch.strided:
            raise ValueError(f"{name!r} is a {'meta' if t.is_meta else str(t.layout)} tensor: it has no dense values "
                             f"to send")
    specs = [(name, dtype_name(t.dtype), list(t.shape)) for name, t in named]
    tensors = [t.detach() for _, t in named]
    if all(t.is_cuda for t in tensors):
        tensors = [t.contiguous() for t in tensors]
        for device in {t.device for t in tensors}:
            torch.cuda.synchronize(device)
        handles = IpcHandleCache() if handles is None else handles
        payload = ("cuda_ipc_synced", handles.export(tensors, ends_push))

        def done(ok: bool) -> None:
            tensors.clear()
            if not ok:
                handles.reset()

        return specs, payload, done
    if any(t.is_cuda for t in tensors):
        raise ValueError("update_weights_from_tensor takes all-CUDA or all-CPU tensors, not a mix")
    from multiprocessing import shared_memory

    total = sum(t.numel() * t.element_size() for t in tensors)
    shm = shared_memory.SharedMemory(create=True, size=max(total, 1))

    def done(ok: bool) -> None:
        shm.close()
        shm.unlink()

    try:
        flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=total)
        offset = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            flat[offset:offset + n].copy_(t.contiguous().view(-1).view(torch.uint8))
            offset += n
        del flat
    except BaseException:
        done(False)  # the segment would otherwise outlive the call, as big as the whole push
        raise
    return specs, ("shm", shm.name), done


def open_shared(specs: list[TensorSpec], payload: Any, opened: OpenedIpcTensors | None = None, rank: int = 0
                ) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a ``share`` payload, in TP rank ``rank``'s scheduler: ("cuda_ipc_synced", [per rank:
    ``IpcRankPayload``]), ("cuda_ipc", [rebuild args]) or ("shm", name: views of the sender's buffer, no
    copy). ``opened`` holds the "cuda_ipc_synced" mappings between calls; after loading, ``close_shared``."""
    kind, data = payload
    if kind == "cuda_ipc_synced":
        if not 0 <= rank < len(data):
            raise ValueError(f"the CUDA IPC payload has no part for TP rank {rank}")
        opened = OpenedIpcTensors() if opened is None else opened
        return list(zip((spec.name for spec in specs), opened.open(data[rank], specs)))
    if kind == "cuda_ipc":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return [(spec.name, rebuild_cuda_tensor(*args)) for spec, args in zip(specs, data)]
    if kind == "shm":  # views of the sender's buffer, mapped by torch (unmapped when the last view dies)
        nbytes = sum(s.nbytes for s in specs)
        flat = torch.from_file(f"/dev/shm/{data.lstrip('/')}", shared=True, size=max(nbytes, 1), dtype=torch.uint8)
        return unflatten(flat[:nbytes], specs)
    raise ValueError(f"unknown shared tensor payload {kind!r}")


def close_shared(payload: Any, opened: OpenedIpcTensors, rank: int = 0) -> None:
    """After TP rank ``rank`` loaded a ``share`` payload: close the mappings the sender asked it to close."""
    kind, data = payload
    if kind == "cuda_ipc_synced":
        opened.close(data[rank])


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
