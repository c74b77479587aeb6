"""A refused ``cudaHostRegister`` (or ``cudaHostUnregister``) leaves no stale CUDA error behind (one GPU).

``PinnedHostBuffer`` pins a colocated engine's host copy of its weights. When the driver refuses (here: memory
already registered), the call raises with CUDA's message, and the next torch kernel launch must still work:
the runtime keeps the failed call's error as the thread's last error, which torch's launch checks read.
First the same failure is made without clearing, to show the check would catch a stale error. A refused
unpin in ``close()`` only warns, and must not leave its error behind either.

    python gpu_checks/check_pinned_memory.py     # exits 1 on a failure
"""

from __future__ import annotations

import logging
import sys

import torch

from rollout.model_executor import pinned_memory


def launch_error() -> str | None:
    """None if a torch kernel launches and runs, else the error it raised."""
    try:
        x = torch.ones(1024, device="cuda")
        x.add_(1)
        torch.cuda.synchronize()
        return None
    except RuntimeError as e:
        return str(e).splitlines()[0]


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    lib = pinned_memory._loaded_cudart()
    print("CUDA runtime library found:", lib._name if lib is not None else None)
    held = pinned_memory.PinnedHostBuffer(64 << 20)
    assert held.registered and held.tensor is not None
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(held.tensor.data_ptr(), 1 << 20, 0)
    print(f"registering pinned memory again: error {int(err)} ({cudart.cudaGetErrorString(err)})")
    print("the next launch, error left set:", launch_error())
    pinned_memory.clear_last_cuda_error()
    failures = []
    made = pinned_memory.mapped_zeros
    pinned_memory.mapped_zeros = lambda nbytes, threads: held.tensor[:nbytes]  # memory the driver refuses
    try:
        pinned_memory.PinnedHostBuffer(1 << 20)
        failures.append("PinnedHostBuffer did not raise on memory already registered")
    except RuntimeError as e:
        print("PinnedHostBuffer raised:", e)
    finally:
        pinned_memory.mapped_zeros = made
    after = launch_error()
    print("the next launch after PinnedHostBuffer raised:", after)
    if after is not None:
        failures.append(f"a torch launch after the refused pin failed: {after}")
    held.close()
    fresh = pinned_memory.PinnedHostBuffer(8 << 20)
    if not fresh.registered:
        failures.append("a new buffer after the failure was not pinned")
    cudart.cudaHostUnregister(fresh.tensor.data_ptr())  # so that close() finds nothing to unpin
    pinned_memory.clear_last_cuda_error()
    fresh.close()  # warns with CUDA's message
    after = launch_error()
    print("the next launch after a refused unpin:", after)
    if after is not None:
        failures.append(f"a torch launch after the refused unpin failed: {after}")
    for f in failures:
        print("FAIL:", f)
    print("OK" if not failures else "FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
