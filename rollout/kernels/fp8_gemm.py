"""W8A8 FP8 GEMM with per-token and per-channel scales in Triton, for the few-token (decode) shapes.

``out[m, n] = (Σ_k a[m, k] · w[n, k]) · a_scale[m] · w_scale[n]`` with fp8 operands, a float32
accumulator and the model dtype out: the same product as ``torch._scaled_mm`` with row-wise scales,
whose CUTLASS kernels are tuned for large M and leave HBM bandwidth unused below a few hundred rows.
``w`` is the weight as stored, [N, K] with K contiguous (K-major, what fp8 tensor cores take).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rollout.kernels.pdl import pdl_launch, pdl_prologue


@dataclass(frozen=True)
class GemmLaunch:
    """Tile sizes and pipeline depth of one launch."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_stages: int = 4
    num_warps: int = 4


@triton.jit
def _fp8_gemm_kernel(a_ptr, w_ptr, out_ptr, a_scale_ptr, w_scale_ptr, M, N, K, stride_am, stride_wn, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = (k0 + ks) < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    a_scale = tl.load(a_scale_ptr + rows, mask=row_ok, other=0.0)
    w_scale = tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)
    acc = acc * a_scale[:, None] * w_scale[None, :]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def default_launch(m: int, n: int, k: int) -> GemmLaunch:
    """The launch for an [m, k] x [k, n] product, m <= 16: the best of tools/bench_fp8_gemm.py's
    sweep on H200 for each Llama-3.1-8B projection (2 warps; narrow tiles and 512-deep K steps unless
    the output is wide)."""
    if n >= 8192:
        return GemmLaunch(block_m=16, block_n=64, block_k=256, num_stages=3, num_warps=2)
    return GemmLaunch(block_m=16, block_n=16 if n <= 4096 else 32, block_k=512,
                      num_stages=4 if k >= 8192 or n > 4096 else 3, num_warps=2)


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype, launch: GemmLaunch | None = None) -> torch.Tensor:
    """[M, N] in ``out_dtype`` from fp8 ``a`` [M, K] (scales [M] or [M, 1]) and fp8 ``w`` [N, K] (scales [N])."""
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(f"fp8_gemm needs a [M, K] and w [N, K], got {tuple(a.shape)} and {tuple(w.shape)}")
    if a.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("fp8_gemm needs rows with unit stride (K contiguous)")
    m, k = a.shape
    n = w.shape[0]
    launch = launch or default_launch(m, n, k)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    grid = (triton.cdiv(n, launch.block_n), triton.cdiv(m, launch.block_m))
    _fp8_gemm_kernel[grid](a, w, out, a_scale, w_scale, m, n, k, a.stride(0), w.stride(0), out.stride(0),
                           BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
                           NUM_STAGES=launch.num_stages, num_warps=launch.num_warps, **pdl_launch(a.device))
    return out
