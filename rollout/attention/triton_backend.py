"""Triton split-KV decode attention (``rollout.kernels.decode_attention``) over the page-size-1 view of the KV
pool, its index lists built on the device (``rollout.kernels.decode_indices``): no host copy and no plan to
wait for. Decode batches only (prefill: ``HybridAttnBackend`` pairs it with FlashInfer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollout.attention.base import AttentionBackend, require_decode
from rollout.attention.common import AttentionSpec, SharedBuffers
from rollout.attention.graph_inputs import DecodeGraphState, prepare_graph_decode
from rollout.kernels.decode_attention import decode_attention, num_kv_splits
from rollout.kernels.decode_indices import write_kv_indices

if TYPE_CHECKING:
    from rollout.layers.attention import Attention
    from rollout.model_executor.forward_batch import ForwardBatch


@dataclass
class TritonDecodeMetadata:
    """What the Triton decode kernel needs per forward: device ``kv_indptr`` [B + 1], ``kv_indices``
    (int32 slots) and the number of KV splits (fixed per batch size)."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    num_splits: int


class TritonAttnBackend(AttentionBackend):
    """Decode through the Triton split-KV kernel, its splits merged inside the kernel (``split_counters``)."""

    supports_cuda_graph = True

    def __init__(self, spec: AttentionSpec, shared: SharedBuffers) -> None:
        self.spec = spec
        self.shared = shared
        # one count per (request, KV head), 0 between launches, so the splits merge inside the first kernel;
        # sized for max_batch_size requests (a larger decode batch raises in decode_attention)
        self.split_counters = torch.zeros(spec.max_batch_size * spec.num_kv_heads, dtype=torch.int32,
                                          device=spec.device)

    def reset_state(self) -> None:
        self.split_counters.zero_()

    def init_forward_metadata(self, batch: "ForwardBatch") -> None:
        require_decode(batch, "triton")
        b = len(batch.seq_lens_cpu)
        batch.attn_metadata = self._metadata(batch, torch.empty(b + 1, dtype=torch.int32, device=self.spec.device))

    def _metadata(self, batch: "ForwardBatch", indptr: torch.Tensor) -> TritonDecodeMetadata:
        """Device-side index lists from one kernel launch (no host copy to wait for, so no event either):
        ``kv_indptr`` (cumulative sum of the device ``seq_lens``, into ``indptr``: a graph's fixed buffer
        when there is one) and ``kv_indices`` (into ``kv_indices_buf``)."""
        indices = write_kv_indices(batch.req_to_token, batch.req_pool_indices, batch.seq_lens, indptr,
                                   self.shared.kv_indices_buf, sum(batch.seq_lens_cpu))
        return self._with_splits(indptr, indices, len(batch.seq_lens_cpu))

    def _with_splits(self, indptr: torch.Tensor, indices: torch.Tensor, batch_size: int) -> TritonDecodeMetadata:
        return TritonDecodeMetadata(indptr, indices, num_kv_splits(batch_size, self.spec.num_kv_heads,
                                                                   self.shared.num_sms, self.spec.kv_dtype.itemsize))

    def graph_state(self, batch_size: int) -> DecodeGraphState:
        return DecodeGraphState.new(batch_size, self.spec.device)

    def init_graph_metadata(self, batch: "ForwardBatch", state: DecodeGraphState) -> None:
        batch.attn_metadata = self._metadata(batch, state.indptr)

    def prepare_graph_replay(self, batch: "ForwardBatch", state: DecodeGraphState, packed: torch.Tensor,
                             last_token_ids: torch.Tensor) -> None:
        """Inputs, table write and index lists in one launch (``prepare_graph_decode``)."""
        indices = prepare_graph_decode(batch, state, packed, last_token_ids, self.shared.kv_indices_buf)
        batch.attn_metadata = self._with_splits(state.indptr, indices, len(batch.seq_lens_cpu))

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: "Attention",
                batch: "ForwardBatch", kv_stored: bool = False) -> torch.Tensor:
        pool = batch.kv_pool
        if k is not None and not kv_stored:  # else the model already wrote them (fused rope kernel)
            pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        meta: TritonDecodeMetadata = batch.attn_metadata
        k_buf, v_buf = pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id]
        # the kernel rounds q to its compute type and writes spec.dtype itself
        out = torch.empty(q.shape, dtype=self.spec.dtype, device=q.device)
        return decode_attention(q.contiguous(), k_buf, v_buf, meta.kv_indptr, meta.kv_indices, self.spec.scaling,
                                meta.num_splits, out=out, counters=self.split_counters)
