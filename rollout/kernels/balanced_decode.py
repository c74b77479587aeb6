"""Load-balanced decode attention over a page-size-1 KV pool, in Triton: each request is cut into as many pieces
as its length needs, so one long request (a GRPO straggler) no longer holds the launch up.

``decode_attention`` gives every request the same number of splits. Its programs are as long as the requests,
and the launch lasts as long as the longest: with one request of 16k tokens among 255 of ~900, attention at
256 requests takes twice as long (H200, ``tools/exp_decode_order.py --cases straggler``). Here a plan, once per
decode step, cuts the batch's requests into pieces of at most

    chunk = max(cdiv(total tokens, programs), min_chunk)

tokens (request b: ``n_b = cdiv(len_b, chunk)`` equal pieces), numbered in request order. Requests of equal
length below ``chunk`` get one piece each, which is ``decode_attention`` with one split; a straggler gets
pieces no longer than the average program's share.

    plan (``plan_pieces``, one program): ``first[b]`` = the first piece of request b (``first[B]`` = the count),
        ``owner[i]`` = the request of piece i, -1 past the count (``owner`` has B + programs entries, the most
        pieces there can be).
    attention (``balanced_decode_attention``), grid (KV heads, B + programs): program (h, i) attends piece i of
        its request for KV head h; a request of one piece is written directly, else the piece's partial goes
        to slot i and the last piece to finish (an atomic count per (request, KV head), reset after) merges
        the request's slots by their log-sum-exp.

Both grids are fixed for a batch size, so a CUDA graph captures them; no host work depends on the lengths. The
attention inside a piece is ``decode_attention``'s (same tile loop, arithmetic and roundings).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rollout.kernels.decode_attention import (_LOG2E, DecodeLaunch, _attend, _merge_slots, _query_tile,
                                              _store_partial, check_counters, check_decode_inputs, default_launch)
from rollout.kernels.pdl import pdl_launch, pdl_prologue

_PLAN_BLOCK = 1024


@dataclass(frozen=True)
class DecodePieces:
    """A decode batch's pieces on the device (written by ``plan_pieces``): ``first`` int32 [>= B + 1], ``owner``
    int32 [>= B + programs]; ``programs``: the pieces per KV head beyond one per request
    (``balanced_programs``)."""

    first: torch.Tensor
    owner: torch.Tensor
    programs: int

    @staticmethod
    def new(batch_size: int, programs: int, device: torch.device) -> "DecodePieces":
        return DecodePieces(torch.zeros(batch_size + 1, dtype=torch.int32, device=device),
                            torch.full((batch_size + programs,), -1, dtype=torch.int32, device=device), programs)


def wants_pieces(seq_lens: list[int], ratio: float) -> bool:
    """The rule for cutting a decode step into pieces: its longest request holds at least ``ratio`` times the
    mean length (0: always; ``inf``: never)."""
    return bool(seq_lens) and max(seq_lens) * len(seq_lens) >= ratio * sum(seq_lens)


def balanced_programs(num_kv_heads: int, num_sms: int, kv_itemsize: int = 2) -> int:
    """Pieces per KV head: the batch's tokens over ``8`` programs per SM (16 for float8 pools, whose one-warp
    programs are short), as ``num_kv_splits`` counts them."""
    per_sm = 16 if kv_itemsize == 1 else 8
    return max(1, per_sm * num_sms // num_kv_heads)


@triton.jit(do_not_specialize=["batch", "programs", "min_chunk", "owners"])
def _plan_kernel(kv_indptr, batch, programs, min_chunk, first, owner, owners, BLOCK: tl.constexpr):
    """One program: ``first`` and ``owner`` of the module docstring, BLOCK requests per loop step."""
    total = tl.load(kv_indptr + batch) - tl.load(kv_indptr)
    chunk = tl.maximum(tl.cdiv(total, programs), min_chunk)
    offs = tl.arange(0, BLOCK)
    count = tl.full([], 0, tl.int32)
    for b0 in tl.range(0, batch, BLOCK):
        b = b0 + offs
        ok = b < batch
        lens = tl.load(kv_indptr + b + 1, mask=ok, other=0) - tl.load(kv_indptr + b, mask=ok, other=0)
        n = tl.where(ok, tl.cdiv(lens, chunk), 0)
        start = count + tl.cumsum(n, 0) - n
        tl.store(first + b, start, mask=ok)
        for k in tl.range(0, tl.max(n, 0)):
            tl.store(owner + start + k, b, mask=k < n)
        count += tl.sum(n, 0)
    tl.store(first + batch, count)
    for r0 in tl.range(count, owners, BLOCK):
        r = r0 + offs
        tl.store(owner + r, -1, mask=r < owners)


def plan_pieces(kv_indptr: torch.Tensor, batch_size: int, pieces: DecodePieces, min_chunk: int = 256
                ) -> DecodePieces:
    """Writes ``pieces`` for the ``batch_size`` requests of ``kv_indptr`` (one launch, no host sync) and returns
    them."""
    if pieces.first.numel() < batch_size + 1 or pieces.owner.numel() < batch_size + pieces.programs:
        raise ValueError(f"pieces tables too small for {batch_size} requests")
    _plan_kernel[(1,)](kv_indptr, batch_size, pieces.programs, min_chunk, pieces.first, pieces.owner,
                       batch_size + pieces.programs, BLOCK=_PLAN_BLOCK, num_warps=4)
    return pieces


@triton.jit
def _pieces_kernel(q, k_buf, v_buf, kv_indptr, kv_indices, first, owner, out, mid_o, mid_lse, counters, qk_scale,
                   v_scale, q_sb, q_sh, k_ss, k_sh, v_ss, v_sh, o_sb, o_sh, slots,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    kv_head = tl.program_id(0)
    i = tl.program_id(1)
    # no branch around the tile loop (a program past the last piece runs it over no tokens and stores nothing)
    owned = tl.load(owner + i)
    valid = owned >= 0
    b = tl.maximum(owned, 0)
    p0 = tl.load(first + b)
    n = tl.load(first + b + 1) - p0
    start = tl.load(kv_indptr + b)
    length = tl.where(valid, tl.load(kv_indptr + b + 1) - start, 0)
    j = i - p0
    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    row_ok = (rows < GROUP) & (rows * 0 + owned >= 0)  # a program past the last piece: no row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    mask = row_ok[:, None] & d_ok[None, :]
    qv = _query_tile(q, b * q_sb + heads[:, None] * q_sh + d[None, :], mask, k_buf)
    lo = (j * length) // tl.maximum(n, 1)
    hi = ((j + 1) * length) // tl.maximum(n, 1)
    acc, l_i, m_i = _attend(qv, k_buf + kv_head * k_sh + d[None, :], v_buf + kv_head * v_sh + d[None, :],
                            kv_indices, start, lo, hi, k_ss, v_ss, d_ok, qk_scale, v_scale, BLOCK_H, BLOCK_D,
                            BLOCK_N, NUM_STAGES)
    out_ptrs = out + b * o_sb + heads[:, None] * o_sh + d[None, :]
    if n == 1:
        tl.store(out_ptrs, (acc / tl.maximum(l_i, 1e-30)[:, None]).to(out.dtype.element_ty), mask=mask)
    elif valid:
        o_row = heads * (slots * BLOCK_D)  # mid_o [Hq, slots, BLOCK_D], mid_lse [Hq, slots]
        _store_partial(mid_o, mid_lse, o_row, heads * slots, row_ok, d, d_ok, i, acc, l_i, m_i, BLOCK_D)
        tl.debug_barrier()
        counter = counters + b * tl.num_programs(0) + kv_head
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == n - 1:
            _merge_slots(out_ptrs, mid_o + o_row[:, None] + d[None, :], mid_lse + heads * slots, p0, n, BLOCK_D,
                         row_ok, d_ok, BLOCK_H, BLOCK_D)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def balanced_decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                              kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float,
                              pieces: DecodePieces, counters: torch.Tensor, out: torch.Tensor | None = None,
                              launch: DecodeLaunch | None = None) -> torch.Tensor:
    """``decode_attention``'s result (same arguments and contracts) over the pieces ``plan_pieces`` wrote for
    this batch (see the module docstring). ``counters``: int32, contiguous, at least B * Hk zeros (0 again
    when the kernel ends). No host sync; CUDA-graph safe."""
    b, hq, d = q.shape
    hk = k_buffer.shape[1]
    check_decode_inputs(q, k_buffer, v_buffer)
    check_counters(counters, b * hk)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if b == 0:
        return out
    block_d = triton.next_power_of_2(d)
    slots = b + pieces.programs
    mid_o = torch.empty((hq, slots, block_d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((hq, slots), dtype=torch.float32, device=q.device)
    launch = launch or default_launch(k_buffer.dtype)
    _pieces_kernel[(hk, slots)](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, pieces.first, pieces.owner, out, mid_o, mid_lse, counters,
        sm_scale * _LOG2E, 1.0, q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1), slots,
        GROUP=hq // hk, HEAD_DIM=d, BLOCK_H=max(16, triton.next_power_of_2(hq // hk)), BLOCK_D=block_d,
        BLOCK_N=launch.block_n, NUM_STAGES=launch.num_stages, num_warps=launch.num_warps, **pdl_launch(q.device))
    return out
