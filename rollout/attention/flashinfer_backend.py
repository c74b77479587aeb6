"""FlashInfer paged attention: prefill/extend (prefix hits, chunks; fresh prompts over a float8 pool through
the ragged kernel) and, unless built prefill-only, decode (eager and in CUDA graphs).

Each forward is planned once (``init_forward_metadata``); every layer then runs the planned wrapper over
its own K/V buffers, viewed as ``[rows, 1, num_kv_heads, head_dim]`` (NHD, one slot per FlashInfer page,
whatever the engine's page size). All wrappers share ``SharedBuffers``' workspace, index buffer and plan
event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rollout.attention.base import AttentionBackend
from rollout.attention.common import AttentionSpec, SharedBuffers, host_indptr, kv_indices_for
from rollout.model_executor.forward_batch import ForwardMode

if TYPE_CHECKING:
    from rollout.layers.attention import Attention
    from rollout.model_executor.forward_batch import ForwardBatch


@dataclass
class FlashInferMetadata:
    """A planned FlashInfer wrapper for one forward. ``ragged``: a ragged prefill, attention of fresh prompts
    (no cached prefix) over their own K/V as the model computed them, not as the float8 pool stores them
    (as SGLang does for new tokens); else a paged prefill or decode over the pool."""

    wrapper: Any
    ragged: bool = False


@dataclass
class FlashInferGraphState:
    """CUDA-graph-safe decode state for one padded batch size: a decode wrapper bound to fixed index buffers
    (``indptr``, ``last_page_len`` and the shared ``kv_indices_buf``)."""

    batch_size: int
    wrapper: Any
    indptr: torch.Tensor
    last_page_len: torch.Tensor


class FlashInferBackend(AttentionBackend):
    """Plans FlashInfer's batch prefill / decode kernels per forward and runs them per layer.

    ``with_decode`` False: a prefill-only backend (``HybridAttnBackend``'s prefill half); decode batches
    are refused and no decode wrapper is made."""

    def __init__(self, spec: AttentionSpec, shared: SharedBuffers, with_decode: bool = True) -> None:
        """Float8 pools (unit scale): FlashInfer widens K/V to the query's type inside the kernel, a single
        instruction to float16 and not to bf16 (docs/benchmarks.md), so queries enter as float16 (exact for
        bf16 values of magnitude 6e-5 to 65504) and the output returns to ``spec.dtype``."""
        import flashinfer

        self.flashinfer = flashinfer
        self.spec = spec
        self.shared = shared
        self.q_dtype = torch.float16 if spec.kv_dtype.itemsize == 1 else spec.dtype
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(shared.workspace, "NHD")
        self.decode = (flashinfer.BatchDecodeWithPagedKVCacheWrapper(shared.workspace, "NHD", use_tensor_cores=True)
                       if with_decode else None)
        # float8 pools: fresh prompts attend over their unrounded K/V in the model dtype (the paged path reads
        # the float8 pool with float16 queries: a slower kernel plus a conversion of q and of the output)
        self.ragged = (flashinfer.BatchPrefillWithRaggedKVCacheWrapper(shared.workspace, "NHD")
                       if spec.kv_dtype.itemsize == 1 else None)

    @property
    def supports_cuda_graph(self) -> bool:
        return self.decode is not None

    def init_forward_metadata(self, batch: "ForwardBatch") -> None:
        if batch.mode == ForwardMode.DECODE:
            if self.decode is None:
                raise ValueError("this FlashInfer backend is prefill-only: decode batches go to its decode backend")
            batch.attn_metadata = self._plan_decode(batch, self.decode)
            return
        if self.ragged is not None and list(batch.extend_lens) == list(batch.seq_lens_cpu):
            batch.attn_metadata = self._plan_ragged(batch.extend_lens)
            return
        batch.attn_metadata = self._plan_paged_prefill(batch)

    def _plan_args(self, batch: "ForwardBatch") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kv_indptr on the host, kv_indices into ``kv_indices_buf`` on the device, last page lens on the
        host, kv lengths on the host) of ``batch``'s cached tokens, one slot per FlashInfer page. The host
        tensors are pinned: given no kv lengths, ``plan()`` computes them into pageable memory and copies them
        from there, a copy that can wait for the stream's queued work (no change measured in the bench)."""
        seq_lens = batch.seq_lens_cpu
        kv_indptr = host_indptr(seq_lens)
        kv_indices = kv_indices_for(batch.req_to_token, batch.req_pool_indices, batch.seq_lens, sum(seq_lens),
                                    out=self.shared.kv_indices_buf)
        last = torch.ones(len(seq_lens), dtype=torch.int32).pin_memory()
        kv_lens = torch.tensor(seq_lens, dtype=torch.int32).pin_memory()
        return kv_indptr, kv_indices, last, kv_lens

    def _common(self) -> dict:
        return dict(q_data_type=self.q_dtype, kv_data_type=self.spec.kv_dtype, sm_scale=self.spec.scaling)

    def _plan_paged_prefill(self, batch: "ForwardBatch") -> FlashInferMetadata:
        """Causal attention of each request's new tokens over all its cached tokens, read from the pool."""
        s = self.spec
        kv_indptr, kv_indices, last, kv_lens = self._plan_args(batch)
        self.shared.wait_for_last_plan()
        self.prefill.plan(host_indptr(batch.extend_lens), kv_indptr, kv_indices, last, s.num_qo_heads,
                          s.num_kv_heads, s.head_dim, 1, causal=True, seq_lens=kv_lens, **self._common())
        self.shared.record_plan()
        return FlashInferMetadata(self.prefill)

    def _plan_decode(self, batch: "ForwardBatch", wrapper: Any) -> FlashInferMetadata:
        """One query per request over its cached tokens, planned on ``wrapper`` (eager, or a graph's)."""
        s = self.spec
        kv_indptr, kv_indices, last, kv_lens = self._plan_args(batch)
        self.shared.wait_for_last_plan()
        wrapper.plan(kv_indptr, kv_indices, last, s.num_qo_heads, s.num_kv_heads, s.head_dim, 1, seq_lens=kv_lens,
                     **self._common())
        self.shared.record_plan()
        return FlashInferMetadata(wrapper)

    def _plan_ragged(self, extend_lens: list[int]) -> FlashInferMetadata:
        """Causal attention of each fresh prompt over itself, K/V in the model dtype (``forward`` gets them)."""
        s = self.spec
        self.shared.wait_for_last_plan()
        indptr = host_indptr(extend_lens)
        self.ragged.plan(indptr, indptr, s.num_qo_heads, s.num_kv_heads, s.head_dim, causal=True,
                         q_data_type=s.dtype, kv_data_type=s.dtype, sm_scale=s.scaling)
        self.shared.record_plan()
        return FlashInferMetadata(self.ragged, ragged=True)

    def wants_fresh_kv(self, batch: "ForwardBatch") -> bool:
        return batch.attn_metadata.ragged

    def graph_state(self, batch_size: int) -> FlashInferGraphState:
        """A decode wrapper bound to fixed buffers, for capture and replay at ``batch_size``."""
        dev = self.spec.device
        indptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=dev)
        last = torch.ones(batch_size, dtype=torch.int32, device=dev)
        wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.shared.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=self.shared.kv_indices_buf, paged_kv_last_page_len_buffer=last)
        return FlashInferGraphState(batch_size, wrapper, indptr, last)

    def init_graph_metadata(self, batch: "ForwardBatch", state: FlashInferGraphState) -> None:
        """A plan on the graph's wrapper (it copies the index lists into its fixed buffers)."""
        batch.attn_metadata = self._plan_decode(batch, state.wrapper)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: "Attention",
                batch: "ForwardBatch", kv_stored: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        pool = batch.kv_pool
        if k is not None and not kv_stored:  # else the model already wrote them (fused rope kernel)
            pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        meta = batch.attn_metadata
        if meta.ragged:
            if k is None:
                raise ValueError("a ragged prefill needs the new tokens' k and v (see wants_fresh_kv)")
            return meta.wrapper.run(q.contiguous(), k, v, out=out)
        k_buf, v_buf = pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id]
        q = q.to(self.q_dtype).contiguous()
        # an ``out`` always given, as the paged wrappers would zero-fill the one they make (a kernel per layer);
        # every row is written, since each query attends at least to its own token
        direct = out is not None and self.q_dtype == self.spec.dtype
        res = meta.wrapper.run(q, (k_buf.unsqueeze(1), v_buf.unsqueeze(1)), out=out if direct else torch.empty_like(q))
        if out is None or direct:
            return res if res.dtype == self.spec.dtype else res.to(self.spec.dtype)
        return out.copy_(res)
