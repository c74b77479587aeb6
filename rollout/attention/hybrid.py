"""One backend for prefill, another for decode (SGLang's ``HybridAttnBackend``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rollout.attention.base import AttentionBackend
from rollout.model_executor.forward_batch import ForwardMode

if TYPE_CHECKING:
    from rollout.layers.attention import Attention
    from rollout.model_executor.forward_batch import ForwardBatch


class HybridAttnBackend(AttentionBackend):
    """Sends EXTEND batches to ``prefill_backend`` and DECODE batches to ``decode_backend``; CUDA graphs
    (decode only) are the decode backend's."""

    def __init__(self, prefill_backend: AttentionBackend, decode_backend: AttentionBackend) -> None:
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend

    def _backend(self, batch: "ForwardBatch") -> AttentionBackend:
        return self.decode_backend if batch.mode == ForwardMode.DECODE else self.prefill_backend

    @property
    def supports_cuda_graph(self) -> bool:
        return self.decode_backend.supports_cuda_graph

    @property
    def max_shared_prefix_members(self) -> int:
        return self.decode_backend.max_shared_prefix_members

    def init_forward_metadata(self, batch: "ForwardBatch") -> None:
        self._backend(batch).init_forward_metadata(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: "Attention",
                batch: "ForwardBatch", kv_stored: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._backend(batch).forward(q, k, v, layer, batch, kv_stored=kv_stored, out=out)

    def wants_fresh_kv(self, batch: "ForwardBatch") -> bool:
        return self._backend(batch).wants_fresh_kv(batch)

    def wants_balanced_decode(self, seq_lens: list[int]) -> bool:
        return self.decode_backend.wants_balanced_decode(seq_lens)

    def reset_state(self) -> None:
        self.prefill_backend.reset_state()
        self.decode_backend.reset_state()

    def graph_state(self, batch_size: int) -> Any:
        return self.decode_backend.graph_state(batch_size)

    def init_graph_metadata(self, batch: "ForwardBatch", state: Any) -> None:
        self.decode_backend.init_graph_metadata(batch, state)

    def prepare_graph_replay(self, batch: "ForwardBatch", state: Any, packed: torch.Tensor,
                             last_token_ids: torch.Tensor) -> None:
        self.decode_backend.prepare_graph_replay(batch, state, packed, last_token_ids)
