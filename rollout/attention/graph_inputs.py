"""The decode CUDA-graph state and one-launch replay preparation that the Triton and XQA decode backends share
(``rollout.kernels.decode_indices.prepare_decode``). GPU only: imports Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollout.kernels.decode_indices import DecodeBuffers, prepare_decode

if TYPE_CHECKING:
    from rollout.model_executor.forward_batch import ForwardBatch


@dataclass
class DecodeGraphState:
    """A decode CUDA graph's fixed ``indptr`` buffer [batch_size + 1] at its padded ``batch_size`` (the slot
    lists go to the shared ``kv_indices_buf``, XQA's page lists to its page table), with ``prefix_size``
    the fixed int32 buffer of its cascade variant's groups (``SharedPrefixes.pack``), and with
    ``launch_order`` the fixed int32 ``order`` [batch_size] of the Triton kernel's programs (longest first)."""

    batch_size: int
    indptr: torch.Tensor
    prefix: torch.Tensor | None = None
    order: torch.Tensor | None = None

    @classmethod
    def new(cls, batch_size: int, device: torch.device, prefix_size: int = 0,
            launch_order: bool = False) -> "DecodeGraphState":
        prefix = torch.zeros(prefix_size, dtype=torch.int32, device=device) if prefix_size else None
        order = torch.arange(batch_size, dtype=torch.int32, device=device) if launch_order else None
        return cls(batch_size, torch.zeros(batch_size + 1, dtype=torch.int32, device=device), prefix, order)


def prepare_graph_decode(batch: "ForwardBatch", state: DecodeGraphState, packed: torch.Tensor,
                         last_token_ids: torch.Tensor, indices: torch.Tensor, page_table: torch.Tensor | None = None,
                         page_size: int = 1) -> torch.Tensor:
    """``AttentionBackend.prepare_graph_replay``'s writes in one kernel launch (``prepare_decode``) and no host
    wait: the B out slots into ``batch.req_to_token``; ``input_ids`` (gathered from ``last_token_ids``),
    ``positions``, ``out_cache_loc``, ``req_pool_indices`` and ``seq_lens`` of rows [0, P) (padding: zeros,
    seq len 1); ``state.indptr``; the slot lists into ``indices`` (with ``page_table``: the page lists of
    ``page_size``-token pages into it instead); and ``state.order`` when the state has one. Returns
    ``indices[:total]`` (or ``page_table[:P]``).

    ``batch``: the graph's decode batch at its padded size P = ``len(batch.seq_lens_cpu)`` (host seq lens:
    the real ones, then 1 per padding row), its tensors the graph's static buffers; ``packed``: int64 [4, B]
    on the device, B <= P (``StepInput.decode_pack``)."""
    out = DecodeBuffers(batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices,
                        batch.seq_lens)
    return prepare_decode(packed, last_token_ids, batch.req_to_token, out, state.indptr, indices,
                          len(batch.seq_lens_cpu), sum(batch.seq_lens_cpu), page_table=page_table,
                          page_size=page_size, order=state.order)
