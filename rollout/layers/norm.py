"""RMSNorm computed exactly as Hugging Face Llama/Qwen do, with an optional fused residual add.

``forward(x)`` returns the normalized x; ``forward(x, residual)`` returns ``(norm(residual + x),
residual + x)``. The torch path matches transformers bit for bit (float32 statistics, weight applied in
the model dtype); ``fused=True`` uses FlashInfer's CUDA kernels (one kernel for add + norm, in place), and takes
a split-K projection's ``SplitKPartials`` as x (one Triton kernel sums them, adds and normalizes).
``quantize_out=True`` (fused, before an fp8 projection) returns the normalized x as an ``Fp8Activation``
from one Triton kernel that also quantizes it (``rollout.kernels.fused_quant``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rollout.layers.linear import attach, replicated_view
from rollout.layers.split_k import SplitKPartials


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), statistics in float32, result in x's dtype."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: Any = None, fused: bool = False,
                 quantize_out: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.quantize_out = fused and quantize_out
        self.weight = attach(nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False),
                             replicated_view)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused:
            return self._fused(x, residual)
        if residual is None:
            return self._norm(x)
        h = residual + x
        return self._norm(h), h

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def _fused(self, x: torch.Tensor | SplitKPartials, residual: torch.Tensor | None):
        if isinstance(x, SplitKPartials):  # a split-K projection's output: summed by the add + norm kernel
            from rollout.kernels.add_rmsnorm import add_rmsnorm_split_k

            if residual is None:
                raise ValueError("split-K partials need the residual they are added to")
            return add_rmsnorm_split_k(x.partials, residual, self.weight, self.eps), residual
        if self.quantize_out:
            from rollout.kernels.fused_quant import add_rmsnorm_quant_fp8

            out = add_rmsnorm_quant_fp8(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        from flashinfer.norm import fused_add_rmsnorm, rmsnorm

        if residual is None:
            flat = x.reshape(-1, x.shape[-1])
            return rmsnorm(flat, self.weight, self.eps).view(x.shape)
        fused_add_rmsnorm(x, residual, self.weight, self.eps)  # residual += x; x = norm(residual)
        return x, residual
