"""Token-balanced decode attention over a page-size-1 KV pool, in Triton: every program reads the same number
of KV tokens, whatever the requests' lengths.

``decode_attention`` gives each request the same number of splits, so at a running batch of mixed lengths
its programs differ in length as the requests do and the last wave waits on the longest requests. Here the
batch's tokens (``kv_indptr[B]`` of them, requests one after the other) are cut into ``programs`` equal
ranges of ``chunk = max(cdiv(total, programs), min_chunk)`` tokens. The program for range p and one KV head
walks the requests its range covers (found by binary search in ``kv_indptr``):

    a request wholly inside the range: its output is written directly;
    a request cut by range ends: the program's part goes to partial slot ``p + b`` (unique: the ranges over
    request b are ``kv_indptr[b] // chunk`` .. ``(kv_indptr[b+1] - 1) // chunk``), and the last of those
    programs to finish (an atomic count per (request, KV head), reset to 0 after) merges the slots by their
    log-sum-exp.

The grid, (kv_heads, programs), does not depend on the batch: one CUDA graph per batch size as before, no host
work. The attention inside a range is ``decode_attention``'s (same tile loop, same arithmetic and roundings).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.kernels.decode_attention import DecodeLaunch, _attend, _query_tile, _store_partial, default_launch
from rollout.kernels.pdl import pdl_launch, pdl_prologue

_LOG2E = 1.4426950408889634


@triton.jit
def _find_request(kv_indptr, batch, token):
    """The request b with ``kv_indptr[b] <= token < kv_indptr[b + 1]`` (binary search; empty requests skipped)."""
    lo = 0
    hi = batch
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(kv_indptr + mid) <= token:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _merge_slots(mid_o, mid_lse, out_ptrs, o_row, lse_row, first, last, row_ok, d_ok, BLOCK_H: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """Online merge of partial slots [first, last] by their log-sum-exp (base 2) into ``out_ptrs``; partials
    are read past L1 (``.cg``): other programs wrote them."""
    mask = row_ok[:, None] & d_ok[None, :]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    w_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in tl.range(first, last + 1):
        lse = tl.load(lse_row + s, mask=row_ok, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        old = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * old[:, None] + tl.load(o_row + s * BLOCK_D, mask=mask, other=0.0, cache_modifier=".cg") * w[:, None]
        w_sum = w_sum * old + w
        m = m_new
    merged = acc / tl.where(row_ok, w_sum, 1.0)[:, None]
    tl.store(out_ptrs, merged.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _balanced_kernel(q, k_buf, v_buf, kv_indptr, kv_indices, out, mid_o, mid_lse, counters, batch, min_chunk,
                     qk_scale, v_scale, q_sb, q_sh, k_ss, k_sh, v_ss, v_sh, o_sb, o_sh, slots,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    kv_head = tl.program_id(0)
    p = tl.program_id(1)
    num_kv_heads = tl.num_programs(0)
    total = tl.load(kv_indptr + batch)
    chunk = tl.maximum(tl.cdiv(total, tl.num_programs(1)), min_chunk)
    lo = p * chunk
    hi = tl.minimum(lo + chunk, total)
    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    mask = row_ok[:, None] & d_ok[None, :]
    k_base = k_buf + kv_head * k_sh + d[None, :]
    v_base = v_buf + kv_head * v_sh + d[None, :]
    o_row = mid_o + heads[:, None] * (slots * BLOCK_D) + d[None, :]  # mid_o [Hq, slots, BLOCK_D]
    lse_row = mid_lse + heads * slots  # mid_lse [Hq, slots]
    b = _find_request(kv_indptr, batch, lo)
    while lo < hi:
        start = tl.load(kv_indptr + b)
        end = tl.load(kv_indptr + b + 1)
        seg_hi = tl.minimum(hi, end)
        if seg_hi > lo:
            qv = _query_tile(q, b * q_sb + heads[:, None] * q_sh + d[None, :], mask, k_buf)
            acc, l_i, m_i = _attend(qv, k_base, v_base, kv_indices, start, lo - start, seg_hi - start, k_ss, v_ss,
                                    d_ok, qk_scale, v_scale, BLOCK_H, BLOCK_D, BLOCK_N, NUM_STAGES)
            first = start // chunk
            last = (end - 1) // chunk
            out_ptrs = out + b * o_sb + heads[:, None] * o_sh + d[None, :]
            if first == last:
                tl.store(out_ptrs, (acc / l_i[:, None]).to(out.dtype.element_ty), mask=mask)
            else:
                _store_partial(mid_o, mid_lse, heads * (slots * BLOCK_D), heads * slots, row_ok, d, d_ok, p + b,
                               acc, l_i, m_i, BLOCK_D)
                tl.debug_barrier()
                counter = counters + b * num_kv_heads + kv_head
                done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if done == last - first:
                    _merge_slots(mid_o, mid_lse, out_ptrs, o_row, lse_row, first + b, last + b, row_ok, d_ok,
                                 BLOCK_H, BLOCK_D)
                    tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        lo = seg_hi
        b += 1


def balanced_programs(num_kv_heads: int, num_sms: int, programs_per_sm: int = 4) -> int:
    """Token ranges per KV head: ``programs_per_sm`` programs per SM over all KV heads (at least 1)."""
    return max(1, programs_per_sm * num_sms // num_kv_heads)


def resident_per_sm(num_regs: int, shared_bytes: int, num_warps: int, device: torch.device) -> int:
    """Programs of one compiled kernel that fit on one SM at once (threads, registers, shared memory)."""
    props = torch.cuda.get_device_properties(device)
    threads = 32 * num_warps
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // threads
    regs_per_warp = -(-max(1, num_regs) * 32 // 256) * 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * num_warps)
    by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // (shared_bytes + 1024)
    return max(1, min(32, by_threads, by_regs, by_smem))


def _check(q, k_buffer, v_buffer, counters, programs: int, min_chunk: int) -> None:
    b, hq, d = q.shape
    hk = k_buffer.shape[1]
    if hq % hk or k_buffer.shape[2] != d or v_buffer.shape[1:] != k_buffer.shape[1:]:
        raise ValueError(f"bad shapes q {tuple(q.shape)}, k {tuple(k_buffer.shape)}, v {tuple(v_buffer.shape)}")
    if q.stride(-1) != 1 or k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1:
        raise ValueError("q and the KV buffers need a contiguous last dim")
    if counters.dtype != torch.int32 or counters.numel() < b * hk or not counters.is_contiguous():
        raise ValueError(f"counters must be a contiguous int32 tensor of >= {b * hk} zeros")
    if programs < 1 or min_chunk < 1:
        raise ValueError(f"programs and min_chunk must be positive, got {programs}, {min_chunk}")


def _kernel_args(q, k_buffer, v_buffer, kv_indptr, kv_indices, out, counters, sm_scale: float, programs: int,
                 min_chunk: int, launch: DecodeLaunch) -> tuple[tuple, dict]:
    """The partial buffers and ``_balanced_kernel``'s arguments for a grid of (KV heads, ``programs``)."""
    b, hq, d = q.shape
    hk = k_buffer.shape[1]
    block_d = triton.next_power_of_2(d)
    slots = programs + b
    mid_o = torch.empty((hq, slots, block_d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((hq, slots), dtype=torch.float32, device=q.device)
    args = (q, k_buffer, v_buffer, kv_indptr, kv_indices, out, mid_o, mid_lse, counters, b, min_chunk,
            sm_scale * _LOG2E, 1.0, q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
            v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1), slots)
    kwargs = dict(GROUP=hq // hk, HEAD_DIM=d, BLOCK_H=max(16, triton.next_power_of_2(hq // hk)), BLOCK_D=block_d,
                  BLOCK_N=launch.block_n, NUM_STAGES=launch.num_stages, num_warps=launch.num_warps,
                  **pdl_launch(q.device))
    return args, kwargs


def one_wave_programs(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, kv_indptr: torch.Tensor,
                      kv_indices: torch.Tensor, counters: torch.Tensor, launch: DecodeLaunch | None = None) -> int:
    """Token ranges per KV head that fill every SM with resident programs exactly once (all ranges run at
    once, none waits for a second wave). Compiles the kernel for these arguments' types (no launch)."""
    launch = launch or default_launch(k_buffer.dtype)
    hk = k_buffer.shape[1]
    args, kwargs = _kernel_args(q, k_buffer, v_buffer, kv_indptr, kv_indices, q, counters, 1.0, 1, 1, launch)
    compiled = _balanced_kernel.warmup(*args, grid=(hk, 1), **kwargs)
    compiled._init_handles()
    per_sm = resident_per_sm(compiled.n_regs, compiled.metadata.shared, launch.num_warps, q.device)
    return balanced_programs(hk, torch.cuda.get_device_properties(q.device).multi_processor_count, per_sm)


def balanced_decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                              kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float, programs: int,
                              counters: torch.Tensor, out: torch.Tensor | None = None,
                              launch: DecodeLaunch | None = None, min_chunk: int = 256) -> torch.Tensor:
    """``decode_attention``'s result (same arguments and contracts) with the batch's tokens cut into
    ``programs`` equal ranges per KV head (``one_wave_programs`` on a GPU), each at least ``min_chunk`` tokens
    (see the module docstring). ``counters``: int32, contiguous, at least B * Hk zeros (0 again when the
    kernel ends). No host sync; CUDA-graph safe: the grid depends on ``programs`` and the KV heads only."""
    _check(q, k_buffer, v_buffer, counters, programs, min_chunk)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if q.shape[0] == 0:
        return out
    launch = launch or default_launch(k_buffer.dtype)
    args, kwargs = _kernel_args(q, k_buffer, v_buffer, kv_indptr, kv_indices, out, counters, sm_scale, programs,
                                min_chunk, launch)
    _balanced_kernel[(k_buffer.shape[1], programs)](*args, **kwargs)
    return out
