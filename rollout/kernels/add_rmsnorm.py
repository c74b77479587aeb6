"""Residual add + RMSNorm in Triton, with Hugging Face's rounding, for rows held in registers.

``add_residual_row`` and ``rms_norm_row`` are the add and the norm of one row (shared with
``rollout.kernels.fused_quant``); ``add_rmsnorm_split_k``
is the add + norm after a split-K projection (``rollout.layers.split_k``): it first sums the projection's
float32 partials. The arithmetic is the torch path's (``RMSNorm._norm`` after ``residual + x``), rounding to the
model dtype wherever it does:
- ``o = dtype(p_0 + p_1 + ... + p_{S-1})``, the projection's output (summed in that order in float32 and
  rounded once, as one matmul rounds its float32 accumulator);
- ``h = dtype(residual + o)``, written back to ``residual``;
- ``n = dtype(h / sqrt(mean(h²) + eps))`` in float32 with IEEE division and square root;
- ``y = dtype(weight · n)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.kernels.pdl import pdl_launch, pdl_prologue


@triton.jit
def rms_norm_row(h, w_ptr, cols, mask, K, eps):
    """``weight · RMSNorm(h)`` of one row ``h`` (masked entries 0) with ``K`` valid columns at ``cols``, in the
    weight's dtype (the model dtype), rounded as ``RMSNorm._norm`` rounds."""
    dt = w_ptr.dtype.element_ty
    hf = h.to(tl.float32)
    inv_rms = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(tl.sum(hf * hf, axis=0), K.to(tl.float32)) + eps))
    normed = (hf * inv_rms).to(dt).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (w * normed).to(dt)


@triton.jit
def add_residual_row(x, res_row, cols, mask):
    """``h = dtype(residual + x)`` for one row (x in any float dtype, residual at ``res_row`` in the model dtype),
    written back to the residual and returned in the model dtype (as torch adds two tensors of that dtype)."""
    r = tl.load(res_row + cols, mask=mask, other=0.0)
    h = (x.to(tl.float32) + r.to(tl.float32)).to(res_row.dtype.element_ty)
    tl.store(res_row + cols, h, mask=mask)
    return h


def row_launch_shape(cols: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of a kernel that holds rows of ``cols`` elements in registers, one program a row."""
    block = triton.next_power_of_2(cols)
    return block, max(4, min(16, block // 1024))


@triton.jit
def _split_k_add_rmsnorm_kernel(part_ptr, res_ptr, w_ptr, out_ptr, rows, K, res_stride, out_stride, eps,
                                S: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    acc = tl.load(part_ptr + row.to(tl.int64) * K + cols, mask=mask, other=0.0)
    for s in tl.static_range(1, S):
        acc += tl.load(part_ptr + (s * rows + row).to(tl.int64) * K + cols, mask=mask, other=0.0)
    o = acc.to(res_ptr.dtype.element_ty)  # the projection's output, rounded once
    h = add_residual_row(o, res_ptr + row.to(tl.int64) * res_stride, cols, mask)
    tl.store(out_ptr + row.to(tl.int64) * out_stride + cols, rms_norm_row(h, w_ptr, cols, mask, K, eps), mask=mask)


def add_rmsnorm_split_k(partials: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """``RMSNorm(residual + o)`` [T, K] in ``residual``'s dtype, where ``o`` is the sum over S of ``partials``
    (float32 [S, T, K], contiguous), with ``residual += o`` in place (rounded to its dtype). ``residual``:
    [T, K] with contiguous rows; ``weight`` [K] contiguous, in the model dtype."""
    s, t, k = partials.shape
    out = torch.empty((t, k), dtype=residual.dtype, device=residual.device)
    if t:
        block, warps = row_launch_shape(k)
        _split_k_add_rmsnorm_kernel[(t,)](partials, residual, weight, out, t, k, residual.stride(0), out.stride(0),
                                          eps, S=s, BLOCK=block, num_warps=warps, **pdl_launch(residual.device))
    return out
