"""The interface every attention backend implements."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rollout.layers.attention import Attention
    from rollout.model_executor.forward_batch import ForwardBatch


class AttentionBackend:
    """Writes a layer's new K/V into the paged pool and attends over each request's cached tokens."""

    def init_forward_metadata(self, batch: "ForwardBatch") -> None:
        """Prepare per-batch metadata once before the layers run (index lists, planner state)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: "Attention",
                batch: "ForwardBatch") -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] for the new tokens → output [T, Hq, D]. k and v are None when the
        model has already written them into the KV pool."""
        raise NotImplementedError
