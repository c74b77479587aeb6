"""Tensors shared with the scheduler processes without copying them through ZeroMQ.

CUDA tensors travel as CUDA IPC handles; CPU tensors are copied once into one POSIX shared-memory
buffer (the flattened-bucket layout of ``rollout.weights.buckets``) that the schedulers map. ``share`` runs
in the process that holds the tensors, ``open_shared`` in each scheduler.

torch's IPC reference counting (Note [CUDA IPC Refcounting implementation explained]): every
``reduce_tensor`` of a storage sets a fresh counter to 1 for the one mapping that will be made of it, and
that counter drops to 0 when the mapping is closed; a storage the sender frees while a counter is above 0
waits in the sender's "limbo" instead of being reused. So each exported handle must be mapped exactly
once and closed exactly once, by one receiver.

A colocated trainer pushes the same parameters every step, and exporting (``cudaIpcGetMemHandle``) and
mapping (``cudaIpcOpenMemHandle``) cost more than copying a small tensor, so both sides remember the last
push under one protocol. Each tensor of a "cuda_ipc_synced" payload comes with a mode:

- ``"once"``: a tensor not in the last push (a trainer's temporary, or a parameter seen the first time):
  mapped, loaded, closed;
- ``"keep"``: a tensor in the last push as "once": exported again, mapped and kept open;
- ``"reuse"``: a tensor the receiver keeps open from the last push: the same handle, not mapped again.

The receiver closes every kept mapping the newest push does not name, and closes all of them when a push
fails or the engine shuts down; the sender, told of a failure, forgets its state too (``IpcHandleCache``,
``OpenedIpcTensors``). Mappings kept across sleep and wake are the trainer's live parameters, no memory of
the engine's; a trainer that frees parameters the engine still maps gets their memory back at its next
push. The sender synchronizes its devices before a push, so receivers need not wait on IPC events. With
TP > 1 every rank gets its own exports (one counter per mapping).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from rollout.dtypes import dtype_name
from rollout.weights.buckets import TensorSpec, unflatten

# rebuild_cuda_tensor's arguments (torch.multiprocessing.reductions): index of the storage's device
_IPC_STORAGE_DEVICE = 6
IPC_MODES = ("once", "keep", "reuse")


class IpcHandleCache:
    """The sender's side: per live tensor (keyed by storage, data pointer, offset, shape, stride and
    dtype), how often it was pushed in a row and, once kept, each receiver's ``rebuild_cuda_tensor``
    arguments. Updated when a push is sent; ``reset()`` after a failed push."""

    def __init__(self, receivers: int = 1) -> None:
        self.receivers = receivers
        self._entries: dict[tuple, tuple[Any, str, list[tuple] | None]] = {}  # key -> (weakref, mode, args)

    def export(self, tensors: list[torch.Tensor]) -> list[list[tuple[tuple, str]]]:
        """Per receiver, (``rebuild_cuda_tensor`` arguments, mode) of each tensor."""
        from torch.multiprocessing.reductions import StorageWeakRef, reduce_tensor

        entries: dict[tuple, tuple[Any, str, list[tuple] | None]] = {}
        out: list[list[tuple[tuple, str]]] = [[] for _ in range(self.receivers)]
        for t in tensors:
            storage = t.untyped_storage()
            key = (storage._cdata, storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            entry = entries.get(key)
            if entry is None:
                last = self._entries.get(key)
                if last is not None and last[0].expired():
                    last = None
                mode = "once" if last is None else "keep" if last[1] == "once" else "reuse"
                args = last[2] if mode == "reuse" else [reduce_tensor(t)[1] for _ in range(self.receivers)]
                entry = entries[key] = (StorageWeakRef(storage), mode, args)
            for r in range(self.receivers):
                out[r].append((entry[2][r], entry[1]))
        self._entries = {k: (ref, mode, args if mode != "once" else None) for k, (ref, mode, args) in entries.items()}
        return out

    def reset(self) -> None:
        self._entries = {}


class OpenedIpcTensors:
    """The receiver's side: the mappings kept open from the last push, by handle."""

    def __init__(self) -> None:
        self._tensors: dict[tuple, torch.Tensor] = {}

    def open(self, exported: list[tuple[tuple, str]]) -> list[torch.Tensor]:
        """The tensors of one push; a handle named twice in it is mapped once."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        mapped: dict[tuple, torch.Tensor] = {}
        kept: dict[tuple, torch.Tensor] = {}
        out = []
        for args, mode in exported:
            if mode not in IPC_MODES:
                raise ValueError(f"unknown IPC mode {mode!r}")
            t = mapped.get(args)
            if t is None and mode == "reuse":
                t = self._tensors.get(args)
                if t is None:
                    raise RuntimeError("a reused CUDA IPC handle is not open here (the sender and the engine "
                                       "disagree about the last push); push again")
            if t is None:
                t = rebuild_cuda_tensor(*args)
            mapped[args] = t
            if mode != "once":
                kept[args] = t
            out.append(t)
        self._tensors = kept
        return out

    def clear(self) -> None:
        self._tensors = {}


def share(named: list[tuple[str, torch.Tensor]], handles: IpcHandleCache | None = None
          ) -> tuple[list[tuple[str, str, list[int]]], Any, Callable[[bool], None]]:
    """(specs, payload, done): call ``done(ok)`` once every receiver has replied (``ok``: all succeeded).
    CUDA tensors: the devices are synchronized first, so the receivers read finished values; ``handles``
    (one receiver unless given) remembers the exports for the next push."""
    if not named:
        raise ValueError("no tensors to update")
    specs = [(name, dtype_name(t.dtype), list(t.shape)) for name, t in named]
    tensors = [t.detach() for _, t in named]
    if all(t.is_cuda for t in tensors):
        tensors = [t.contiguous() for t in tensors]
        for device in {t.device for t in tensors}:
            torch.cuda.synchronize(device)
        handles = handles or IpcHandleCache()
        payload = ("cuda_ipc_synced", handles.export(tensors))

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
    flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=total)
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        flat[offset:offset + n].copy_(t.contiguous().view(-1).view(torch.uint8))
        offset += n
    del flat

    def done(ok: bool) -> None:
        shm.close()
        shm.unlink()

    return specs, ("shm", shm.name), done


def open_shared(specs: list[TensorSpec], payload: Any, opened: OpenedIpcTensors | None = None, rank: int = 0
                ) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a ``share`` payload, in TP rank ``rank``'s scheduler: ("cuda_ipc_synced", [per rank:
    [(rebuild args, mode)]]), ("cuda_ipc", [rebuild args]) or ("shm", name: views of the sender's buffer,
    no copy). ``opened`` keeps "cuda_ipc_synced" mappings for the next push."""
    kind, data = payload
    if kind == "cuda_ipc_synced":
        if not 0 <= rank < len(data) or len(data[rank]) != len(specs):
            raise ValueError(f"the CUDA IPC payload has no {len(specs)} handles for TP rank {rank}")
        return list(zip((spec.name for spec in specs), (opened or OpenedIpcTensors()).open(data[rank])))
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
