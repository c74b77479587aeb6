"""What one forward pass computes: the flattened tokens of a batch and where their KV lives."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rollout.attention.base import AttentionBackend
    from rollout.mem_cache.kv_pool import KVPool


@dataclass(frozen=True)
class SharedPrefixes:
    """Rows of a decode batch that share their first KV slots (a cached prompt: GRPO's N samples of one prompt),
    for cascade decode attention, which reads each group's prefix once for all its rows.

    Group ``g``: rows ``members[g]`` (batch indices, at least 2, each row in at most one group) whose first
    ``prefix_lens[g]`` (>= 1) slots are the same, every member's seq len above it."""

    prefix_lens: tuple[int, ...]
    members: tuple[tuple[int, ...], ...]

    def pack(self, batch_size: int, max_groups: int, max_members: int, pin: bool = False) -> torch.Tensor:
        """Host int32 [batch_size + max_groups * (1 + max_members)] (the kernel's layout,
        ``rollout.kernels.decode_attention.SharedPrefixArgs``): each row's group prefix length (0: none), then
        per group its prefix length and members padded with -1; groups past the last have length 0."""
        if len(self.members) > max_groups or any(len(m) > max_members for m in self.members):
            raise ValueError(f"{len(self.members)} groups of up to {max(map(len, self.members), default=0)} rows do "
                             f"not fit {max_groups} groups of {max_members}")
        out = torch.zeros(batch_size + max_groups * (1 + max_members), dtype=torch.int32, pin_memory=pin)
        table = out[batch_size:].view(max_groups, 1 + max_members)
        table[:, 1:] = -1
        if self.members:
            table[:len(self.members)] = torch.tensor(
                [[n, *m] + [-1] * (max_members - len(m)) for n, m in zip(self.prefix_lens, self.members)],
                dtype=torch.int32)
            rows = [r for m in self.members for r in m]
            out[rows] = torch.tensor([n for n, m in zip(self.prefix_lens, self.members) for _ in m], dtype=torch.int32)
        return out


class ForwardMode(enum.Enum):
    EXTEND = "extend"   # prefill (possibly a chunk, possibly after a cached prefix)
    DECODE = "decode"   # one new token per request


@dataclass
class ForwardBatch:
    """Inputs of one model forward.

    ``input_ids``, ``positions`` and ``out_cache_loc`` are flattened over the batch ([T]); request ``i``
    contributes ``extend_lens[i]`` tokens whose KV is written to ``out_cache_loc`` and which attend to
    its first ``seq_lens[i]`` cached tokens (listed in ``req_to_token[req_pool_indices[i]]``).
    ``shared_prefixes`` (decode, when the scheduler found some and the backend takes them): rows whose first
    slots are the same; a backend without cascade decode ignores it. ``balanced_decode`` (decode, the scheduler's
    ``StepInput.balanced_decode``; also a CUDA graph's variant): attention cuts the requests into pieces by
    length where the backend can (``AttentionBackend.wants_balanced_decode`` said so for these lengths).
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
    shared_prefixes: SharedPrefixes | None = None
    balanced_decode: bool = False

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
