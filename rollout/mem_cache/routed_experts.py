"""The experts each token was routed to, kept per KV slot, for rollout routing replay (vLLM's and SGLang's
``enable_return_routed_experts``).

Contract: ``buffer[slot, j, k]`` is the k-th expert (largest routing weight first) that the ``j``-th sparse
layer routed the token whose KV lives in ``slot`` to. Each sparse layer writes its rows during the forward
that computes that token's KV (``record``, at the batch's ``out_cache_loc``; CUDA-graph safe), so the
rows live exactly as long as the KV: a prefix-cache hit finds its prefix's routing beside its KV, chunked
prefill writes chunk by chunk, and a weight update (which retires the cached KV) retires them too. Padding
rows write the scratch slot 0. ``read`` gives a request's rows in the public shape
[tokens, num_hidden_layers, top_k], int32, with -1 for the dense layers of a model that has some.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class RoutedExpertsPool:
    """``buffer``: [num_slots + page_size, num_sparse_layers, top_k] on the KV pool's device (int16 ids)."""

    def __init__(self, total_slots: int, num_layers: int, sparse_layers: tuple[int, ...], top_k: int,
                 device: Any) -> None:
        self.num_layers = num_layers
        self.sparse_layers = sparse_layers
        self.column = {layer: j for j, layer in enumerate(sparse_layers)}  # model layer -> buffer column
        self.buffer = torch.full((total_slots, len(sparse_layers), top_k), -1, dtype=torch.int16, device=device)

    @staticmethod
    def bytes_per_token(num_sparse_layers: int, top_k: int) -> int:
        return 2 * num_sparse_layers * top_k

    def record(self, layer: int, loc: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """Rows ``loc`` [T] of sparse layer ``layer`` = ``topk_ids`` [T, top_k] (no host synchronization)."""
        self.buffer[:, self.column[layer]].index_copy_(0, loc, topk_ids.to(torch.int16))

    def read(self, slots: torch.Tensor) -> np.ndarray:
        """The routing of the tokens in ``slots`` (CPU int64 [n]): int32 [n, num_layers, top_k], -1 on dense
        layers (one device-to-host copy)."""
        rows = self.buffer.index_select(0, slots.to(self.buffer.device)).cpu().numpy().astype(np.int32)
        if len(self.sparse_layers) == self.num_layers:
            return rows
        out = np.full((rows.shape[0], self.num_layers, rows.shape[2]), -1, dtype=np.int32)
        out[:, list(self.sparse_layers)] = rows
        return out
