"""The CUDA IPC handle protocol between a colocated trainer (``IpcHandleCache``) and each engine rank
(``OpenedIpcTensors``): which storages a push maps, which it reuses, and when each mapping is closed.

torch's IPC reference counting (Note [CUDA IPC Refcounting implementation explained]): every
``reduce_tensor`` of a storage sets a fresh counter to 1 for the one mapping that will be made of it, and
that counter drops to 0 when the mapping is closed; a storage the sender frees while a counter is above 0
waits in the sender's "limbo" instead of being reused. So each export is mapped exactly once and closed
exactly once, by one receiver.

Exporting (``cudaIpcGetMemHandle``) and mapping (``cudaIpcOpenMemHandle``) cost more than copying a small
tensor, so the unit is a *storage*, not a tensor: a call exports each storage it touches once (as a uint8
view of all of it) and sends each tensor as (storage, byte offset); the receiver cuts the views out again.
The sender decides everything, the receiver obeys (``IpcRankPayload``):

- ``"map"``: a storage not open at the receiver: mapped and kept open;
- ``"reuse"``: a storage the receiver has open: nothing is mapped;
- ``release``: closed before this call maps anything: storages the sender has freed since (a bucket's
  temporaries are closed one call later, so at most one call's temporaries wait in limbo);
- ``close``: closed after this call has loaded: at the end of a *push* (the call that completes an
  update, ``ends_push``), every storage that this push and the push before did not both name.

So within one push a storage named again is not mapped again (a trainer's reused bucket buffer: two
mappings per push instead of one per bucket), and across pushes only storages named by two pushes in a row
stay mapped (a trainer's parameters: mapped at the first two pushes, reused from the third). After a push
no mapping is left of memory the trainer has freed or may free (its temporaries and per-push buffers), so
nothing of the trainer's waits in limbo while it trains. When a push fails the sender forgets its state
and starts a new ``epoch``; a receiver closes every mapping of an older epoch first (on TP ranks where
the push succeeded too). Mappings kept across sleep and wake are the trainer's live parameters, no memory of
the engine's. The sender synchronizes its devices before a push, so receivers need not wait on IPC events.
With TP > 1 every rank gets its own exports (one counter per mapping).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.weights.buckets import TensorSpec

IPC_MODES = ("map", "reuse")


@dataclass(frozen=True)
class IpcRankPayload:
    """One TP rank's part of a push: ``storages`` [(``rebuild_cuda_tensor`` arguments of a uint8 view of the
    whole storage, mode)], ``views`` [(index into ``storages``, byte offset)] per tensor in order, the
    storages to close before (``release``) and after (``close``) loading, and the sender's ``epoch``."""

    epoch: int
    storages: list[tuple[tuple, str]]
    views: list[tuple[int, int]]
    release: list[tuple] = field(default_factory=list)
    close: list[tuple] = field(default_factory=list)


def _storage_key(t: torch.Tensor) -> tuple:
    storage = t.untyped_storage()
    return storage._cdata, storage.data_ptr(), storage.nbytes(), t.device.index


def _whole_storage(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over all of ``t``'s storage (what is exported, so views of any part can be cut out)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))


@dataclass
class _Export:
    ref: Any  # StorageWeakRef: the storage is alive while this entry may be reused
    args: list[tuple]  # per receiver


class IpcHandleCache:
    """The sender's side: the storages open at the receivers, and those named by this push and the last.
    ``export`` builds one call's payloads; ``reset()`` after a failed call."""

    def __init__(self, receivers: int = 1) -> None:
        self.receivers = receivers
        self.epoch = 0
        self._open: dict[tuple, _Export] = {}
        self._named: dict[tuple, Any] = {}  # this push so far: key -> StorageWeakRef
        self._named_before: dict[tuple, Any] = {}  # the last completed push

    def export(self, tensors: list[torch.Tensor], ends_push: bool = True) -> list[IpcRankPayload]:
        """Per receiver, the payload of one call carrying ``tensors`` (each contiguous); ``ends_push``: the
        call completes the update."""
        from torch.multiprocessing.reductions import StorageWeakRef, reduce_tensor

        release = [k for k, e in self._open.items() if e.ref.expired()]
        released = [self._open.pop(k).args for k in release]
        index: dict[tuple, int] = {}
        storages: list[tuple[list[tuple], str]] = []
        views = []
        for t in tensors:
            key = _storage_key(t)
            if key not in index:
                index[key] = len(storages)
                entry = self._open.get(key)
                mode = "reuse"
                if entry is None:
                    whole = _whole_storage(t)
                    entry = self._open[key] = _Export(StorageWeakRef(t.untyped_storage()),
                                                      [reduce_tensor(whole)[1] for _ in range(self.receivers)])
                    mode = "map"
                storages.append((entry.args, mode))
                self._named.setdefault(key, entry.ref)
            views.append((index[key], t.storage_offset() * t.element_size()))
        closing: list[tuple] = []
        if ends_push:
            closing = [k for k in self._open if not self._named_twice(k)]
            self._named_before, self._named = self._named, {}
        closed = [self._open.pop(k).args for k in closing]
        return [IpcRankPayload(self.epoch, [(args[r], mode) for args, mode in storages], views,
                               [args[r] for args in released], [args[r] for args in closed])
                for r in range(self.receivers)]

    def _named_twice(self, key: tuple) -> bool:
        """Named by this push and, as the same live storage, by the push before."""
        before = self._named_before.get(key)
        return key in self._named and before is not None and not before.expired()

    def reset(self) -> None:
        """Forget everything (a call failed): the next call maps afresh, in a new epoch."""
        self.epoch += 1
        self._open, self._named, self._named_before = {}, {}, {}


@dataclass
class _Mapping:
    whole: torch.Tensor
    views: dict[tuple, torch.Tensor]  # (byte offset, dtype, shape) -> view, for storages kept across calls


class OpenedIpcTensors:
    """The receiver's side: the storages it has mapped, by export."""

    def __init__(self) -> None:
        self._open: dict[tuple, _Mapping] = {}
        self.epoch = 0

    def open(self, payload: IpcRankPayload, specs: list[TensorSpec]) -> list[torch.Tensor]:
        """The tensors of one call, one per spec, as views of their mapped storages."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if payload.epoch != self.epoch:
            self.clear()
            self.epoch = payload.epoch
        if len(payload.views) != len(specs):
            raise ValueError(f"the CUDA IPC payload has {len(payload.views)} tensors for {len(specs)} names")
        for args in payload.release:
            self._open.pop(args, None)
        mappings = []
        for args, mode in payload.storages:
            if mode not in IPC_MODES:
                raise ValueError(f"unknown IPC mode {mode!r}")
            mapping = self._open.get(args)
            if mode == "map":
                mapping = self._open[args] = _Mapping(rebuild_cuda_tensor(*args), {})
            elif mapping is None:
                raise RuntimeError("a reused CUDA IPC handle is not open here (the sender and the engine "
                                   "disagree about the last push); push again")
            mappings.append(mapping)
        return [self._view(mappings[i], offset, spec) for (i, offset), spec in zip(payload.views, specs)]

    @staticmethod
    def _view(mapping: _Mapping, offset: int, spec: TensorSpec) -> torch.Tensor:
        key = (offset, spec.dtype, spec.shape)
        view = mapping.views.get(key)
        if view is None:
            end = offset + spec.nbytes
            if end > mapping.whole.numel():
                raise ValueError(f"a CUDA IPC view of {spec.nbytes} B at {offset} runs past its storage "
                                 f"({mapping.whole.numel()} B)")
            view = mapping.views[key] = mapping.whole[offset:end].view(spec.dtype).view(spec.shape)
        return view

    def close(self, payload: IpcRankPayload) -> None:
        """After loading: close the storages the sender named in ``close``."""
        for args in payload.close:
            self._open.pop(args, None)

    def clear(self) -> None:
        self._open = {}

    def __len__(self) -> int:
        return len(self._open)
