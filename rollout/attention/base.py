"""The interface every attention backend implements, and two helpers of the decode-only backends and graphs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rollout.model_executor.forward_batch import ForwardMode

if TYPE_CHECKING:
    from rollout.layers.attention import Attention
    from rollout.model_executor.forward_batch import ForwardBatch


class AttentionBackend:
    """Writes a layer's new K/V into the paged pool and attends over each request's cached tokens.

    Per forward: ``init_forward_metadata`` once, then ``forward`` per layer (``wants_fresh_kv`` tells the
    model whether to pass the new K/V it already stored).

    ``supports_cuda_graph``: decode forwards through this backend can be captured in CUDA graphs; the backend
    then implements the graph hooks ``CudaGraphRunner`` calls, for decode batches only:
    ``graph_state`` (once per padded batch size), ``init_graph_metadata`` (before capture) and
    ``prepare_graph_replay`` (before every replay).

    ``max_shared_prefix_members``: the most rows of one ``ForwardBatch.shared_prefixes`` group a decode forward
    takes (cascade decode; 0: the backend ignores the groups). A backend that takes them builds its graph
    states with room for them: ``CudaGraphRunner`` then captures a cascade variant of each graph, replayed for
    batches with groups."""

    supports_cuda_graph: bool = False
    max_shared_prefix_members: int = 0

    def init_forward_metadata(self, batch: "ForwardBatch") -> None:
        """Prepare per-batch metadata once before the layers run (index lists, planner state); sets
        ``batch.attn_metadata``."""

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: "Attention",
                batch: "ForwardBatch", kv_stored: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] for the new tokens → output [T, Hq, D] (written into ``out``, of that
        shape and the model dtype, when given: a piecewise CUDA graph's fixed buffer). k and v are None, or
        given with ``kv_stored``, when the model has already written them into the KV pool (given: a backend
        may attend to them there instead of reading them back, see ``wants_fresh_kv``)."""
        raise NotImplementedError

    def wants_fresh_kv(self, batch: "ForwardBatch") -> bool:
        """Whether this batch's attention reads the new tokens' K/V from the tensors passed to ``forward``
        (then a model that stores them itself passes them too, with ``kv_stored``). Called after
        ``init_forward_metadata``."""
        return False

    def wants_balanced_decode(self, seq_lens: list[int]) -> bool:
        """Whether a decode step over requests of these cached lengths should cut them into pieces by length (the
        scheduler asks once per step and sends the answer as ``StepInput.balanced_decode``; a backend without
        such a kernel says no)."""
        return False

    def reset_state(self) -> None:
        """Zero whatever state the kernels expect to find at zero between launches (called after the KV
        cache's memory was released and resumed: new memory holds anything)."""

    def graph_state(self, batch_size: int) -> Any:
        """The fixed-address state (index buffers, planned wrappers) of one decode CUDA graph at the padded
        ``batch_size``: made once per size, kept for every capture and replay of that graph."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_graph_metadata(self, batch: "ForwardBatch", state: Any) -> None:
        """Plan the decode ``batch`` (its tensors the graph's static buffers, its inputs already there) on
        ``state``'s fixed buffers and set ``batch.attn_metadata``: what the kernels captured next will read."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_graph_replay(self, batch: "ForwardBatch", state: Any, packed: torch.Tensor,
                             last_token_ids: torch.Tensor) -> None:
        """Everything a replay of ``state``'s graph reads, without a host wait: writes the step's out slots
        into ``batch.req_to_token``, fills the graph's static inputs (``batch``'s tensors, padded) and
        re-plans attention on ``state``'s buffers; sets ``batch.attn_metadata``.

        ``batch``: the graph's decode batch at its padded size P = ``len(batch.seq_lens_cpu)`` (host seq
        lens: the real ones, then 1 per padding row); ``packed``: int64 [4, B] on the device, B <= P
        (``StepInput.decode_pack``); ``last_token_ids``: each request row's newest token.
        Default: ``copy_decode_inputs`` (torch ops), then ``init_graph_metadata``."""
        copy_decode_inputs(batch, packed, last_token_ids)
        self.init_graph_metadata(batch, state)


def require_decode(batch: "ForwardBatch", name: str) -> None:
    """Raise unless ``batch`` is a decode batch (the guard of the decode-only backends)."""
    if batch.mode != ForwardMode.DECODE:
        raise ValueError(f"the {name} attention backend runs decode batches only (prefill: HybridAttnBackend)")


def copy_decode_inputs(batch: "ForwardBatch", packed: torch.Tensor, last_token_ids: torch.Tensor) -> None:
    """The request-table write and the static decode inputs of rows [0, P) of ``batch`` by torch ops: the
    real batch's B from ``packed`` (rows, positions, out slots, seq lens), padding rows (B..P-1) writing their
    KV to the scratch slot 0 and reading one cached token (the torch counterpart of
    ``rollout.kernels.decode_indices.prepare_decode``'s ``DecodeBuffers`` writes)."""
    rows, positions, out_slots, seq_lens = packed.unbind(0)
    b, bs = rows.shape[0], len(batch.seq_lens_cpu)
    batch.req_to_token[rows, positions] = out_slots.to(torch.int32)
    batch.input_ids[:b].copy_(last_token_ids[rows])
    batch.req_pool_indices[:b].copy_(rows)
    batch.positions[:b].copy_(positions)
    batch.out_cache_loc[:b].copy_(out_slots)
    batch.seq_lens[:b].copy_(seq_lens)
    if bs > b:
        pad_decode_inputs(batch, b)


def pad_decode_inputs(batch: "ForwardBatch", start: int) -> None:
    """Rows [start, P) of a decode ``batch``'s static inputs as padding: they write their KV to the scratch slot
    0 (row 0, position 0, token 0) and read one cached token."""
    batch.input_ids[start:].zero_()
    batch.positions[start:].zero_()
    batch.out_cache_loc[start:].zero_()
    batch.req_pool_indices[start:].zero_()
    batch.seq_lens[start:].fill_(1)
