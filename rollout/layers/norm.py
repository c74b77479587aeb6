"""RMSNorm computed exactly as Hugging Face Llama/Qwen do (float32 statistics, weight in model dtype)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rollout.layers.linear import attach, replicated_view


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), statistics in float32, result in x's dtype."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: Any = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = attach(nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False),
                             replicated_view)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
