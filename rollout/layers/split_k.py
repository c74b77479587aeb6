"""Split-K row-parallel projections for small batches, whose float32 partial sums the next add + RMSNorm adds up.

At decode batch sizes a projection with a narrow output and a long reduction (a small model's ``o_proj`` and
``down_proj``: [T, 2,048 or 3,072] x [1,024, ...]^T) has few output tiles, so cuBLAS runs it on a fraction of the
SMs or appends a split-K reduce kernel of its own. Here one strided-batched matmul computes ``SPLIT_K`` float32
partial products over slices of the reduction (``split_k_matmul``), and the residual add + RMSNorm that follows
the projection anyway sums them first (``rollout.kernels.add_rmsnorm.add_rmsnorm_split_k``): no kernel is
added, and the output is rounded to the model dtype once, as a plain matmul rounds its float32 accumulator.

``RowParallelLinear(split_k=True)`` (the fused CUDA path, whose norms take ``SplitKPartials``) does this on one
rank, unquantized and bias-free, when the reduction is at least twice the output (``split_k_supported``: the
Qwen3-0.6B ``o_proj`` and ``down_proj``, the Llama-3.1-8B ``down_proj``) and the batch has at most
``SPLIT_K_MAX_ROWS`` rows. Measurements: ``docs/rl_rollouts.md`` (``tools/exp_split_gemm.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SPLIT_K = 2             # slices of the reduction (4 and 8 were no faster in the whole decode step)
SPLIT_K_MAX_ROWS = 256  # above this the split matmul was no longer faster at every shape measured


@dataclass
class SplitKPartials:
    """A projection's output as ``partials`` float32 [S, T, N] to be summed over S (in order) and rounded to the
    model ``dtype``: what a ``RowParallelLinear(split_k=True)`` returns for a small batch, and only a fused
    ``RMSNorm`` with a residual takes."""

    partials: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.partials.shape[1:]


def split_k_supported(in_features: int, out_features: int) -> bool:
    """Whether a projection [in -> out] is split: a reduction at least twice the output, divisible in slices."""
    return in_features >= 2 * out_features and in_features % SPLIT_K == 0


def split_k_matmul(x: torch.Tensor, weight: torch.Tensor, splits: int = SPLIT_K) -> SplitKPartials:
    """``x @ weight.T`` (x [T, K] and weight [N, K] contiguous, K divisible by ``splits``) as ``splits`` float32
    partial products over consecutive K slices, from one strided-batched matmul (no copies)."""
    t, k = x.shape
    n = weight.shape[0]
    xs = x.view(t, splits, k // splits).transpose(0, 1)         # [S, T, K/S]
    ws = weight.view(n, splits, k // splits).permute(1, 2, 0)   # [S, K/S, N]
    if x.device.type == "cuda":
        part = torch.bmm(xs, ws, out_dtype=torch.float32)
    else:  # the same float32 products and sums (the CPU has no mixed-dtype bmm)
        part = torch.bmm(xs.float(), ws.float())
    return SplitKPartials(part, x.dtype)
