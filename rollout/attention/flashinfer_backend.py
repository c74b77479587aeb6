"""GPU paged attention: FlashInfer for prefill/extend (prefix hits, chunks), and for decode FlashInfer, the
Triton split-KV kernel (``rollout.attention.triton_decode``) or FlashInfer's XQA kernel (KV pages of
16-128 tokens, ``EngineConfig.page_size``).

Each forward is planned once (``init_forward_metadata``); every layer then runs the planned kernel
over its own K/V buffers, viewed as ``[rows, 1, num_kv_heads, head_dim]`` (NHD, one slot per FlashInfer
page, whatever the engine's page size), or by XQA as ``KVPool.paged`` pages.
For CUDA graphs, ``DecodeGraphState`` holds a decode wrapper or Triton metadata with fixed buffers per
batch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rollout.attention.base import AttentionBackend
from rollout.attention.triton_decode import decode_attention, num_kv_splits
from rollout.attention.triton_indices import DecodeBuffers, prepare_decode, write_kv_indices
from rollout.config import DECODE_ATTENTION_BACKENDS
from rollout.model_executor.forward_batch import ForwardMode

if TYPE_CHECKING:
    from rollout.layers.attention import Attention
    from rollout.model_executor.forward_batch import ForwardBatch

WORKSPACE_BYTES = 256 << 20


def kv_indices_for(req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, total: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenation of ``req_to_token[rows[i], :seq_lens[i]]`` as int32, built on the device without
    a host sync (``total`` = sum of seq_lens, known on the host). Torch reference of
    ``rollout.attention.triton_indices.write_kv_indices`` (one launch, used for Triton decode)."""
    seq_lens = seq_lens.to(torch.int64)
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    row_of = torch.repeat_interleave(rows.to(torch.int64), seq_lens, output_size=total)
    pos = torch.arange(total, device=rows.device) - torch.repeat_interleave(starts, seq_lens, output_size=total)
    values = req_to_token[row_of, pos]
    if out is None:
        return values.to(torch.int32)
    out[:total].copy_(values)
    return out[:total]


@dataclass
class DecodeGraphState:
    """CUDA-graph-safe decode state for one padded batch size: its fixed index buffers and, for FlashInfer
    decode, the wrapper bound to them (None for Triton decode)."""

    batch_size: int
    wrapper: Any
    indptr: torch.Tensor
    last_page_len: torch.Tensor


@dataclass
class RaggedPrefill:
    """A planned FlashInfer ragged prefill: attention of fresh prompts (no cached prefix) over their own K/V
    as the model computed them, not as the float8 pool stores them (as SGLang does for new tokens)."""

    wrapper: Any


@dataclass
class XqaDecodeMetadata:
    """What XQA needs per forward: ``page_table`` int32 [B, W] (the KV pages of each request, in order),
    ``seq_lens`` int32 [B] on the device (read as uint32), ``max_seq_len`` = W * page size."""

    page_table: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int


@dataclass
class TritonDecodeMetadata:
    """What the Triton decode kernel needs per forward: device ``kv_indptr`` [B + 1], ``kv_indices``
    (int32 slots) and the number of KV splits (fixed per batch size)."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    num_splits: int


class FlashInferBackend(AttentionBackend):
    """Plans FlashInfer's batch prefill / decode kernels (or the Triton decode kernel) per forward and runs
    them per layer."""

    supports_cuda_graph = True

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, scaling: float, dtype: torch.dtype,
                 device: torch.device, max_kv_indices: int, kv_dtype: torch.dtype | None = None,
                 decode_backend: str = "auto", max_batch_size: int = 1024, page_size: int = 1,
                 max_context_len: int = 0) -> None:
        """``dtype`` is q's and the output's; ``kv_dtype`` the KV pool's (default ``dtype``);
        ``decode_backend`` one of ``DECODE_ATTENTION_BACKENDS`` ("auto": triton), for decode steps only;
        prefill is always FlashInfer; ``max_batch_size`` bounds a decode batch (the running requests).
        XQA decode reads the pool as pages of ``page_size`` tokens (``KVPool.paged``), a request's page
        list up to ``max_context_len`` tokens long.

        Float8 pools (unit scale): FlashInfer widens K/V to the query's type inside the kernel; to float16
        that is one instruction, to bf16 it is not (H200, batch 256 x 1,500 tokens, one layer: 0.35 ms with
        fp16 queries, 0.44 ms with bf16, 0.42 ms for a bf16 pool), so queries enter as float16 (exact for
        bf16 values of magnitude 6e-5 to 65504) and the output returns to ``dtype``."""
        import flashinfer

        self.flashinfer = flashinfer
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.scaling = scaling
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.q_dtype = torch.float16 if self.kv_dtype.itemsize == 1 else dtype
        self.device = device
        if decode_backend not in DECODE_ATTENTION_BACKENDS:
            raise ValueError(f"unknown decode backend {decode_backend!r}")
        self.decode_backend = "triton" if decode_backend == "auto" else decode_backend
        self.page_size = page_size
        if self.decode_backend == "xqa":
            from flashinfer.xqa import xqa

            self.xqa = xqa
            # semaphores (first 8 MiB, zero before first use, as XQA leaves them) and scratch for its split merge
            self.xqa_workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self.page_table = torch.zeros((max_batch_size, -(-max(max_context_len, 1) // page_size)),
                                          dtype=torch.int32, device=device)
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = (flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True)
                       if self.decode_backend == "flashinfer" else None)
        self.kv_indices_buf = torch.zeros(max_kv_indices, dtype=torch.int32, device=device)
        # float8 pools: fresh prompts attend over their unrounded K/V in the model dtype (the paged path reads
        # the float8 pool with float16 queries: a slower kernel plus a conversion of q and of the output)
        self.ragged = (flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
                       if self.kv_dtype.itemsize == 1 else None)
        # Triton decode: one count per (request, KV head), 0 between launches, so the splits merge inside the
        # first kernel; sized for max_batch_size requests (a larger decode batch raises in decode_attention)
        self.split_counters = (torch.zeros(max_batch_size * num_kv_heads, dtype=torch.int32, device=device)
                               if self.decode_backend == "triton" else None)
        self._planned: torch.cuda.Event | None = None  # recorded after the last plan's host-to-device copies

    def graph_state(self, batch_size: int) -> DecodeGraphState:
        """Decode state bound to fixed buffers (FlashInfer decode: a wrapper on them), for capture and replay
        at ``batch_size``."""
        indptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=self.device)
        last = torch.ones(batch_size, dtype=torch.int32, device=self.device)
        if self.decode_backend in ("triton", "xqa"):
            return DecodeGraphState(batch_size, None, indptr, last)
        wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=self.kv_indices_buf, paged_kv_last_page_len_buffer=last)
        return DecodeGraphState(batch_size, wrapper, indptr, last)

    def init_forward_metadata(self, batch: "ForwardBatch", graph: DecodeGraphState | None = None) -> None:
        if batch.mode == ForwardMode.DECODE and self.decode_backend == "triton":
            batch.attn_metadata = self._triton_decode_metadata(batch, graph)
            return
        if batch.mode == ForwardMode.DECODE and self.decode_backend == "xqa":
            batch.attn_metadata = self._xqa_metadata(batch)
            return
        seq_lens = batch.seq_lens_cpu
        if self.ragged is not None and batch.mode != ForwardMode.DECODE and list(batch.extend_lens) == list(seq_lens):
            batch.attn_metadata = self._plan_ragged(batch.extend_lens)
            return
        total = sum(seq_lens)
        kv_indptr = _indptr(seq_lens)
        kv_indices = kv_indices_for(batch.req_to_token, batch.req_pool_indices, batch.seq_lens, total,
                                    out=self.kv_indices_buf)
        last = torch.ones(len(seq_lens), dtype=torch.int32).pin_memory()
        common = dict(q_data_type=self.q_dtype, kv_data_type=self.kv_dtype, sm_scale=self.scaling)
        self._wait_for_last_plan()
        if batch.mode == ForwardMode.DECODE:
            wrapper = graph.wrapper if graph is not None else self.decode
            wrapper.plan(kv_indptr, kv_indices, last, self.num_qo_heads, self.num_kv_heads, self.head_dim, 1,
                         **common)
        else:
            wrapper = self.prefill
            wrapper.plan(_indptr(batch.extend_lens), kv_indptr, kv_indices, last, self.num_qo_heads,
                         self.num_kv_heads, self.head_dim, 1, causal=True, **common)
        self._record_plan()
        batch.attn_metadata = wrapper

    def _wait_for_last_plan(self) -> None:
        """plan() fills a pinned host buffer of the wrapper and queues its copy to the device; the copy
        queued by the previous plan may still be waiting behind the step in flight (overlap scheduling),
        so let it finish before the buffer is overwritten (it runs as soon as that step starts)."""
        if self._planned is not None:
            self._planned.synchronize()

    def _record_plan(self) -> None:
        self._planned = torch.cuda.Event()
        self._planned.record()

    def _plan_ragged(self, extend_lens: list[int]) -> RaggedPrefill:
        """Causal attention of each fresh prompt over itself, K/V in the model dtype (``forward`` gets them)."""
        self._wait_for_last_plan()
        indptr = _indptr(extend_lens)
        self.ragged.plan(indptr, indptr, self.num_qo_heads, self.num_kv_heads, self.head_dim, causal=True,
                         q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scaling)
        self._record_plan()
        return RaggedPrefill(self.ragged)

    def wants_fresh_kv(self, batch: "ForwardBatch") -> bool:
        return isinstance(batch.attn_metadata, RaggedPrefill)

    def _triton_decode_metadata(self, batch: "ForwardBatch", graph: DecodeGraphState | None) -> TritonDecodeMetadata:
        """Device-side index lists from one kernel launch (no host copy to wait for, so no event either):
        ``kv_indptr`` (cumulative sum of the device ``seq_lens``, into the graph's fixed buffer when there
        is one) and ``kv_indices`` (into ``kv_indices_buf``)."""
        b = len(batch.seq_lens_cpu)
        indptr = graph.indptr if graph is not None else torch.empty(b + 1, dtype=torch.int32, device=self.device)
        indices = write_kv_indices(batch.req_to_token, batch.req_pool_indices, batch.seq_lens, indptr,
                                   self.kv_indices_buf, sum(batch.seq_lens_cpu))
        return self._triton_metadata(indptr, indices, b)

    def _xqa_metadata(self, batch: "ForwardBatch") -> XqaDecodeMetadata:
        """The page lists of an eager decode batch, by torch ops on the device table (no host wait)."""
        p = self.page_size
        table = self.page_table[:len(batch.seq_lens_cpu)]  # a decode batch holds at most max_batch_size
        firsts = batch.req_to_token[:, ::p][batch.req_pool_indices]  # [B, W]: each page's first slot
        table[:, :firsts.shape[1]].copy_(torch.div(firsts, p, rounding_mode="floor"))
        return XqaDecodeMetadata(table, batch.seq_lens.to(torch.int32), table.shape[1] * p)

    @property
    def prepares_graph_inputs(self) -> bool:
        """Whether ``prepare_graph_decode`` fills a graph replay's inputs (Triton and XQA decode)."""
        return self.decode_backend in ("triton", "xqa")

    def prepare_graph_decode(self, batch: "ForwardBatch", graph: DecodeGraphState, packed: torch.Tensor,
                             last_token_ids: torch.Tensor) -> None:
        """Everything a Triton- or XQA-decode CUDA-graph replay needs, in one kernel launch (``prepare_decode``)
        and no host wait; sets ``batch.attn_metadata``.

        ``batch``: the graph's decode batch at its padded size P = ``len(batch.seq_lens_cpu)`` (host seq
        lens: the real ones, then 1 per padding row), its tensors the graph's static buffers; ``packed``:
        int64 [4, B] on the device, B <= P (``StepInput.decode_pack``). Writes the B out slots into
        ``batch.req_to_token``, ``input_ids`` (gathered from ``last_token_ids``), ``positions``,
        ``out_cache_loc``, ``req_pool_indices`` and ``seq_lens`` of rows [0, P) (padding: zeros, seq len
        1), ``graph.indptr`` and ``kv_indices_buf`` (XQA: the page table instead of the indices)."""
        if not self.prepares_graph_inputs:
            raise ValueError("prepare_graph_decode is for the Triton and XQA decode backends")
        bs = len(batch.seq_lens_cpu)
        out = DecodeBuffers(batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices,
                            batch.seq_lens)
        xqa = self.decode_backend == "xqa"
        lists = prepare_decode(packed, last_token_ids, batch.req_to_token, out, graph.indptr, self.kv_indices_buf, bs,
                               sum(batch.seq_lens_cpu), page_table=self.page_table if xqa else None,
                               page_size=self.page_size if xqa else 1)
        batch.attn_metadata = (XqaDecodeMetadata(lists, batch.seq_lens, lists.shape[1] * self.page_size) if xqa
                               else self._triton_metadata(graph.indptr, lists, bs))

    def _triton_metadata(self, indptr: torch.Tensor, indices: torch.Tensor, batch_size: int) -> TritonDecodeMetadata:
        return TritonDecodeMetadata(indptr, indices, num_kv_splits(batch_size, self.num_kv_heads, self.num_sms,
                                                                   self.kv_dtype.itemsize))

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: "Attention",
                batch: "ForwardBatch", kv_stored: bool = False) -> torch.Tensor:
        pool = batch.kv_pool
        if k is not None and not kv_stored:  # else the model already wrote them (fused rope kernel)
            pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        meta = batch.attn_metadata
        if isinstance(meta, RaggedPrefill):
            if k is None:
                raise ValueError("a ragged prefill needs the new tokens' k and v (see wants_fresh_kv)")
            return meta.wrapper.run(q.contiguous(), k, v)
        k_buf, v_buf = pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id]
        if isinstance(meta, XqaDecodeMetadata):
            return self._xqa_decode(q, pool.paged(k_buf), pool.paged(v_buf), meta)
        if isinstance(meta, TritonDecodeMetadata):  # rounds q to its compute type and writes self.dtype itself
            out = torch.empty(q.shape, dtype=self.dtype, device=q.device)
            return decode_attention(q.contiguous(), k_buf, v_buf, meta.kv_indptr, meta.kv_indices, self.scaling,
                                    meta.num_splits, out=out, counters=self.split_counters)
        out = meta.run(q.to(self.q_dtype).contiguous(), (k_buf.unsqueeze(1), v_buf.unsqueeze(1)))
        return out if out.dtype == self.dtype else out.to(self.dtype)

    def _xqa_decode(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                    meta: XqaDecodeMetadata) -> torch.Tensor:
        """XQA over NHD pages. With a float8 pool on Hopper it runs TensorRT-LLM's float8 kernel, which
        rounds q (scaled by ``scaling * sqrt(head_dim)``, here 1 for the standard scale) and the softmax
        weights to float8 e4m3 for float8 tensor-core products; 16-bit pools run its 16-bit kernel."""
        q = q.contiguous()
        out = torch.empty(q.shape, dtype=self.dtype, device=q.device)
        sem, scratch = self.xqa_workspace[:8 << 20], self.xqa_workspace[8 << 20:]
        self.xqa(q.to(self.dtype).unsqueeze(1), k_pages, v_pages, meta.page_table, meta.seq_lens.unsqueeze(1),
                 out.unsqueeze(1), scratch, sem, self.num_kv_heads, self.page_size,
                 q_scale=self.scaling * self.head_dim ** 0.5, kv_scale=1.0, kv_layout="NHD", sm_count=self.num_sms,
                 enable_pdl=True)
        return out


def _indptr(lengths: list[int]) -> torch.Tensor:
    """[0, l0, l0+l1, ...] as a pinned host int32 tensor (FlashInfer's planner reads it on the host and
    copies it to the device without waiting)."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out.pin_memory()
