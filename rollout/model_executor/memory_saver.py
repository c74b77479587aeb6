"""Releasing and restoring the memory of the engine's big allocations by tag, for colocated training (SGLang's
``release_memory_occupation`` / vLLM's ``sleep``): the trainer gets the memory while the engine sleeps.

Tags: ``"weights"`` (every parameter and buffer of the model), ``"kv_cache"`` (the KV pool, the request
table, the attention backend's buffers and the decode graphs' shared logits buffer), ``"cuda_graph"`` (the
decode graphs' memory).

- CUDA (``TorchMemorySaver``, needs the ``torch-memory-saver`` package of the ``gpu`` extra): the tensors of
  a tag are allocated inside ``region(tag)``; ``release`` unmaps their physical memory and ``resume`` maps
  new memory at the same virtual addresses, so CUDA graphs and IPC handles stay valid. Tensors whose
  contents must survive are first copied into one pinned host buffer (``pinned_memory.PinnedHostBuffer``,
  kept between sleeps) and copied back after ``resume``. The graphs' own memory is not in a region (the
  package pauses graph memory only in its LD_PRELOAD mode): releasing ``"cuda_graph"`` returns the
  allocator's cached free blocks only.
- CPU (``HostMemorySaver``): each tensor's storage is resized to 0 bytes and back; contents that must
  survive go to an unlinked temporary file meanwhile (page cache, not the process's memory).

The caller (``rollout.scheduler.memory``) decides which tags to release and which contents to keep.
"""

from __future__ import annotations

import contextlib
import tempfile
from typing import Iterator

import torch

from rollout.model_executor.pinned_memory import PinnedHostBuffer

TAGS = ("weights", "kv_cache", "cuda_graph")


def unique_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per storage, in order (tied weights share one)."""
    seen, out = set(), []
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


class MemorySaver:
    """No release: the default when ``enable_memory_saver`` is off."""

    def region(self, tag: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def release(self, tag: str, tensors: list[torch.Tensor], keep: list[torch.Tensor]) -> None:
        raise ValueError("releasing memory needs an engine started with enable_memory_saver=True")

    def resume(self, tag: str, tensors: list[torch.Tensor], keep: list[torch.Tensor]) -> None:
        raise ValueError("releasing memory needs an engine started with enable_memory_saver=True")


def create_memory_saver(enabled: bool, device: torch.device) -> MemorySaver:
    if not enabled:
        return MemorySaver()
    if device.type == "cuda":
        return TorchMemorySaver()
    return HostMemorySaver()


class HostMemorySaver(MemorySaver):
    """CPU: storages resized to 0 and back; kept contents parked in an unlinked temporary file (copied through
    a bounce buffer: a numpy view of a storage would pin its size)."""

    CHUNK_BYTES = 64 << 20

    def __init__(self) -> None:
        self._parked: dict[str, tempfile.TemporaryFile] = {}
        self._sizes: dict[str, list[int]] = {}

    def release(self, tag: str, tensors: list[torch.Tensor], keep: list[torch.Tensor]) -> None:
        if keep:
            f = tempfile.TemporaryFile()
            for flat, bounce in self._chunks(keep):
                bounce.copy_(flat)
                f.write(bounce.numpy().tobytes())
            self._parked[tag] = f
        self._sizes[tag] = [t.untyped_storage().nbytes() for t in tensors]
        for t in tensors:
            t.untyped_storage().resize_(0)

    def resume(self, tag: str, tensors: list[torch.Tensor], keep: list[torch.Tensor]) -> None:
        for t, nbytes in zip(tensors, self._sizes.pop(tag)):
            t.untyped_storage().resize_(nbytes)
        f = self._parked.pop(tag, None)
        if f is None:
            return
        with f:
            f.seek(0)
            for flat, bounce in self._chunks(keep):
                f.readinto(memoryview(bounce.numpy()))
                flat.copy_(bounce)

    def _chunks(self, tensors: list[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(a piece of a tensor's storage bytes, a bounce buffer of the same size), in order."""
        bounce = torch.empty(self.CHUNK_BYTES, dtype=torch.uint8)
        for t in tensors:
            flat = _bytes(t)
            for start in range(0, flat.numel(), self.CHUNK_BYTES):
                piece = flat[start:start + self.CHUNK_BYTES]
                yield piece, bounce[:piece.numel()]


class TorchMemorySaver(MemorySaver):
    """CUDA through torch_memory_saver (``hook_mode="torch"``: an allocator per region, no LD_PRELOAD)."""

    def __init__(self) -> None:
        try:
            from torch_memory_saver import TorchMemorySaver as Saver
        except ImportError as e:
            raise ValueError("enable_memory_saver on a GPU needs torch-memory-saver: "
                             "pip install 'rollout-engine[gpu]'") from e
        self._saver = Saver()
        self._saver.hook_mode = "torch"
        self._host: PinnedHostBuffer | None = None  # reused by every sleep that keeps contents

    @contextlib.contextmanager
    def region(self, tag: str) -> Iterator[None]:
        if tag == "cuda_graph":  # graph memory is not pauseable in torch hook mode (see the module docstring)
            yield
            return
        with self._saver.region(tag=tag):
            yield

    def release(self, tag: str, tensors: list[torch.Tensor], keep: list[torch.Tensor]) -> None:
        if keep:
            host = self._host_buffer(sum(t.untyped_storage().nbytes() for t in keep))
            offset = 0
            for t in keep:
                n = t.untyped_storage().nbytes()
                host[offset:offset + n].copy_(_bytes(t), non_blocking=True)
                offset += n
        torch.cuda.synchronize()
        if tag != "cuda_graph":
            self._saver.pause(tag)
        torch.cuda.empty_cache()

    def resume(self, tag: str, tensors: list[torch.Tensor], keep: list[torch.Tensor]) -> None:
        if tag != "cuda_graph":
            self._saver.resume(tag)
        offset = 0
        for t in keep:
            n = t.untyped_storage().nbytes()
            _bytes(t).copy_(self._host.tensor[offset:offset + n], non_blocking=True)
            offset += n
        torch.cuda.synchronize()

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        if self._host is None or self._host.tensor.numel() < nbytes:
            if self._host is not None:
                self._host.close()
                self._host = None
            self._host = PinnedHostBuffer(nbytes)
        return self._host.tensor


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """All of ``t``'s storage as a flat uint8 tensor over the same memory (writing it writes ``t``)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
