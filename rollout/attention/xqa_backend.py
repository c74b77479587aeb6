"""FlashInfer's XQA decode kernel (TensorRT-LLM's) over the KV pool's pages of 16-128 tokens
(``EngineConfig.page_size``, ``KVPool.paged``), each request's page list in a device page table. Decode
batches only (prefill: ``HybridAttnBackend`` pairs it with FlashInfer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollout.attention.base import AttentionBackend, require_decode
from rollout.attention.common import WORKSPACE_BYTES, AttentionSpec, SharedBuffers
from rollout.attention.graph_inputs import DecodeGraphState, prepare_graph_decode

if TYPE_CHECKING:
    from rollout.layers.attention import Attention
    from rollout.model_executor.forward_batch import ForwardBatch

SEMAPHORE_BYTES = 8 << 20  # the head of the XQA workspace: its semaphores


@dataclass
class XqaDecodeMetadata:
    """What XQA needs per forward: ``page_table`` int32 [B, W] (the KV pages of each request, in order),
    ``seq_lens`` int32 [B] on the device (read as uint32), ``max_seq_len`` = W * page size."""

    page_table: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int


class XqaAttnBackend(AttentionBackend):
    """Decode through ``flashinfer.xqa.xqa``. The page table holds up to ``spec.max_batch_size`` requests of
    ``spec.max_context_len`` tokens; a CUDA-graph replay fills it (and the graph's inputs) in one launch."""

    supports_cuda_graph = True

    def __init__(self, spec: AttentionSpec, shared: SharedBuffers) -> None:
        from flashinfer.xqa import xqa

        self.xqa = xqa
        self.spec = spec
        self.shared = shared
        p = spec.page_size
        # semaphores (first 8 MiB, zero before first use, as XQA leaves them) and scratch for its split merge
        self.xqa_workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=spec.device)
        self.page_table = torch.zeros((spec.max_batch_size, -(-max(spec.max_context_len, 1) // p)),
                                      dtype=torch.int32, device=spec.device)

    def reset_state(self) -> None:
        self.xqa_workspace[:SEMAPHORE_BYTES].zero_()

    def init_forward_metadata(self, batch: "ForwardBatch") -> None:
        """The page lists of an eager decode batch, by torch ops on the device table (no host wait)."""
        require_decode(batch, "xqa")
        p = self.spec.page_size
        table = self.page_table[:len(batch.seq_lens_cpu)]  # a decode batch holds at most max_batch_size
        firsts = batch.req_to_token[:, ::p][batch.req_pool_indices]  # [B, W]: each page's first slot
        table[:, :firsts.shape[1]].copy_(torch.div(firsts, p, rounding_mode="floor"))
        batch.attn_metadata = XqaDecodeMetadata(table, batch.seq_lens.to(torch.int32), table.shape[1] * p)

    def graph_state(self, batch_size: int) -> DecodeGraphState:
        return DecodeGraphState.new(batch_size, self.spec.device)

    def init_graph_metadata(self, batch: "ForwardBatch", state: DecodeGraphState) -> None:
        """As eager: the page table's first rows are a fixed buffer, and so are the graph's int32 seq lens
        (``.to(torch.int32)`` returns that same tensor)."""
        self.init_forward_metadata(batch)

    def prepare_graph_replay(self, batch: "ForwardBatch", state: DecodeGraphState, packed: torch.Tensor,
                             last_token_ids: torch.Tensor) -> None:
        """Inputs, table write and page lists in one launch (``prepare_graph_decode``)."""
        p = self.spec.page_size
        pages = prepare_graph_decode(batch, state, packed, last_token_ids, self.shared.kv_indices_buf,
                                     page_table=self.page_table, page_size=p)
        batch.attn_metadata = XqaDecodeMetadata(pages, batch.seq_lens, pages.shape[1] * p)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: "Attention",
                batch: "ForwardBatch", kv_stored: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """XQA over NHD pages. With a float8 pool on Hopper it runs TensorRT-LLM's float8 kernel, which
        rounds q (scaled by ``scaling * sqrt(head_dim)``, here 1 for the standard scale) and the softmax
        weights to float8 e4m3 for float8 tensor-core products; 16-bit pools run its 16-bit kernel."""
        pool = batch.kv_pool
        if k is not None and not kv_stored:  # else the model already wrote them (fused rope kernel)
            pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        meta: XqaDecodeMetadata = batch.attn_metadata
        s = self.spec
        k_pages = pool.paged(pool.k_buffers[layer.layer_id])
        v_pages = pool.paged(pool.v_buffers[layer.layer_id])
        q = q.contiguous()
        if out is None:
            out = torch.empty(q.shape, dtype=s.dtype, device=q.device)
        sem, scratch = self.xqa_workspace[:SEMAPHORE_BYTES], self.xqa_workspace[SEMAPHORE_BYTES:]
        self.xqa(q.to(s.dtype).unsqueeze(1), k_pages, v_pages, meta.page_table, meta.seq_lens.unsqueeze(1),
                 out.unsqueeze(1), scratch, sem, s.num_kv_heads, s.page_size,
                 q_scale=s.scaling * s.head_dim ** 0.5, kv_scale=1.0, kv_layout="NHD", sm_count=self.shared.num_sms,
                 enable_pdl=True)
        return out
