"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary rows."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rollout.distributed import TPGroup
from rollout.layers.linear import ShardSpec, attach


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows are split across ranks; the vocabulary is padded to a multiple of tp_size."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, dtype: torch.dtype,
                 device: Any = None) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_local = -(-vocab_size // tp.size)
        self.start = tp.rank * self.rows_local
        self.valid_local = max(0, min(vocab_size - self.start, self.rows_local))
        weight = nn.Parameter(torch.zeros(self.rows_local, hidden_size, dtype=dtype, device=device),
                              requires_grad=False)
        self.weight = attach(weight, self._vocab_view)

    def _vocab_view(self, param: nn.Parameter, shard_id: Any = None) -> tuple[torch.Tensor, ShardSpec]:
        return param.data.narrow(0, 0, self.valid_local), ShardSpec(0, self.start, self.valid_local)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, vocab-sharded like the embedding; ``logits`` gathers the full vocabulary."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    @property
    def padded_vocab_size(self) -> int:
        return self.rows_local * self.tp.size

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [T, vocab] of ``hidden`` [T, H]; ``out`` [T, ``padded_vocab_size``] (contiguous, the weight's
        dtype) receives the full padded logits without a copy on one rank (a CUDA graph's output buffer)."""
        if out is not None and self.tp.size == 1:
            return torch.mm(hidden, self.weight.t(), out=out)[..., : self.vocab_size]
        local = F.linear(hidden, self.weight)
        full = self.tp.all_gather_last_dim(local, out)
        return full[..., : self.vocab_size]
