"""Split-KV decode attention over a page-size-1 KV pool, in Triton.

One program owns ``HEADS`` consecutive KV heads of one request and one slice of its tokens, so each
token it reads is ``HEADS * head_dim`` contiguous elements of the pool row ``[slot, kv_head, :]``
(all KV heads: one whole row). K/V tiles of BLOCK_N tokens stream through a software-pipelined loop
(``num_stages`` tiles in flight), are widened to the query's 16-bit type in registers (float8 pools:
unit scale) and meet the queries on tensor cores as ``HEADS`` batched products with float32
accumulation and an online softmax.

    stage 1, grid (batch, kv_heads / HEADS, splits): partial output and log-sum-exp per split.
    stage 2, grid (batch, q_heads): merges the splits by their log-sum-exp (skipped when splits == 1).

Semantics: ``out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b`` where K_b, V_b are the rows
``k_buffer[kv_indices[kv_indptr[b]:kv_indptr[b+1]], h // group]`` widened to the compute type (q's
dtype if 16-bit, else float16); p is rounded to that type before the second product, as FlashInfer does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class DecodeLaunch:
    """Launch settings of stage 1 (``gpu_checks`` sweeps them on the target GPU)."""

    heads: int = 8  # KV heads per program (capped at num_kv_heads; must divide it)
    block_n: int = 32  # tokens per pipelined tile
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _decode_split_kernel(q, k_buf, v_buf, kv_indptr, kv_indices, out, mid_o, mid_lse, sm_scale,
                         q_sb, q_sh, k_ss, k_sh, v_ss, v_sh, o_sb, o_sh, m_sb, m_sh, m_ss, l_sb, l_sh,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                         NUM_STAGES: tl.constexpr):
    b = tl.program_id(0)
    kv_head0 = tl.program_id(1) * HEADS
    split = tl.program_id(2)
    hh = tl.arange(0, HEADS)  # KV heads of this program
    rows = tl.arange(0, BLOCK_H)  # q heads of one KV head (GROUP of them, padded to the MMA height)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_heads = (kv_head0 + hh)[:, None] * GROUP + rows[None, :]  # [HEADS, BLOCK_H]
    q_ok = (rows < GROUP)[None, :, None] & d_ok[None, None, :]
    compute = tl.float16 if q.dtype.element_ty.primitive_bitwidth != 16 else q.dtype.element_ty
    qv = tl.load(q + b * q_sb + q_heads[:, :, None] * q_sh + d[None, None, :], mask=q_ok, other=0.0)
    qv = qv.to(compute)
    start = tl.load(kv_indptr + b)
    seq_len = tl.load(kv_indptr + b + 1) - start
    per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    m_i = tl.full([HEADS, BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([HEADS, BLOCK_H], tl.float32)
    acc = tl.zeros([HEADS, BLOCK_H, BLOCK_D], tl.float32)
    k_cols = (kv_head0 + hh)[None, :, None] * k_sh + d[None, None, :]  # [1, HEADS, BLOCK_D]
    v_cols = (kv_head0 + hh)[None, :, None] * v_sh + d[None, None, :]
    for n0 in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        slot = tl.load(kv_indices + start + n, mask=n_ok, other=0).to(tl.int64)
        kv_mask = n_ok[:, None, None] & d_ok[None, None, :]
        kt = tl.load(k_buf + slot[:, None, None] * k_ss + k_cols, mask=kv_mask, other=0.0)  # [N, HEADS, D]
        vt = tl.load(v_buf + slot[:, None, None] * v_ss + v_cols, mask=kv_mask, other=0.0)
        s = tl.dot(qv, tl.permute(kt.to(compute), (1, 2, 0))) * sm_scale  # [HEADS, BLOCK_H, N]
        s = tl.where(n_ok[None, None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 2))
        p = tl.exp(s - m_new[:, :, None])
        alpha = tl.exp(m_i - m_new)
        acc = acc * alpha[:, :, None] + tl.dot(p.to(compute), tl.permute(vt.to(compute), (1, 0, 2)))
        l_i = l_i * alpha + tl.sum(p, 2)
        m_i = m_new
    if SPLITS == 1:
        o = acc / l_i[:, :, None]
        tl.store(out + b * o_sb + q_heads[:, :, None] * o_sh + d[None, None, :], o.to(out.dtype.element_ty),
                 mask=q_ok)
    else:  # an empty split leaves acc = 0 and lse = m_i = -inf, which the merge weighs as 0
        l_safe = tl.maximum(l_i, 1e-30)
        o = acc / l_safe[:, :, None]
        lse = m_i + tl.log(l_safe)
        tl.store(mid_o + b * m_sb + q_heads[:, :, None] * m_sh + split * m_ss + d[None, None, :], o, mask=q_ok)
        tl.store(mid_lse + b * l_sb + q_heads * l_sh + split, lse, mask=(rows < GROUP)[None, :])


@triton.jit
def _merge_splits_kernel(mid_o, mid_lse, out, m_sb, m_sh, m_ss, l_sb, l_sh, o_sb, o_sh,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(mid_lse + b * l_sb + h * l_sh + s)
    w = tl.exp(lse - tl.max(lse, 0))
    o = tl.load(mid_o + b * m_sb + h * m_sh + s[:, None] * m_ss + d[None, :], mask=d_ok[None, :], other=0.0)
    merged = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out + b * o_sb + h * o_sh + d, merged.to(out.dtype.element_ty), mask=d_ok)


def num_kv_splits(batch_size: int, num_programs_per_split: int, num_sms: int, max_splits: int = 16) -> int:
    """Splits per request so that stage 1 has about four programs per SM (a power of two, 1..max_splits);
    depends on the batch size only, so a CUDA graph captured for a batch size keeps it."""
    want = triton.cdiv(4 * num_sms, max(1, batch_size * num_programs_per_split))
    return min(max_splits, triton.next_power_of_2(want))


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, sm_scale: float, num_splits: int, out: torch.Tensor | None = None,
                     launch: DecodeLaunch = DecodeLaunch()) -> torch.Tensor:
    """One query token per request against its paged KV (see the module docstring).

    q [B, Hq, D] (any float dtype; the output has it); k_buffer/v_buffer [num_slots, Hk, D] with a
    contiguous last dim, any float dtype incl. float8 (Hq a multiple of Hk); kv_indptr [B + 1] and
    kv_indices [kv_indptr[B]] int32 on q's device, every request with at least one token;
    ``num_splits`` a power of two (``num_kv_splits``). No host sync; CUDA-graph safe.
    """
    b, hq, d = q.shape
    hk = k_buffer.shape[1]
    if hq % hk or k_buffer.shape[2] != d or v_buffer.shape[1:] != k_buffer.shape[1:]:
        raise ValueError(f"bad shapes q {tuple(q.shape)}, k {tuple(k_buffer.shape)}, v {tuple(v_buffer.shape)}")
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if q.stride(-1) != 1 or k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1:
        raise ValueError("q and the KV buffers need a contiguous last dim")
    heads = heads_per_program(hk, launch.heads)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if b == 0:
        return out
    group = hq // hk
    block_d = triton.next_power_of_2(d)
    if num_splits > 1:
        mid_o = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        mid_o, mid_lse = out, out  # unused
    _decode_split_kernel[(b, hk // heads, num_splits)](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, out, mid_o, mid_lse, sm_scale,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        out.stride(0), out.stride(1), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2) if num_splits > 1 else 0,
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_DIM=d, HEADS=heads, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=launch.block_n, SPLITS=num_splits, NUM_STAGES=launch.num_stages, num_warps=launch.num_warps)
    if num_splits > 1:
        _merge_splits_kernel[(b, hq)](
            mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
            mid_lse.stride(1), out.stride(0), out.stride(1), HEAD_DIM=d, BLOCK_D=block_d, SPLITS=num_splits,
            num_warps=4)
    return out


def heads_per_program(num_kv_heads: int, wanted: int) -> int:
    """The largest power of two <= ``wanted`` that divides ``num_kv_heads``."""
    heads = 1
    while heads * 2 <= wanted and num_kv_heads % (heads * 2) == 0:
        heads *= 2
    return heads
