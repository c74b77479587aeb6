"""Preallocated KV-cache memory: the per-layer KV buffers, the slot allocator, and the request table.

Slots are token-granular pages (page size 1, as SGLang's default): a request holds one KV slot per
token, listed in its row of ``ReqToTokenPool``. Slot 0 is reserved as a scratch slot for padding.
"""

from __future__ import annotations

from typing import Any

import torch

from rollout.device_copy import to_device


class KVPool:
    """K and V buffers for every layer: ``[num_slots + 1, num_kv_heads, head_dim]`` each, in ``dtype``
    (the model dtype, or a float8 type: values are stored as ``x.to(float8)``, unit scale)."""

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: Any) -> None:
        self.num_slots = num_slots
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """buffers[layer_id][loc] = k, v, cast (rounded to nearest) to the pool dtype."""
        for buf, x in ((self.k_buffers[layer_id], k), (self.v_buffers[layer_id], v)):
            x = x.to(buf.dtype)
            if buf.element_size() == 1:  # float8: index_put through a byte view (not every build has fp8's)
                buf, x = buf.view(torch.uint8), x.view(torch.uint8)
            buf[loc] = x


class SlotAllocator:
    """Hands out KV slot indices 1..num_slots; all bookkeeping on the CPU (int64 tensors)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = [torch.arange(1, num_slots + 1, dtype=torch.int64)]
        self._num_free = num_slots

    @property
    def available(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` free slots, or None (nothing taken) when fewer than ``n`` are free."""
        if n > self._num_free:
            return None
        if len(self._free) > 1:
            self._free = [torch.cat(self._free)]
        out, rest = self._free[0][:n], self._free[0][n:]
        self._free = [rest]
        self._num_free -= n
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free.append(slots.to(torch.int64).cpu())
            self._num_free += slots.numel()


class ReqToTokenPool:
    """Rows of KV slot indices, one row per running request: ``table[row, pos] = slot``.

    ``table`` lives on the model's device (attention backends read it); ``cpu_table`` mirrors it so
    the scheduler never waits on the device to learn a request's slots.
    """

    def __init__(self, num_rows: int, max_context_len: int, device: Any) -> None:
        self.cpu_table = torch.zeros((num_rows, max_context_len), dtype=torch.int32)
        on_cpu = torch.device(device).type == "cpu"
        self.table = self.cpu_table if on_cpu else torch.zeros_like(self.cpu_table, device=device)
        self._free_rows = list(range(num_rows - 1, -1, -1))

    @property
    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """table[row, start:start+len(slots)] = slots."""
        n = slots.numel()
        if n:
            self.cpu_table[row, start:start + n] = slots
            if self.table is not self.cpu_table:
                self.table[row, start:start + n] = to_device(slots.to(torch.int32), self.table.device)

    def write_many(self, rows: list[int], positions: list[int], slots: torch.Tensor, device: bool = True) -> None:
        """table[rows[i], positions[i]] = slots[i] for every i, in one indexed write per table.

        ``device=False`` writes ``cpu_table`` only: the caller promises the same write reaches the device
        ``table`` before anything reads it (decode: ``ModelRunner.forward`` does it with the step's own
        inputs, via ``write_device`` or the fused decode-preparation kernel). On the CPU both are one
        table, so the write is always complete."""
        r = torch.tensor(rows, dtype=torch.int64)
        p = torch.tensor(positions, dtype=torch.int64)
        self.cpu_table[r, p] = slots.to(torch.int32)
        if device and self.table is not self.cpu_table:
            packed = to_device(torch.stack([r, p, slots.to(torch.int64)]), self.table.device)  # one copy, no host wait
            self.write_device(packed[0], packed[1], packed[2])

    def write_device(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Device ``table[rows[i], positions[i]] = slots[i]`` (int64 tensors on the table's device), queued
        without a host wait; nothing to do when the table is ``cpu_table`` (the host write did it)."""
        if self.table is not self.cpu_table:
            self.table[rows, positions] = slots.to(torch.int32)

    def slots(self, row: int, end: int) -> torch.Tensor:
        """The slots of positions [0, end) of ``row`` (CPU int64)."""
        return self.cpu_table[row, :end].to(torch.int64)
