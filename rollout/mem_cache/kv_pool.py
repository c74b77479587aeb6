"""Preallocated KV-cache memory: the per-layer KV buffers, the slot allocator, and the request table.

A request holds one KV slot per token, listed in its row of ``ReqToTokenPool``. Slots come in pages of
``page_size`` tokens (SGLang's ``page_size``; default 1): page p holds slots [p * page_size, (p + 1) *
page_size), and a request's token at position i sits at offset i % page_size of its (i // page_size)-th
page, so a paged kernel can read a request from its page list. Page 0 is reserved: slot 0 is the
scratch slot that padding rows write.
"""

from __future__ import annotations

from typing import Any

import torch

from rollout.device_copy import to_device
from rollout.mem_cache.routed_experts import RoutedExpertsPool


class KVPool:
    """K and V buffers for every layer: ``[num_slots + page_size, num_kv_heads, head_dim]`` each (page 0
    reserved), in ``dtype`` (the model dtype, or a float8 type: values are stored as ``x.to(float8)``, unit
    scale). ``num_slots`` is a multiple of ``page_size``; ``paged(buf)`` views a buffer as pages."""

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: Any, page_size: int = 1) -> None:
        if num_slots % page_size:
            raise ValueError(f"{num_slots} slots are not whole pages of {page_size}")
        self.num_slots = num_slots
        self.page_size = page_size
        shape = (num_slots + page_size, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.routed_experts: RoutedExpertsPool | None = None  # MoE routing per slot, when enabled

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def paged(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf`` viewed as ``[num_pages + 1, page_size, num_kv_heads, head_dim]`` (NHD pages)."""
        return buf.view(-1, self.page_size, *buf.shape[1:])

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """buffers[layer_id][loc] = k, v, cast (rounded to nearest) to the pool dtype."""
        for buf, x in ((self.k_buffers[layer_id], k), (self.v_buffers[layer_id], v)):
            x = x.to(buf.dtype)
            if buf.element_size() == 1:  # float8: index_put through a byte view (not every build has fp8's)
                buf, x = buf.view(torch.uint8), x.view(torch.uint8)
            buf[loc] = x


class SlotAllocator:
    """Hands out the KV slots of pages 1..num_slots // page_size; all bookkeeping on the CPU (int64 tensors).

    Contract: a request's slots come from ``alloc(n, kv_len, last_slot)``, which first fills the free tail
    of the page holding its position ``kv_len - 1`` and then takes whole pages, so position i of a request
    always sits at offset i % page_size of a page. ``free(slots)`` returns every page that ``slots`` touch:
    callers free a page only when none of its slots is still in use (whole pages, or a request's last,
    partly written page). Freeing a page twice raises. With page size 1 pages are slots."""

    def __init__(self, num_slots: int, page_size: int = 1) -> None:
        if num_slots % page_size:
            raise ValueError(f"{num_slots} slots are not whole pages of {page_size}")
        self.num_slots = num_slots
        self.page_size = page_size
        num_pages = num_slots // page_size
        self._free = [torch.arange(1, num_pages + 1, dtype=torch.int64)]
        self._num_free = num_pages
        self._is_free = torch.ones(num_pages + 1, dtype=torch.bool)
        self._is_free[0] = False

    @property
    def available(self) -> int:
        """Slots in free pages."""
        return self._num_free * self.page_size

    def slots_needed(self, n: int, kv_len: int = 0) -> int:
        """Slots of the free pages that ``alloc(n, kv_len, ...)`` takes (whole pages)."""
        in_page = -kv_len % self.page_size
        return -(-max(n - in_page, 0) // self.page_size) * self.page_size

    def alloc(self, n: int, kv_len: int = 0, last_slot: int = 0) -> torch.Tensor | None:
        """Slots for a request's next ``n`` tokens (positions kv_len..kv_len+n-1; ``last_slot``: the slot of
        position kv_len - 1), or None (nothing taken) when too few pages are free. With page size 1 any
        ``n`` free slots (the request arguments do not matter)."""
        p = self.page_size
        in_page = min(-kv_len % p, n)
        pages = self._take(-(-(n - in_page) // p))
        if pages is None:
            return None
        if p == 1:
            return pages
        head = torch.arange(last_slot + 1, last_slot + 1 + in_page, dtype=torch.int64)
        body = (pages[:, None] * p + torch.arange(p)).reshape(-1)[:n - in_page]
        return torch.cat([head, body])

    def alloc_decode(self, kv_lens: list[int], last_slots: torch.Tensor) -> torch.Tensor | None:
        """One slot for each request's next token (``alloc(1, kv_lens[i], last_slots[i])`` for every i, all
        or nothing; ``last_slots`` int64, ``ReqToTokenPool.last_slots``)."""
        p = self.page_size
        if p == 1:
            return self._take(len(kv_lens))
        new = [i for i, k in enumerate(kv_lens) if k % p == 0]
        pages = self._take(len(new))
        if pages is None:
            return None
        out = last_slots + 1
        if new:
            out[torch.tensor(new)] = pages * p
        return out

    def _take(self, num_pages: int) -> torch.Tensor | None:
        if num_pages > self._num_free:
            return None
        if len(self._free) > 1:
            self._free = [torch.cat(self._free)]
        out, rest = self._free[0][:num_pages], self._free[0][num_pages:]
        self._free = [rest]
        self._num_free -= num_pages
        self._is_free[out] = False
        return out

    def free(self, slots: torch.Tensor) -> None:
        if not slots.numel():
            return
        pages = torch.unique(slots.to(torch.int64).cpu() // self.page_size)  # the pages the slots touch
        if (self.page_size == 1 and pages.numel() != slots.numel()) or bool(self._is_free[pages].any()):
            raise RuntimeError("a KV page was freed twice")
        self._is_free[pages] = True
        self._free.append(pages)
        self._num_free += pages.numel()


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

    def write(self, row: int, start: int, slots: torch.Tensor, device: bool = True) -> None:
        """table[row, start:start+len(slots)] = slots; ``device=False``: ``cpu_table`` only (as ``write_many``)."""
        n = slots.numel()
        if n:
            self.cpu_table[row, start:start + n] = slots
            if device and self.table is not self.cpu_table:
                self.table[row, start:start + n] = to_device(slots.to(torch.int32), self.table.device)

    def write_many(self, rows: list[int], positions: list[int], slots: torch.Tensor, device: bool = True) -> None:
        """table[rows[i], positions[i]] = slots[i] for every i, in one indexed write per table.

        ``device=False`` writes ``cpu_table`` only: the caller promises the same write reaches the device
        ``table`` before anything reads it (``ModelRunner.forward`` does it with the step's own inputs, via
        ``write_device`` or the fused decode-preparation kernel). On the CPU both are one
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

    def last_slots(self, rows: list[int], lens: list[int]) -> torch.Tensor:
        """The slots of positions ``lens[i] - 1`` of ``rows[i]`` (0 where ``lens[i]`` is 0), int64, from the
        host table in one gather."""
        lens_t = torch.tensor(lens, dtype=torch.int64)
        out = self.cpu_table[torch.tensor(rows, dtype=torch.int64), (lens_t - 1).clamp(min=0)].to(torch.int64)
        return out.masked_fill(lens_t == 0, 0)

    def last_slot(self, row: int, length: int) -> int:
        """``last_slots([row], [length])`` for one row, as an int (no tensors built)."""
        return int(self.cpu_table[row, length - 1]) if length > 0 else 0

    def slots(self, row: int, end: int) -> torch.Tensor:
        """The slots of positions [0, end) of ``row`` (CPU int64)."""
        return self.cpu_table[row, :end].to(torch.int64)
