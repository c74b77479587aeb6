"""How fast a large pinned host buffer can be made: the first ``sleep(level=1)`` of a colocated engine allocates
one for all of its weights (``rollout/model_executor/memory_saver.py``), which took 6.8-10 s for the 8B's 16 GB
with ``torch.empty(pin_memory=True)``.

    python tools/exp_pinned_alloc.py [--gib 16] [--ways torch,register,hugepage-register,hugepage-touch-register]

Ways (each allocates ``--gib`` GiB, then times a 1 GiB device-to-host copy into it to show it is pinned):
- ``engine``: the engine's ``PinnedHostBuffer`` (``rollout/model_executor/pinned_memory.py``);
- ``torch``: ``torch.empty(n, dtype=uint8, pin_memory=True)`` (cudaHostAlloc; what the engine did before);
- ``register``: a pageable ``torch.empty`` then ``cudaHostRegister`` (the driver faults and pins the pages);
- ``hugepage-register``: an anonymous mmap advised ``MADV_HUGEPAGE``, then ``cudaHostRegister``;
- ``hugepage-touch-register``: the same, its pages first touched by one write per 2 MiB;
- ``hugepage-touchN-register``: that touch in N slices on N threads.
Prints the kernel's transparent-huge-page setting, each way's allocation time and the copy's GB/s.
"""

from __future__ import annotations

import argparse
import mmap
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from rollout.model_executor.pinned_memory import PinnedHostBuffer, clear_last_cuda_error

GIB = 1 << 30


def _register(t: torch.Tensor) -> None:
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    if int(err) != 0:
        clear_last_cuda_error()  # else the next way's copies fail with this error
        raise RuntimeError(f"cudaHostRegister failed: {err}")


def _hugepage_buffer(n: int, touch_threads: int) -> tuple[torch.Tensor, mmap.mmap]:
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    if touch_threads:  # one write per 2 MiB page, in slices on that many threads (the kernel zeroes each page)
        step = -(-n // touch_threads)
        with ThreadPoolExecutor(touch_threads) as pool:
            list(pool.map(lambda lo: t[lo:lo + step:2 << 20].fill_(0), range(0, n, step)))
    return t, m


def allocate(way: str, n: int) -> tuple[torch.Tensor, object]:
    """-> (a pinned uint8 host tensor of n bytes, what keeps its memory alive)."""
    if way == "engine":
        buf = PinnedHostBuffer(n)
        return buf.tensor, buf
    if way == "torch":
        t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        return t, None
    if way == "register":
        t = torch.empty(n, dtype=torch.uint8)
        _register(t)
        return t, None
    threads = {"hugepage-register": 0, "hugepage-touch-register": 1}.get(way)
    if threads is None:  # hugepage-touchN-register
        threads = int(way.removeprefix("hugepage-touch").removesuffix("-register"))
    t, m = _hugepage_buffer(n, threads)
    t1 = time.perf_counter()
    _register(t)
    print(f"  ({way}: cudaHostRegister {time.perf_counter() - t1:.2f} s)")
    return t, m


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=16.0)
    ap.add_argument("--ways", default="engine,torch,register,hugepage-register,hugepage-touch-register")
    args = ap.parse_args()
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            print("transparent_hugepage:", f.read().strip())
    except OSError as e:
        print("transparent_hugepage: unknown", e)
    n = int(args.gib * GIB)
    src = torch.empty(GIB, dtype=torch.uint8, device="cuda").fill_(7)
    torch.cuda.synchronize()
    for way in args.ways.split(","):
        t0 = time.perf_counter()
        try:
            host, keep = allocate(way, n)
        except Exception as e:  # noqa: BLE001  (a way this kernel or driver refuses)
            print(f"{way:<24s} failed: {type(e).__name__}: {e}")
            continue
        alloc_s = time.perf_counter() - t0
        host[:GIB].copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        for _ in range(3):
            host[:GIB].copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        gbs = 3 * GIB / (time.perf_counter() - t1) / 1e9
        ok = bool((host[GIB - 1] == 7).item())
        print(f"{way:<24s} {args.gib:.0f} GiB in {alloc_s:6.2f} s ({n / alloc_s / 1e9:5.1f} GB/s); "
              f"pinned {host.is_pinned()}; 1 GiB device->host copy {gbs:5.1f} GB/s; data ok {ok}", flush=True)
        if way == "engine":
            keep.close()
        elif way != "torch":
            torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
        del host, keep


if __name__ == "__main__":
    main()
