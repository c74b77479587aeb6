"""Decode index lists in one Triton launch: ``kv_indptr`` and ``kv_indices`` from the request table.

Semantics (``rollout.attention.common.kv_indices_for`` is the torch reference):

    indptr[0] = 0, indptr[i + 1] = seq_lens[0] + ... + seq_lens[i]
    indices[indptr[i]:indptr[i + 1]] = req_to_token[rows[i], :seq_lens[i]]

    with ``order``: order[k] = the row with the k-th longest seq len (ties: the lower row first)

Grid (B, C): program (i, c) finds its request's start by summing the seq lens before it (SCAN of them per
loop step), then copies chunks c,
c + C, c + 2C, ... of CHUNK tokens of row ``rows[i]``; its loop bound is the loaded seq len, so any
length is covered whatever C is. Program (i, 0) writes ``indptr[i + 1]`` (and (0, 0) ``indptr[0]``), and
with ``order`` counts the rows that go before its own (all B seq lens, SCAN per loop step) and writes its
row at that place. The decode kernel launches its programs in that order (longest first), so that a long
request's programs start in the first wave instead of outlasting the others in the last.
Nothing is read back to the host; the outputs are written in place (CUDA-graph buffers keep their
addresses).

``prepare_decode`` does all of a CUDA-graph decode step's device-side preparation in one launch (same grid
scheme): from one packed [4, B] copy of the step's rows, positions, out slots and seq lens it writes the
new slots into the request table, the graph's static inputs (padded to the graph's batch size) and the
index lists above.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch
import triton
import triton.language as tl

CHUNK = 1024  # tokens one program copies per loop step
MAX_CHUNK_PROGRAMS = 4096  # cap on C (programs per request); longer requests loop
SCAN = 256  # seq lens one program sums per loop step
# The kernels run outside CUDA graphs, before every decode step: nothing in their compiled form depends on
# the batch size (no batch-sized tile, ``batch`` not specialized), so the first step at a new batch size
# compiles nothing (a compile there stalled the first timed decode on a fresh machine).


@triton.jit
def _start_of(lens, i, batch, PAD: tl.constexpr, SCAN: tl.constexpr):
    """sum over j < i of (lens[j] if j < batch else PAD), SCAN entries per loop step."""
    offs = tl.arange(0, SCAN)
    acc = tl.zeros([SCAN], tl.int32)
    for j0 in tl.range(0, i, SCAN):
        j = j0 + offs
        v = tl.load(lens + j, mask=j < batch, other=PAD).to(tl.int32)
        acc += tl.where(j < i, v, 0)
    return tl.sum(acc, axis=0)


@triton.jit
def _write_launch_order(order, lens, i, n, batch, padded, PAD: tl.constexpr, SCAN: tl.constexpr):
    """``order[k] = i`` where k counts the rows j < ``padded`` that go before row i (seq len ``n``): a longer
    seq len, or the same one at a lower row (lens[j] for j < batch, else PAD)."""
    offs = tl.arange(0, SCAN)
    acc = tl.zeros([SCAN], tl.int32)
    for j0 in tl.range(0, padded, SCAN):
        j = j0 + offs
        v = tl.load(lens + j, mask=j < batch, other=PAD).to(tl.int32)
        acc += ((j < padded) & ((v > n) | ((v == n) & (j < i)))).to(tl.int32)
    tl.store(order + tl.sum(acc, axis=0), i)


@triton.jit(do_not_specialize=["batch"])
def _kv_indices_kernel(req_to_token, rows, seq_lens, indptr, indices, batch, capacity, t_sr, t_sc, order,
                       SCAN: tl.constexpr, CHUNK: tl.constexpr, ORDER: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    start = _start_of(seq_lens, i, batch, 0, SCAN)
    n = tl.load(seq_lens + i).to(tl.int32)
    if c == 0:
        tl.store(indptr + i + 1, start + n)
        if i == 0:
            tl.store(indptr, start)  # start of request 0: zero, in indptr's own type
        if ORDER:
            _write_launch_order(order, seq_lens, i, n, batch, batch, 0, SCAN)
    src = req_to_token + tl.load(rows + i).to(tl.int64) * t_sr
    dst = indices + start
    t = tl.arange(0, CHUNK)
    for t0 in tl.range(c * CHUNK, n, tl.num_programs(1) * CHUNK):
        pos = t0 + t
        ok = (pos < n) & (start + pos < capacity)
        slots = tl.load(src + pos.to(tl.int64) * t_sc, mask=ok)
        tl.store(dst + pos, slots.to(tl.int32), mask=ok)


def _check_index_outputs(req_to_token: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
                         total: int) -> None:
    """What both launchers need of the table and the index buffers: int32, and room for ``total`` indices."""
    if indptr.dtype != torch.int32 or indices.dtype != torch.int32 or req_to_token.dtype != torch.int32:
        raise TypeError("req_to_token, indptr and indices must be int32")
    if total > indices.numel():
        raise ValueError(f"{total} indices do not fit a buffer of {indices.numel()}")


def chunk_programs(batch_size: int, total: int) -> int:
    """Programs per request (C): enough CHUNK-token chunks to cover the average request of a batch of
    ``batch_size`` holding ``total`` tokens, at least 1 and at most ``MAX_CHUNK_PROGRAMS``."""
    return max(1, min(triton.cdiv(total, max(batch_size, 1) * CHUNK), MAX_CHUNK_PROGRAMS))


def check_launch_order(order: torch.Tensor | None, need: int) -> None:
    """A launch order buffer (or None): contiguous int32 of at least ``need`` entries."""
    if order is not None and (order.dtype != torch.int32 or order.numel() < need or not order.is_contiguous()):
        raise ValueError(f"order must be a contiguous int32 tensor of >= {need} entries")


def write_kv_indices(req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                     indptr: torch.Tensor, indices: torch.Tensor, total: int,
                     order: torch.Tensor | None = None) -> torch.Tensor:
    """Writes ``indptr[:B + 1]`` (cumulative seq lens from 0) and ``indices[:total]`` (the concatenation
    of ``req_to_token[rows[i], :seq_lens[i]]``) in one launch, without a host sync; returns
    ``indices[:total]``.

    ``req_to_token``: int32 [num_rows, max_ctx], any strides; ``rows``: int64 or int32 [B];
    ``seq_lens``: integer [B] on the device; ``indptr``: int32, at least B + 1 elements (later ones
    untouched); ``indices``: int32, at least ``total`` elements (later ones untouched). ``total`` is the
    host's sum of the seq lens: it sizes the grid and the returned view only; the device seq lens decide
    what is written, and writes past ``indices``'s end are dropped rather than made. ``order``: int32, at least
    B elements: ``order[:B]`` gets the rows longest first (the module docstring; later entries untouched)."""
    b = rows.shape[0]
    if seq_lens.shape[0] != b or indptr.numel() < b + 1:
        raise ValueError(f"{b} rows, {seq_lens.shape[0]} seq lens, indptr of {indptr.numel()} (need B + 1)")
    if not (indptr.is_contiguous() and indices.is_contiguous()):
        raise ValueError("indptr and indices must be contiguous")
    _check_index_outputs(req_to_token, indptr, indices, total)
    check_launch_order(order, b)
    if b == 0:
        indptr[:1].zero_()
        return indices[:0]
    grid = (b, chunk_programs(b, total))
    _kv_indices_kernel[grid](req_to_token, rows, seq_lens, indptr, indices, b, indices.numel(),
                             req_to_token.stride(0), req_to_token.stride(1), indptr if order is None else order,
                             SCAN=SCAN, CHUNK=CHUNK, ORDER=order is not None, num_warps=4)
    return indices[:total]


@dataclass(frozen=True)
class DecodeBuffers:
    """A decode forward's per-request device inputs, written in place by ``prepare_decode``: 1-D, stride 1,
    at least the padded batch size long. ``seq_lens`` int32, the others int64."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    rows: torch.Tensor
    seq_lens: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The five buffers in the kernel's argument order."""
        return self.input_ids, self.positions, self.out_cache_loc, self.rows, self.seq_lens


@triton.jit(do_not_specialize=["batch"])
def _prepare_decode_kernel(packed, batch, last_token_ids, req_to_token, t_sr, t_sc, input_ids, positions,
                           out_cache_loc, rows_out, seq_lens_out, indptr, indices, capacity, pages, p_sr, order,
                           SCAN: tl.constexpr, CHUNK: tl.constexpr, PAGE: tl.constexpr, ORDER: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    start = _start_of(packed + 3 * batch, i, batch, 1, SCAN)  # padding rows: 1 token
    real = i < batch
    row = tl.load(packed + i, mask=real, other=0)
    pos = tl.load(packed + batch + i, mask=real, other=0)
    slot = tl.load(packed + 2 * batch + i, mask=real, other=0)
    n = tl.load(packed + 3 * batch + i, mask=real, other=1).to(tl.int32)
    src = req_to_token + row * t_sr
    if c == 0:
        tl.store(req_to_token + row * t_sr + pos * t_sc, slot.to(tl.int32), mask=real)
        tl.store(input_ids + i, tl.load(last_token_ids + row, mask=real, other=0))
        tl.store(positions + i, pos)
        tl.store(out_cache_loc + i, slot)
        tl.store(rows_out + i, row)
        tl.store(seq_lens_out + i, n)
        tl.store(indptr + i + 1, start + n)
        if i == 0:
            tl.store(indptr, start)  # zero, in indptr's own type
        if ORDER:
            _write_launch_order(order, packed + 3 * batch, i, n, batch, tl.num_programs(0), 1, SCAN)
    t = tl.arange(0, CHUNK)
    hole = tl.where(real, pos, -1)  # the position whose slot this launch writes (none for padding rows)
    count = tl.cdiv(n, PAGE)  # entries: the slot of every position (PAGE 1), else the page of every PAGE-th
    if PAGE == 1:
        dst = indices + start
        room = capacity - start  # writes past the index buffer's end are dropped
    else:
        dst = pages + i * p_sr
        room = count
    for j0 in tl.range(c * CHUNK, count, tl.num_programs(1) * CHUNK):
        j = j0 + t
        ok = (j < count) & (j < room)
        p = j * PAGE
        from_table = ok & (p != hole)  # not the slot this launch writes: the input has it
        slots = tl.load(src + p.to(tl.int64) * t_sc, mask=from_table)
        entry = tl.where(from_table, slots.to(tl.int32), slot.to(tl.int32))
        if PAGE > 1:
            entry = entry // PAGE
        tl.store(dst + j, entry, mask=ok)


def prepare_decode(packed: torch.Tensor, last_token_ids: torch.Tensor, req_to_token: torch.Tensor,
                   out: DecodeBuffers, indptr: torch.Tensor, indices: torch.Tensor, padded: int,
                   total: int, page_table: torch.Tensor | None = None, page_size: int = 1,
                   order: torch.Tensor | None = None) -> torch.Tensor:
    """One launch, no host sync, every output written in place; returns ``indices[:total]`` (with
    ``page_table``: ``page_table[:padded]``).

    ``packed``: contiguous int64 [4, B] on the device, its rows the B requests' ``rows`` (distinct),
    ``positions``, ``out_slots`` and ``seq_lens`` (``StepInput.decode_pack`` builds it on the host);
    ``padded`` >= B the batch size the step runs at (rows B..padded-1 are padding). Writes:

    - ``req_to_token[rows[i], positions[i]] = out_slots[i]`` for i < B;
    - ``out`` for i < B: ``input_ids[i] = last_token_ids[rows[i]]``, ``positions[i]``, ``out_cache_loc[i]
      = out_slots[i]``, ``rows[i]``, ``seq_lens[i]``; for B <= i < padded: 0, 0, 0, 0 and seq len 1
      (padding writes its KV to the scratch slot 0 and reads one token); entries from ``padded`` on
      untouched;
    - ``indptr[:padded + 1]``: cumulative padded seq lens from 0 (later entries untouched);
    - ``indices[:total]``: the concatenation over i < padded of ``req_to_token[rows[i], :seq_lens[i]]``,
      where for i < B the entry at ``positions[i]`` is ``out_slots[i]`` (from ``packed``) and the rest
      is the table as it was before this launch; a padding row's one entry is ``req_to_token[0, 0]``
      (which a decode step never writes: position 0 is a prompt token). Later entries untouched; writes
      past ``indices``'s end are dropped.
    - with ``page_table`` (int32 [>= padded, W], stride 1 along W; ``page_size`` > 1) instead of ``indices``:
      ``page_table[i, j] = slot(i, j * page_size) // page_size`` for j < cdiv(seq_lens[i], page_size), the
      slot read as for ``indices`` (XQA's page list over the KV pages of ``SlotAllocator``); its other
      entries and ``indices`` untouched.
    - with ``order`` (int32, at least ``padded`` elements): ``order[:padded]`` the rows [0, padded) by their
      padded seq lens, longest first, ties by row (the module docstring); later entries untouched.

    ``req_to_token``: int32 [num_rows, max_ctx], any strides; ``last_token_ids``: [num_rows] integer;
    ``indptr`` and ``indices``: int32, stride 1. ``total`` = the host's sum of the padded seq lens
    (sum of the real ones + padded - B): it sizes the grid and the returned view only."""
    b = packed.shape[1] if packed.dim() == 2 else -1
    if packed.shape != (4, b) or packed.dtype != torch.int64 or not packed.is_contiguous():
        raise ValueError(f"packed must be contiguous int64 [4, B], got {packed.dtype} {tuple(packed.shape)}")
    if padded < b or indptr.numel() < padded + 1 or any(t.numel() < padded for t in out.tensors()):
        raise ValueError(f"{b} rows padded to {padded}: buffers too short")
    if any(t.stride(0) != 1 for t in (indptr, indices, last_token_ids, *out.tensors())):
        raise ValueError("indptr, indices, last_token_ids and the decode buffers need stride 1")
    paged = page_table is not None
    _check_index_outputs(req_to_token, indptr, indices, 0 if paged else total)  # paged: indices unused
    check_launch_order(order, padded)
    if paged and (page_table.dtype != torch.int32 or page_table.stride(1) != 1 or page_table.shape[0] < padded
                  or page_size < 2):
        raise ValueError("page_table must be int32 [>= padded, W] with stride 1 along W, and page_size > 1")
    if padded == 0:
        indptr[:1].zero_()
        return page_table[:0] if paged else indices[:0]
    grid = (padded, chunk_programs(padded, triton.cdiv(total, page_size) if paged else total))
    _prepare_decode_kernel[grid](packed, b, last_token_ids, req_to_token, req_to_token.stride(0),
                                 req_to_token.stride(1), *out.tensors(), indptr, indices, indices.numel(),
                                 page_table if paged else indices, page_table.stride(0) if paged else 0,
                                 indptr if order is None else order, SCAN=SCAN, CHUNK=CHUNK,
                                 PAGE=page_size if paged else 1, ORDER=order is not None, num_warps=4)
    return page_table[:padded] if paged else indices[:total]
