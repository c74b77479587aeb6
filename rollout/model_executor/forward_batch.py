"""What one forward pass computes: the flattened tokens of a batch and where their KV lives."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rollout.attention.base import AttentionBackend
    from rollout.mem_cache.kv_pool import KVPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"   # prefill (possibly a chunk, possibly after a cached prefix)
    DECODE = "decode"   # one new token per request


@dataclass
class ForwardBatch:
    """Inputs of one model forward.

    ``input_ids``, ``positions`` and ``out_cache_loc`` are flattened over the batch ([T]); request ``i``
    contributes ``extend_lens[i]`` tokens whose KV is written to ``out_cache_loc`` and which attend to
    its first ``seq_lens[i]`` cached tokens (listed in ``req_to_token[req_pool_indices[i]]``).
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: list[int]
    extend_lens: list[int]
    kv_pool: "KVPool"
    req_to_token: torch.Tensor
    attn_backend: "AttentionBackend"
    attn_metadata: Any = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    def last_token_indices(self) -> torch.Tensor | None:
        """Index into the flattened tokens of each request's last token (whose logits we sample);
        None in decode, where every token is one (and nothing may be copied in a CUDA graph)."""
        if self.mode == ForwardMode.DECODE:
            return None
        ends = torch.tensor(self.extend_lens, dtype=torch.int64).cumsum(0) - 1
        return ends.to(self.input_ids.device, non_blocking=True)
