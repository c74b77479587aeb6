"""The interface every attention backend implements."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rollout.layers.attention import Attention
    from rollout.model_executor.forward_batch import ForwardBatch


class AttentionBackend:
    """Writes a layer's new K/V into the paged pool and attends over each request's cached tokens.

    ``supports_cuda_graph``: decode forwards through this backend can be captured in CUDA graphs (the
    backend then also provides ``graph_state`` and the replay hooks ``CudaGraphRunner`` calls)."""

    supports_cuda_graph = False

    def init_forward_metadata(self, batch: "ForwardBatch") -> None:
        """Prepare per-batch metadata once before the layers run (index lists, planner state)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: "Attention",
                batch: "ForwardBatch", kv_stored: bool = False) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] for the new tokens → output [T, Hq, D]. k and v are None, or given
        with ``kv_stored``, when the model has already written them into the KV pool (given: a backend may
        attend to them there instead of reading them back, see ``wants_fresh_kv``)."""
        raise NotImplementedError

    def wants_fresh_kv(self, batch: "ForwardBatch") -> bool:
        """Whether this batch's attention reads the new tokens' K/V from the tensors passed to ``forward``
        (then a model that stores them itself passes them too, with ``kv_stored``)."""
        return False
