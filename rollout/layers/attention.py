"""The attention layer: hands q/k/v of the new tokens to the batch's attention backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from rollout.model_executor.forward_batch import ForwardBatch


class Attention(nn.Module):
    """Paged attention for one layer (SGLang's ``RadixAttention``); holds no weights."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                batch: "ForwardBatch", kv_stored: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output [T, Hq * D] (written into ``out`` [T, Hq * D], contiguous, when given); k and v
        None (or given with ``kv_stored``) mean they are already in the KV pool."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        if k is not None:
            k = k.view(t, self.num_kv_heads, self.head_dim)
            v = v.view(t, self.num_kv_heads, self.head_dim)
        if out is not None:
            out = out.view(t, self.num_heads, self.head_dim)
        res = batch.attn_backend.forward(q, k, v, self, batch, kv_stored=kv_stored, out=out)
        return res.reshape(t, self.num_heads * self.head_dim)
