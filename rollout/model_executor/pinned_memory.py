"""Large page-locked host buffers, made fast: what a colocated engine's first ``sleep(level=1)`` copies its weights
into (``memory_saver.TorchMemorySaver``).

``torch.empty(n, pin_memory=True)`` (cudaHostAlloc) faults and pins the pages on one thread, which for a large
model's weights takes seconds. Here the memory is an anonymous mapping advised to use transparent huge pages, its
pages are faulted in (zeroed by the kernel) from several threads at once, and only then page-locked with
``cudaHostRegister``, about ten times faster (timings: docs/colocation.md, ``tools/exp_pinned_alloc.py``). The
buffer is also exactly its size, where torch's caching host allocator rounds a request up to a power of two.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import torch

logger = logging.getLogger(__name__)

_PAGE = 4096            # the touch stride: every base page, so it also works without huge pages
_PIECE = 32 << 20       # bytes a thread touches per task: 8,192 writes, under torch's parallel grain (32,768)
_MAX_TOUCH_THREADS = 16  # more threads kept paying on the 16-core host measured (docs/colocation.md)


def touch_threads() -> int:
    """Threads that fault a new buffer's pages in: the CPUs this process may run on, at most 16."""
    return max(1, min(_MAX_TOUCH_THREADS, len(os.sched_getaffinity(0))))


def mapped_zeros(nbytes: int, threads: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` zeros over a fresh anonymous mapping (huge pages where the kernel allows),
    every page already faulted in by ``threads`` threads. The tensor keeps the mapping alive."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # transparent huge pages off: base pages, still touched in parallel
            pass
    t = torch.frombuffer(m, dtype=torch.uint8)
    # pieces small enough that torch runs each fill on the calling thread: its own thread pool, nested under
    # these threads, contends for the page faults (several times slower); the GIL is released meanwhile
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda lo: t[lo:lo + _PIECE:_PAGE].fill_(0), range(0, nbytes, _PIECE)))
    return t


def cudart_candidates(maps_lines: Iterable[str], cuda_version: str | None) -> list[str]:
    """The CUDA runtime libraries among a process's mappings (``/proc/self/maps`` lines), the one of CUDA major
    ``cuda_version`` (torch's) first: another library may have loaded a runtime of its own."""
    paths = {line.split(None, 5)[-1].strip() for line in maps_lines if "libcudart.so" in line}
    major = f"libcudart.so.{(cuda_version or '').split('.')[0]}"
    return sorted(paths, key=lambda p: (major not in os.path.basename(p), p))


def _loaded_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch calls, as loaded in this process; None where none is found."""
    try:
        with open("/proc/self/maps") as maps:
            paths = cudart_candidates(maps, torch.version.cuda)
    except OSError:
        return None
    for path in paths:
        try:
            return ctypes.CDLL(path)  # already loaded: the same handle, the same per-thread error state
        except OSError:
            continue
    return None


def clear_last_cuda_error() -> None:
    """Reset the CUDA runtime's last error (``cudaGetLastError``) after a runtime call that failed.

    A failed call such as ``cudaHostRegister`` leaves its error as the calling thread's last error, and torch
    checks that state after its own kernel launches: left set, it fails the next unrelated launch with the old
    error. torch's ``cudart()`` bindings lack the call, so it is made on the runtime library already loaded."""
    lib = _loaded_cudart()
    if lib is not None:
        lib.cudaGetLastError()


class PinnedHostBuffer:
    """``nbytes`` of page-locked host memory as the uint8 tensor ``tensor`` (CUDA only). Call ``close()`` before
    dropping it: a buffer pinned by ``cudaHostRegister`` (``registered``) is unpinned there.

    Raises ``RuntimeError`` with CUDA's message when the driver refuses to pin the memory (as SGLang's host KV
    pool asserts on the same call); where no anonymous mapping can be made, the buffer comes from
    ``torch.empty(pin_memory=True)``."""

    def __init__(self, nbytes: int) -> None:
        self.registered = False
        try:
            t = mapped_zeros(nbytes, touch_threads()) if nbytes > 0 else None
        except (OSError, ValueError):
            t = None
        if t is None:
            self.tensor: torch.Tensor | None = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            return
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
        if int(err) != 0:
            clear_last_cuda_error()
            raise RuntimeError(f"pinning {nbytes} bytes of host memory failed: {cudart.cudaGetErrorString(err)}")
        self.tensor, self.registered = t, True

    def close(self) -> None:
        """Unpin the memory (if this buffer pinned it) and drop the tensor."""
        if self.registered and self.tensor is not None:
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostUnregister(self.tensor.data_ptr())
            if int(err) != 0:  # the memory stays pinned until the process ends; nothing else is at stake
                clear_last_cuda_error()
                logger.warning("unpinning a %d-byte host buffer failed: %s", self.tensor.numel(),
                               cudart.cudaGetErrorString(err))
        self.registered = False
        self.tensor = None
