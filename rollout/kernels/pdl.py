"""Programmatic dependent launch (PDL) for the engine's Triton kernels on Hopper and newer GPUs.

A kernel launched with ``launch_pdl=True`` may be scheduled while the kernel before it on the stream is
still finishing, which hides the launch gap between the two (inside CUDA graphs too). Such a kernel must
wait for its predecessor before touching memory: ``pdl_prologue`` does that first thing, then lets the
kernel after it be scheduled early in turn. FlashInfer's norm and activation kernels do the same by default.
``ROLLOUT_TRITON_PDL=0`` in the environment turns it off (for A/B timings).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def pdl_enabled(device: torch.device) -> bool:
    """PDL is used on CUDA devices of compute capability 9.0 or newer, never under the CPU interpreter."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" \
            or os.environ.get("ROLLOUT_TRITON_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """Launch keywords for a kernel that starts with ``pdl_prologue(USE_PDL)``: its ``USE_PDL`` constexpr and
    Triton's ``launch_pdl`` option, both ``pdl_enabled(device)``."""
    on = pdl_enabled(device)
    return {"USE_PDL": on, "launch_pdl": on}


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """With ``USE_PDL``: wait until the previous kernel's writes are visible, then allow the next kernel to
    be scheduled (it waits the same way, so it still sees this kernel's writes). A no-op otherwise."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
