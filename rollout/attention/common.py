"""What the GPU attention backends share: the layer shape they are built for (``AttentionSpec``), the buffers
and plan event of one engine (``SharedBuffers``), and the torch index helpers.

Torch only: importing this module imports neither triton nor flashinfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WORKSPACE_BYTES = 256 << 20


@dataclass(frozen=True)
class AttentionSpec:
    """The attention a backend runs, on one TP rank: ``num_qo_heads`` / ``num_kv_heads`` of ``head_dim``,
    softmax ``scaling``; q and the output in ``dtype``, the KV pool in ``kv_dtype``, on ``device``.
    Sizes: a decode batch holds at most ``max_batch_size`` requests, a request at most ``max_context_len``
    tokens; the pool hands out pages of ``page_size`` slots (``KVPool.paged``). ``decode_balance_ratio``:
    ``EngineConfig``'s (when a decode backend cuts requests into pieces by length)."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    dtype: torch.dtype
    kv_dtype: torch.dtype
    device: torch.device
    max_batch_size: int = 1024
    max_context_len: int = 0
    page_size: int = 1
    decode_balance_ratio: float = 4.0

    @property
    def max_kv_indices(self) -> int:
        """Room for the KV slots of a full batch: every request at ``max_context_len`` tokens, plus one."""
        return self.max_batch_size * self.max_context_len + 1


class SharedBuffers:
    """The GPU state the backends of one engine share: FlashInfer's float ``workspace`` (every wrapper, eager
    and CUDA-graph), ``kv_indices_buf`` (int32 KV slot lists of a forward: FlashInfer plans, Triton decode
    and the CUDA graphs' fixed index buffer), the device's SM count, and the event of the last FlashInfer
    plan (see ``wait_for_last_plan``), one for prefill and decode plans alike."""

    def __init__(self, device: torch.device, max_kv_indices: int) -> None:
        self.device = device
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.kv_indices_buf = torch.zeros(max_kv_indices, dtype=torch.int32, device=device)
        self._planned: torch.cuda.Event | None = None  # recorded after the last plan's host-to-device copies

    def wait_for_last_plan(self) -> None:
        """plan() fills a pinned host buffer of the wrapper and queues its copy to the device; the copy
        queued by the previous plan may still be waiting behind the step in flight (overlap scheduling),
        so let it finish before the buffer is overwritten (it runs as soon as that step starts)."""
        if self._planned is not None:
            self._planned.synchronize()

    def record_plan(self) -> None:
        """Mark the end of a plan's queued copies (call right after ``plan()``)."""
        self._planned = torch.cuda.Event()
        self._planned.record()


def kv_indices_for(req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, total: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenation of ``req_to_token[rows[i], :seq_lens[i]]`` as int32, built on the device without
    a host sync (``total`` = sum of seq_lens, known on the host). Torch reference of
    ``rollout.kernels.decode_indices.write_kv_indices`` (one launch, used for Triton decode)."""
    seq_lens = seq_lens.to(torch.int64)
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    row_of = torch.repeat_interleave(rows.to(torch.int64), seq_lens, output_size=total)
    pos = torch.arange(total, device=rows.device) - torch.repeat_interleave(starts, seq_lens, output_size=total)
    values = req_to_token[row_of, pos]
    if out is None:
        return values.to(torch.int32)
    out[:total].copy_(values)
    return out[:total]


def host_indptr(lengths: list[int]) -> torch.Tensor:
    """[0, l0, l0+l1, ...] as a pinned host int32 tensor (FlashInfer's planner reads it on the host and
    copies it to the device without waiting)."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out.pin_memory()
