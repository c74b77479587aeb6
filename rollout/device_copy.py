"""Host-to-device copies that never make the host wait for the GPU.

A ``non_blocking`` copy from pageable host memory is staged by the driver and can wait for the work
already queued on the stream; on the decode hot path that wait would undo the overlap of CPU scheduling
with GPU work. Everything the scheduler sends to the GPU therefore goes through pinned memory here.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``; on CUDA through pinned memory with a non-blocking copy (no host wait)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    if t.is_cuda:
        return t.to(device, non_blocking=True)
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)


def list_to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device`` without a host wait."""
    return to_device(torch.tensor(values, dtype=dtype), device)
