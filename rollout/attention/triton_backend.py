"""Triton split-KV decode attention (``rollout.kernels.decode_attention``) over the page-size-1 view of the KV
pool, its index lists built on the device (``rollout.kernels.decode_indices``): no host copy and no plan to
wait for. Decode batches only (prefill: ``HybridAttnBackend`` pairs it with FlashInfer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollout.attention.base import AttentionBackend, require_decode
from rollout.attention.common import AttentionSpec, SharedBuffers
from rollout.attention.graph_inputs import DecodeGraphState, prepare_graph_decode
from rollout.kernels.balanced_decode import (DecodePieces, balanced_decode_attention, balanced_programs, plan_pieces,
                                             wants_pieces)
from rollout.kernels.decode_attention import SharedPrefixArgs, decode_attention, max_prefix_members, num_kv_splits
from rollout.kernels.decode_indices import write_kv_indices

if TYPE_CHECKING:
    from rollout.layers.attention import Attention
    from rollout.model_executor.forward_batch import ForwardBatch


@dataclass
class TritonDecodeMetadata:
    """What the Triton decode kernels need per forward: device ``kv_indptr`` [B + 1], ``kv_indices``
    (int32 slots), the number of KV splits (fixed per batch size), the requests' launch order (longest first,
    ``decode_indices``), and either the step's pieces (``balanced_decode_attention``) or, for cascade decode,
    the groups of rows sharing a prefix."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    num_splits: int
    order: torch.Tensor
    shared_prefix: SharedPrefixArgs | None = None
    pieces: DecodePieces | None = None


class TritonAttnBackend(AttentionBackend):
    """Decode through the Triton split-KV kernel, or, at a step whose longest request holds
    ``spec.decode_balance_ratio`` times the mean tokens or more, the load-balanced kernel (each request cut
    into pieces by its length, planned once per step); partials merged inside the kernel (``split_counters``).
    Cascade decode for a batch's ``shared_prefixes`` (up to ``max_shared_prefix_members`` rows a group; 0 for
    models with more than 16 query heads per KV head)."""

    supports_cuda_graph = True

    def __init__(self, spec: AttentionSpec, shared: SharedBuffers) -> None:
        self.spec = spec
        self.shared = shared
        members = max_prefix_members(spec.num_qo_heads // spec.num_kv_heads)
        self.max_shared_prefix_members = members if members >= 2 else 0
        # one count per (request, KV head), 0 between launches, so the splits merge inside the first kernel;
        # sized for max_batch_size requests (a larger decode batch raises in decode_attention)
        self.split_counters = torch.zeros(spec.max_batch_size * spec.num_kv_heads, dtype=torch.int32,
                                          device=spec.device)
        # pieces beyond one a request (0 for an infinite decode_balance_ratio: the split-KV kernel only, and no
        # per-step look at the lengths) and each graph size's piece tables; float8 pools get the 16-bit count
        # too (8 programs per SM), the setting measured on them (docs/rl_rollouts.md)
        balance = math.isfinite(spec.decode_balance_ratio)
        self.piece_programs = balanced_programs(spec.num_kv_heads, shared.num_sms) if balance else 0
        self.graph_pieces: dict[int, DecodePieces] = {}

    def reset_state(self) -> None:
        self.split_counters.zero_()

    def wants_balanced_decode(self, seq_lens: list[int]) -> bool:
        """A longest request of at least ``decode_balance_ratio`` times the mean length: the split kernel's
        programs for it would outlast the rest (one H100, ``tools/exp_straggler.py``: whole decode steps
        1.57-2.92x faster over bf16 pools and 1.21-2.65x over float8 ones with one long request among 32-256;
        the split kernel stays up to 3% faster at equal lengths)."""
        return self.piece_programs > 0 and wants_pieces(seq_lens, self.spec.decode_balance_ratio)

    def init_forward_metadata(self, batch: "ForwardBatch") -> None:
        require_decode(batch, "triton")
        b = len(batch.seq_lens_cpu)
        batch.balanced_decode = batch.balanced_decode and batch.shared_prefixes is None and self.piece_programs > 0
        dev = self.spec.device
        batch.attn_metadata = self._metadata(batch, torch.empty(b + 1, dtype=torch.int32, device=dev),
                                             torch.empty(b, dtype=torch.int32, device=dev))

    def _metadata(self, batch: "ForwardBatch", indptr: torch.Tensor, order: torch.Tensor,
                  pieces: DecodePieces | None = None) -> TritonDecodeMetadata:
        """Device-side index lists from one kernel launch (no host copy to wait for, so no event either):
        ``kv_indptr`` (cumulative sum of the device ``seq_lens``, into ``indptr``: a graph's fixed buffer
        when there is one), ``kv_indices`` (into ``kv_indices_buf``) and the launch order (into ``order``);
        then the cascade groups, or with ``batch.balanced_decode`` the step's pieces (into ``pieces``: a
        graph's fixed tables when given)."""
        b = len(batch.seq_lens_cpu)
        indices = write_kv_indices(batch.req_to_token, batch.req_pool_indices, batch.seq_lens, indptr,
                                   self.shared.kv_indices_buf, sum(batch.seq_lens_cpu), order=order)
        meta = self._with_splits(indptr, indices, order, b)
        shared = batch.shared_prefixes
        cascade = shared is not None and self.max_shared_prefix_members > 0
        if cascade and shared.members:
            groups = len(shared.members)
            packed = shared.pack(b, groups, self.max_shared_prefix_members, pin=self.spec.device.type == "cuda")
            meta.shared_prefix = self._prefix_args(packed.to(self.spec.device, non_blocking=True), b, groups,
                                                   self._splits(groups))
        elif not cascade and batch.balanced_decode:
            meta.pieces = plan_pieces(indptr, b, pieces or DecodePieces.new(b, self.piece_programs, self.spec.device))
        return meta

    def _pieces_of(self, state: DecodeGraphState) -> DecodePieces | None:
        """The fixed piece tables of a graph size (created on first use; None when the backend never cuts pieces)."""
        bs = state.batch_size
        if self.piece_programs and bs not in self.graph_pieces:
            self.graph_pieces[bs] = DecodePieces.new(bs, self.piece_programs, self.spec.device)
        return self.graph_pieces.get(bs)

    def _with_splits(self, indptr: torch.Tensor, indices: torch.Tensor, order: torch.Tensor,
                     batch_size: int) -> TritonDecodeMetadata:
        return TritonDecodeMetadata(indptr, indices, self._splits(batch_size), order)

    def _splits(self, programs: int) -> int:
        """KV splits for ``programs`` (requests, or groups of stage 0) per KV head."""
        return num_kv_splits(programs, self.spec.num_kv_heads, self.shared.num_sms, self.spec.kv_dtype.itemsize)

    def _prefix_args(self, buf: torch.Tensor, batch_size: int, max_groups: int, splits: int) -> SharedPrefixArgs:
        """Views of a device ``SharedPrefixes.pack`` layout for the kernel."""
        table = buf[batch_size:].view(max_groups, 1 + self.max_shared_prefix_members)
        return SharedPrefixArgs(table, buf[:batch_size], splits)

    def _graph_groups(self, batch_size: int) -> int:
        """Groups a cascade graph of ``batch_size`` rows has room for (each has at least 2 rows)."""
        return batch_size // 2

    def graph_state(self, batch_size: int) -> DecodeGraphState:
        groups = self._graph_groups(batch_size) if self.max_shared_prefix_members else 0
        size = batch_size + groups * (1 + self.max_shared_prefix_members) if groups else 0
        return DecodeGraphState.new(batch_size, self.spec.device, size, launch_order=True)

    def init_graph_metadata(self, batch: "ForwardBatch", state: DecodeGraphState) -> None:
        pieces = self._pieces_of(state) if batch.balanced_decode else None
        batch.attn_metadata = self._metadata(batch, state.indptr, state.order, pieces)
        self._graph_prefix(batch, state)

    def prepare_graph_replay(self, batch: "ForwardBatch", state: DecodeGraphState, packed: torch.Tensor,
                             last_token_ids: torch.Tensor) -> None:
        """Inputs, table write and index lists in one launch (``prepare_graph_decode``); for the cascade graph
        (``batch.shared_prefixes`` set) one more copy: the groups into the graph's buffer."""
        indices = prepare_graph_decode(batch, state, packed, last_token_ids, self.shared.kv_indices_buf)
        batch.attn_metadata = self._with_splits(state.indptr, indices, state.order, len(batch.seq_lens_cpu))
        if batch.shared_prefixes is not None:
            groups, cuda = self._graph_groups(state.batch_size), self.spec.device.type == "cuda"
            state.prefix.copy_(batch.shared_prefixes.pack(state.batch_size, groups, self.max_shared_prefix_members,
                                                          pin=cuda), non_blocking=cuda)
        self._graph_prefix(batch, state)
        if batch.balanced_decode:
            batch.attn_metadata.pieces = plan_pieces(state.indptr, state.batch_size, self._pieces_of(state))

    def _graph_prefix(self, batch: "ForwardBatch", state: DecodeGraphState) -> None:
        """The cascade variant's stage 0 arguments over the graph's fixed buffer (stage 0 programs for about one
        group per 8 rows, as in GRPO with 8 samples a prompt)."""
        if batch.shared_prefixes is not None:
            if state.prefix is None:
                raise ValueError(f"no cascade decode graph at batch size {state.batch_size}")
            bs = state.batch_size
            batch.attn_metadata.shared_prefix = self._prefix_args(state.prefix, bs, self._graph_groups(bs),
                                                                  self._splits(max(1, bs // 8)))

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: "Attention",
                batch: "ForwardBatch", kv_stored: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        pool = batch.kv_pool
        if k is not None and not kv_stored:  # else the model already wrote them (fused rope kernel)
            pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        meta: TritonDecodeMetadata = batch.attn_metadata
        k_buf, v_buf = pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id]
        # the kernel rounds q to its compute type and writes spec.dtype itself
        if out is None:
            out = torch.empty(q.shape, dtype=self.spec.dtype, device=q.device)
        if meta.pieces is not None and meta.shared_prefix is None:
            return balanced_decode_attention(q.contiguous(), k_buf, v_buf, meta.kv_indptr, meta.kv_indices,
                                             self.spec.scaling, meta.pieces, self.split_counters, out=out)
        return decode_attention(q.contiguous(), k_buf, v_buf, meta.kv_indptr, meta.kv_indices, self.spec.scaling,
                                meta.num_splits, out=out, counters=self.split_counters,
                                shared_prefix=meta.shared_prefix, order=meta.order)
