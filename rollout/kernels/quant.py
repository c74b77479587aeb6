"""Dynamic per-token FP8 quantization of activations in one Triton kernel (CUDA path of
``rollout.layers.quantization.quantize_fp8_tokens``).

The torch version launches five kernels and writes a float32 copy of the activations, which costs about
half as much as the fp8 GEMM itself on an 8192-token prefill chunk; this reads each row once (rows of
up to 8,192 elements stay in registers; longer ones are read twice, the second time from L2) and
writes it once as fp8. The scale multiply and the division are correctly
rounded, so the result is bit-identical to the torch version.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.kernels.pdl import pdl_launch, pdl_prologue

from rollout.layers.quantization import _MIN_SCALE, FP8_MAX, INV_FP8_MAX

_BLOCK = 1024  # tile of the two-pass loop for rows longer than _ONE_PASS_MAX
_ONE_PASS_MAX = 8192  # rows up to this length are held in registers: read once (longer: slower on H200)


@triton.jit
def quantize_row(y, q_row, scale_ptr, row, cols, mask, fp8_max, inv_fp8_max, min_scale):
    """Store the per-token fp8 quantization of one float32 row ``y`` held whole (``cols`` its columns):
    its scale at ``scale_ptr + row``, its values at ``q_row + cols``."""
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) * inv_fp8_max, min_scale)
    tl.store(scale_ptr + row, scale)
    q = tl.minimum(tl.maximum(tl.math.div_rn(y, scale), -fp8_max), fp8_max)
    tl.store(q_row + cols, q.to(q_row.dtype.element_ty), mask=mask)


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, scale_ptr, K, x_stride, q_stride, fp8_max, inv_fp8_max, min_scale,
                            BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * x_stride
    q_row = q_ptr + row.to(tl.int64) * q_stride
    if ONE_PASS:  # the whole row in one tile
        cols = tl.arange(0, BLOCK)
        mask = cols < K
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        quantize_row(x, q_row, scale_ptr, row, cols, mask, fp8_max, inv_fp8_max, min_scale)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0) * inv_fp8_max, min_scale)
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            mask = cols < K
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
            tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [T, K], float32 [T, 1]) with ``scale = max(amax(|x_t|) · (1/448), min)`` and
    ``q = clamp(x / scale, ±448)`` rounded to nearest even (``rollout.layers.quantization``'s constants);
    ``x`` is 2-D with unit last stride."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError("per_token_quant_fp8 needs a 2-D tensor with contiguous rows")
    t, k = x.shape
    q = torch.empty((t, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t:
        one_pass = k <= _ONE_PASS_MAX
        block = triton.next_power_of_2(k) if one_pass else _BLOCK
        warps = 4 if not one_pass or block <= 4096 else 8
        _per_token_quant_kernel[(t,)](x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX, INV_FP8_MAX, _MIN_SCALE,
                                      BLOCK=block, ONE_PASS=one_pass, num_warps=warps, **pdl_launch(x.device))
    return q, scale
