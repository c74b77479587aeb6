"""Split-KV decode attention over a page-size-1 KV pool, in Triton.

One program owns one KV head of one request (its GROUP q heads, padded to 16 rows) and one slice of
the request's tokens. K/V tiles of BLOCK_N tokens stream through a software-pipelined loop
(``num_stages`` tiles in flight), are widened to the compute type in registers (float8 pools: unit
scale) and meet the queries on tensor cores with float32 accumulation and an online softmax (base 2).

    stage 1, grid (batch, kv_heads, splits): partial output and log-sum-exp (base 2) per split.
    stage 2, grid (batch, q_heads): merges the splits by their log-sum-exp (skipped when splits == 1).

With a ``counters`` buffer there is no stage 2 launch: the last program of each (request, KV head) to finish
its split (an atomic count per pair) merges the pair's splits and sets the count back to 0.

Semantics: ``out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b`` where K_b, V_b are the rows
``k_buffer[kv_indices[kv_indptr[b]:kv_indptr[b+1]], h // group]`` widened to the compute type (float16
for float8 pools or non-16-bit queries, else q's dtype; q is rounded to it too); p is rounded to that type
before the second product, as FlashInfer does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rollout.kernels.pdl import pdl_launch, pdl_prologue

_LOG2E = 1.4426950408889634

@dataclass(frozen=True)
class DecodeLaunch:
    """Launch settings of stage 1 (``default_launch`` picks them per pool dtype)."""

    block_n: int = 64  # tokens per pipelined tile
    num_warps: int = 2
    num_stages: int = 4


def default_launch(kv_dtype: torch.dtype) -> DecodeLaunch:
    """The fastest settings of ``tools/sweep_decode.py`` on H200 at 256 requests (engine slot layout,
    8B and 1B heads; times in docs/benchmarks.md): float8 pools 32 tokens / 1 warp / 6 stages (faster than
    4 stages), 16-bit pools 64 / 2 / 4 (close to the best there)."""
    return DecodeLaunch(32, 1, 6) if kv_dtype.itemsize == 1 else DecodeLaunch()


@triton.jit
def _decode_split_kernel(q, k_buf, v_buf, kv_indptr, kv_indices, out, mid_o, mid_lse, qk_scale, v_scale,
                         q_sb, q_sh, k_ss, k_sh, v_ss, v_sh, o_sb, o_sh, m_sb, m_sh, m_ss, l_sb, l_sh,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                         NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr, counters, FUSED_MERGE: tl.constexpr):
    pdl_prologue(USE_PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_H)  # q heads of this KV head (GROUP of them, padded to the MMA height)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    # float16 for float8 pools (float8 widens to it exactly; a bf16 query rounds to it exactly within
    # float16's range, as FlashInfer's float8 kernels take it) and for queries that are not 16-bit
    compute = q.dtype.element_ty
    if q.dtype.element_ty.primitive_bitwidth != 16 or k_buf.dtype.element_ty.primitive_bitwidth == 8:
        compute = tl.float16
    qv = tl.load(q + b * q_sb + heads[:, None] * q_sh + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                 other=0.0).to(compute)
    start = tl.load(kv_indptr + b)
    seq_len = tl.load(kv_indptr + b + 1) - start
    per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    k_base = k_buf + kv_head * k_sh + d[None, :]
    v_base = v_buf + kv_head * v_sh + d[None, :]
    for n0 in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        slot = tl.load(kv_indices + start + n, mask=n_ok, other=0).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        kt = tl.load(k_base + slot[:, None] * k_ss, mask=kv_mask, other=0.0)
        vt = tl.load(v_base + slot[:, None] * v_ss, mask=kv_mask, other=0.0)
        s = tl.dot(qv, tl.trans(kt.to(compute))) * qk_scale  # log2 units
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        vt = vt.to(compute)
        if v_buf.dtype.element_ty.primitive_bitwidth == 8:
            # Scaling the widened tile by the pool's (unit) scale, a runtime value, keeps the widening where
            # the tile was loaded (16-byte shared-memory reads, then ldmatrix.trans on the 16-bit copy);
            # a bare widening is moved into the MMA operand layout, which reads the float8 V tile from
            # shared memory one byte at a time. (A re-mask does the same at 2.5x the instructions.)
            vt = vt * tl.cast(v_scale, compute)
        acc = acc * alpha[:, None] + tl.dot(p.to(compute), vt)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    o_mask = row_ok[:, None] & d_ok[None, :]
    if SPLITS == 1:
        o = acc / l_i[:, None]
        tl.store(out + b * o_sb + heads[:, None] * o_sh + d[None, :], o.to(out.dtype.element_ty), mask=o_mask)
    else:  # an empty split leaves acc = 0 and lse = m_i = -inf, which the merge weighs as 0
        l_safe = tl.maximum(l_i, 1e-30)
        o = acc / l_safe[:, None]
        lse = m_i + tl.log2(l_safe)
        tl.store(mid_o + b * m_sb + heads[:, None] * m_sh + split * m_ss + d[None, :], o, mask=o_mask)
        tl.store(mid_lse + b * l_sb + heads * l_sh + split, lse, mask=row_ok)
        if FUSED_MERGE:
            _merge_if_last(mid_o, mid_lse, out, counters + b * tl.num_programs(1) + kv_head, b, heads, row_ok, d,
                           d_ok, m_sb, m_sh, m_ss, l_sb, l_sh, o_sb, o_sh, BLOCK_H, BLOCK_D, SPLITS)


@triton.jit
def _merge_if_last(mid_o, mid_lse, out, counter, b, heads, row_ok, d, d_ok, m_sb, m_sh, m_ss, l_sb, l_sh, o_sb,
                   o_sh, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
    """Count this split of (request, KV head) as done; the last one merges the pair's SPLITS partials (the
    same arithmetic as ``_merge_splits_kernel``) into ``out`` and resets the count for the next launch.
    The barrier makes every thread's partial stores precede the release of the count; the acquiring side
    reads the partials past L1 (``.cg``)."""
    tl.debug_barrier()
    done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if done == SPLITS - 1:
        lse_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
        for sp in tl.static_range(SPLITS):
            lse_sp = tl.load(mid_lse + b * l_sb + heads * l_sh + sp, mask=row_ok, other=0.0, cache_modifier=".cg")
            lse_max = tl.maximum(lse_max, lse_sp)
        w_sum = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        mask = row_ok[:, None] & d_ok[None, :]
        for sp in tl.static_range(SPLITS):
            lse_sp = tl.load(mid_lse + b * l_sb + heads * l_sh + sp, mask=row_ok, other=0.0, cache_modifier=".cg")
            w = tl.exp2(lse_sp - lse_max)
            o_sp = tl.load(mid_o + b * m_sb + heads[:, None] * m_sh + sp * m_ss + d[None, :], mask=mask, other=0.0,
                           cache_modifier=".cg")
            acc += o_sp * w[:, None]
            w_sum += w
        merged = acc / tl.where(row_ok, w_sum, 1.0)[:, None]
        tl.store(out + b * o_sb + heads[:, None] * o_sh + d[None, :], merged.to(out.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_splits_kernel(mid_o, mid_lse, out, m_sb, m_sh, m_ss, l_sb, l_sh, o_sb, o_sh,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(mid_lse + b * l_sb + h * l_sh + s)
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(mid_o + b * m_sb + h * m_sh + s[:, None] * m_ss + d[None, :], mask=d_ok[None, :], other=0.0)
    merged = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out + b * o_sb + h * o_sh + d, merged.to(out.dtype.element_ty), mask=d_ok)


def num_kv_splits(batch_size: int, num_kv_heads: int, num_sms: int, kv_itemsize: int = 2, max_splits: int = 16) -> int:
    """Splits per request so that stage 1 has at least ``programs_per_sm`` programs per SM, rounded down to
    a power of two (1..max_splits): 4 for 16-bit pools; 16 for float8 pools, whose one-warp programs are
    short and leave the last wave of 2,048 equal programs (256 requests x 8 KV heads) mostly empty (H200,
    ``tools/sweep_decode.py``: 2 splits faster there, and at 128 and 192 requests; docs/benchmarks.md).
    Depends on the batch size only, so a CUDA graph captured for a batch size keeps it."""
    programs_per_sm = 16 if kv_itemsize == 1 else 4
    want = triton.cdiv(programs_per_sm * num_sms, max(1, batch_size * num_kv_heads))
    return min(max_splits, 1 << (want.bit_length() - 1))


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, sm_scale: float, num_splits: int, out: torch.Tensor | None = None,
                     launch: DecodeLaunch | None = None, counters: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per request against its paged KV (see the module docstring).

    q [B, Hq, D] (any float dtype); ``out`` [B, Hq, D] of any float dtype (default: new, q's dtype) gets
    the result rounded once from float32; k_buffer/v_buffer [num_slots, Hk, D] with a
    contiguous last dim, any float dtype incl. float8 (Hq a multiple of Hk); kv_indptr [B + 1] and
    kv_indices [kv_indptr[B]] int32 on q's device, every request with at least one token;
    ``num_splits`` a power of two (``num_kv_splits``); ``launch`` None: ``default_launch`` of the pool dtype.
    ``counters``: int32, at least B * Hk elements, all 0 (they are 0 again when the kernel ends): the splits
    merge inside stage 1 (no second launch); None: a merge kernel runs after it. No host sync; CUDA-graph safe.
    """
    b, hq, d = q.shape
    hk = k_buffer.shape[1]
    if hq % hk or k_buffer.shape[2] != d or v_buffer.shape[1:] != k_buffer.shape[1:]:
        raise ValueError(f"bad shapes q {tuple(q.shape)}, k {tuple(k_buffer.shape)}, v {tuple(v_buffer.shape)}")
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if q.stride(-1) != 1 or k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1:
        raise ValueError("q and the KV buffers need a contiguous last dim")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if b == 0:
        return out
    group = hq // hk
    block_d = triton.next_power_of_2(d)
    launch = launch or default_launch(k_buffer.dtype)
    pdl = pdl_launch(q.device)
    if num_splits > 1:
        mid_o = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        mid_o, mid_lse = out, out  # unused
    fused = num_splits > 1 and counters is not None
    if fused and (counters.dtype != torch.int32 or counters.numel() < b * hk or not counters.is_contiguous()):
        raise ValueError(f"counters must be a contiguous int32 tensor of >= {b * hk} zeros")
    _decode_split_kernel[(b, hk, num_splits)](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, out, mid_o, mid_lse, sm_scale * _LOG2E, 1.0,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        out.stride(0), out.stride(1), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2) if num_splits > 1 else 0,
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_DIM=d, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=launch.block_n, SPLITS=num_splits, NUM_STAGES=launch.num_stages,
        counters=counters if fused else out, FUSED_MERGE=fused, num_warps=launch.num_warps, **pdl)
    if num_splits > 1 and not fused:
        _merge_splits_kernel[(b, hq)](
            mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
            mid_lse.stride(1), out.stride(0), out.stride(1), HEAD_DIM=d, BLOCK_D=block_d, SPLITS=num_splits,
            num_warps=4, **pdl)
    return out

