"""Reference attention over the paged KV pool with torch's scaled_dot_product_attention (any device)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from rollout.attention.base import AttentionBackend
from rollout.model_executor.forward_batch import ForwardMode

if TYPE_CHECKING:
    from rollout.layers.attention import Attention
    from rollout.model_executor.forward_batch import ForwardBatch


class TorchNativeBackend(AttentionBackend):
    """One SDPA call per request: simple, exact (same kernels as transformers' sdpa path), slow on GPU."""

    def init_forward_metadata(self, batch: "ForwardBatch") -> None:
        rows = batch.req_pool_indices.tolist()
        batch.attn_metadata = [batch.req_to_token[row, :n].to(torch.int64)
                               for row, n in zip(rows, batch.seq_lens_cpu)]

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: "Attention",
                batch: "ForwardBatch", kv_stored: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        pool = batch.kv_pool
        if k is not None and not kv_stored:  # else the model already wrote them (fused rope kernel)
            pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id]
        out = torch.empty_like(q) if out is None else out
        start = 0
        for slots, ext, seq in zip(batch.attn_metadata, batch.extend_lens, batch.seq_lens_cpu):
            qi = q[start:start + ext].transpose(0, 1).unsqueeze(0)
            ki = k_buf[slots].to(q.dtype).transpose(0, 1).unsqueeze(0)  # float8 pools: unit-scale dequant
            vi = v_buf[slots].to(q.dtype).transpose(0, 1).unsqueeze(0)
            mask, causal = _mask(ext, seq, q.device, batch.mode)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=causal,
                                                scale=layer.scaling, enable_gqa=True)
            out[start:start + ext] = oi.squeeze(0).transpose(0, 1)
            start += ext
        return out


def _mask(ext: int, seq: int, device: torch.device, mode: ForwardMode) -> tuple[torch.Tensor | None, bool]:
    """Causal mask for ``ext`` new queries at the end of a ``seq``-token sequence."""
    if ext == 1 or mode == ForwardMode.DECODE:
        return None, False
    if ext == seq:
        return None, True
    q_pos = torch.arange(seq - ext, seq, device=device)[:, None]
    k_pos = torch.arange(seq, device=device)[None, :]
    return k_pos <= q_pos, False
