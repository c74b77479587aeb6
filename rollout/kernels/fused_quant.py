"""The kernels before an fp8 projection, with the per-token quantization of their output fused in (CUDA
path of ``quantization="fp8"``): add + RMSNorm (inputs of qkv_proj and gate_up_proj) and SiLU·mul (input
of down_proj). Each row is read once and only its fp8 values and scale are written, so the separate
quantization kernel (one launch and one read of the activations per projection) is gone.

Arithmetic follows the torch path (``RMSNorm._norm``, ``F.silu(gate) * up``, i.e. Hugging Face's), rounding
to the model dtype wherever it does, then quantizes exactly as ``quantize_fp8_tokens`` does:
- add + RMSNorm: ``h = residual + x`` (rounded; written back to ``residual``), ``n = h · rsqrt(mean(h²) + eps)``
  in float32 rounded, ``y = weight · n`` rounded;
- SiLU·mul: ``s = gate / (1 + exp(-gate))`` rounded, ``y = s · up`` rounded;
then ``scale = max(amax(|y|) · (1/448), min)`` and ``q = clamp(y / scale, ±448)`` rounded to nearest even.
Rows are held in registers: up to ``FUSED_QUANT_MAX_COLS`` elements (``fused_quant_supports``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.kernels.add_rmsnorm import add_residual_row, rms_norm_row, row_launch_shape
from rollout.kernels.pdl import pdl_launch, pdl_prologue
from rollout.kernels.quant import quantize_row
from rollout.layers.quantization import (_MIN_SCALE, FP8_DTYPE, FP8_MAX, FUSED_QUANT_MAX_COLS, INV_FP8_MAX,
                                         Fp8Activation, fused_quant_supports)


@triton.jit
def _add_rmsnorm_quant_kernel(x_ptr, res_ptr, w_ptr, q_ptr, scale_ptr, K, x_stride, res_stride, q_stride, eps,
                              fp8_max, inv_fp8_max, min_scale, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                              USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    h = tl.load(x_ptr + row.to(tl.int64) * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        h = add_residual_row(h, res_ptr + row.to(tl.int64) * res_stride, cols, mask)
    y = rms_norm_row(h, w_ptr, cols, mask, K, eps).to(tl.float32)
    quantize_row(y, q_ptr + row.to(tl.int64) * q_stride, scale_ptr, row, cols, mask, fp8_max, inv_fp8_max,
                  min_scale)


@triton.jit
def _silu_mul_quant_kernel(gu_ptr, q_ptr, scale_ptr, N, gu_stride, q_stride, fp8_max, inv_fp8_max, min_scale,
                           BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dt = gu_ptr.dtype.element_ty
    gu_row = gu_ptr + row.to(tl.int64) * gu_stride
    g = tl.load(gu_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_row + N + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(dt).to(tl.float32)
    y = (s * u).to(dt).to(tl.float32)
    quantize_row(y, q_ptr + row.to(tl.int64) * q_stride, scale_ptr, row, cols, mask, fp8_max, inv_fp8_max,
                  min_scale)


def _launch_shape(cols: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of ``cols`` elements held in registers."""
    if not fused_quant_supports(cols):
        raise ValueError(f"rows of {cols} elements exceed the fused kernels' {FUSED_QUANT_MAX_COLS}")
    return row_launch_shape(cols)


def _new_activation(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> Fp8Activation:
    return Fp8Activation(torch.empty((rows, cols), dtype=FP8_DTYPE, device=device),
                         torch.empty((rows, 1), dtype=torch.float32, device=device), dtype)


def add_rmsnorm_quant_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                          eps: float) -> Fp8Activation:
    """fp8 per-token quantization of ``RMSNorm(residual + x)`` (of ``x`` when ``residual`` is None), with
    ``residual += x`` in place (rounded to its dtype). ``x``, ``residual``: 2-D with contiguous rows, same
    dtype; ``weight`` [K] contiguous."""
    t, k = x.shape
    out = _new_activation(t, k, x.dtype, x.device)
    if t:
        block, warps = _launch_shape(k)
        res = x if residual is None else residual
        _add_rmsnorm_quant_kernel[(t,)](x, res, weight, out.q, out.scale, k, x.stride(0), res.stride(0),
                                        out.q.stride(0), eps, FP8_MAX, INV_FP8_MAX, _MIN_SCALE,
                                        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=warps,
                                        **pdl_launch(x.device))
    return out


def silu_mul_quant_fp8(gate_up: torch.Tensor) -> Fp8Activation:
    """fp8 per-token quantization of ``silu(gate) * up`` where ``gate_up = [gate | up]`` [T, 2N] has
    contiguous rows."""
    t, n2 = gate_up.shape
    n = n2 // 2
    out = _new_activation(t, n, gate_up.dtype, gate_up.device)
    if t:
        block, warps = _launch_shape(n)
        _silu_mul_quant_kernel[(t,)](gate_up, out.q, out.scale, n, gate_up.stride(0), out.q.stride(0), FP8_MAX,
                                     INV_FP8_MAX, _MIN_SCALE, BLOCK=block, num_warps=warps, **pdl_launch(gate_up.device))
    return out
