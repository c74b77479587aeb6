"""One Triton kernel per layer for rotary embedding of q/k plus the k/v write into the paged KV pool, and
(Qwen3's q/k norm) the per-head RMSNorm of q and k before it.

Replaces ``RMSNorm`` on q and k, ``RotaryEmbedding.forward`` and ``KVPool.set_kv`` on CUDA: the torch path
launches about a dozen tiny kernels per layer, and even FlashInfer's norms cost four more (two norms and the
two copies that make the strided q/k views of the fused qkv output contiguous for them), which dominate a
small model's decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.kernels.pdl import pdl_launch, pdl_prologue

# Elements (heads * head_dim) one program handles; keeps the fp32 tile at ~16 values per thread.
_TILE_ELEMS = 2048
_NUM_WARPS = 4


@triton.jit
def _head_tile(src, src_stride_h, dst, dst_stride_h, head0, n_heads,
               HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Pointers to the first halves of heads [head0, head0 + BLOCK_H) in src and dst, the column
    offsets, and the mask of real (head < n_heads, column < HALF) entries."""
    heads = head0 + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < n_heads) & (cols[None, :] < HALF)
    src_lo = src + heads[:, None] * src_stride_h + cols[None, :]
    dst_lo = dst + heads[:, None] * dst_stride_h + cols[None, :]
    return src_lo, dst_lo, cols, mask


@triton.jit
def _rms_norm_halves(x1, x2, w, cols, col_mask, eps, in_ty, HALF: tl.constexpr):
    """Hugging Face's RMSNorm of each row (a head, given as its two halves, float32): statistics in float32,
    ``weight * (x * rsqrt(mean(x^2) + eps)).to(in_ty)`` rounded to ``in_ty`` again, returned in float32."""
    r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.load(w + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w + HALF + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y1 = (w1 * (x1 * r).to(in_ty).to(tl.float32)).to(in_ty).to(tl.float32)
    y2 = (w2 * (x2 * r).to(in_ty).to(tl.float32)).to(in_ty).to(tl.float32)
    return y1, y2


@triton.jit
def _rope_tile(src, src_stride_h, dst, dst_stride_h, cos_row, sin_row, head0, n_heads, norm_w, eps,
               HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, NORM: tl.constexpr):
    """dst[h] = x * cos + rotate_half(x) * sin with x = src[h] (``NORM``: x = RMSNorm(src[h]) with weight
    ``norm_w``) for heads [head0, head0 + BLOCK_H) ∩ [0, n_heads)."""
    src_lo, dst_lo, cols, mask = _head_tile(src, src_stride_h, dst, dst_stride_h, head0, n_heads,
                                            HALF, BLOCK_H, BLOCK_HALF)
    x1 = tl.load(src_lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_lo + HALF, mask=mask, other=0.0).to(tl.float32)
    col_mask = cols < HALF
    if NORM:
        x1, x2 = _rms_norm_halves(x1, x2, norm_w, cols, col_mask, eps, src.dtype.element_ty, HALF)
    # Both cache halves are read (not just one) so any cos/sin table gives exactly the torch formula.
    cos1 = tl.load(cos_row + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_row + HALF + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_row + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_row + HALF + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_ty = dst.dtype.element_ty
    tl.store(dst_lo, (x1 * cos1 - x2 * sin1).to(out_ty), mask=mask)
    tl.store(dst_lo + HALF, (x2 * cos2 + x1 * sin2).to(out_ty), mask=mask)


@triton.jit
def _copy_tile(src, src_stride_h, dst, dst_stride_h, head0, n_heads,
               HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """dst[h] = src[h] for heads [head0, head0 + BLOCK_H) ∩ [0, n_heads), as two half-rows."""
    src_lo, dst_lo, cols, mask = _head_tile(src, src_stride_h, dst, dst_stride_h, head0, n_heads,
                                            HALF, BLOCK_H, BLOCK_HALF)
    out_ty = dst.dtype.element_ty  # through float32: one rounding, also into float8 buffers
    tl.store(dst_lo, tl.load(src_lo, mask=mask).to(tl.float32).to(out_ty), mask=mask)
    tl.store(dst_lo + HALF, tl.load(src_lo + HALF, mask=mask).to(tl.float32).to(out_ty), mask=mask)


@triton.jit
def _rope_store_kv_kernel(q, k, v, positions, cos_cache, sin_cache, k_buf, v_buf, out_loc, q_out, k_out,
                          q_norm_w, k_norm_w, eps,
                          q_st, q_sh, k_st, k_sh, v_st, v_sh, cos_st, sin_st, kb_ss, kb_sh, vb_ss, vb_sh,
                          qo_st, qo_sh, ko_st, ko_sh, n_q_heads, n_kv_heads,
                          HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                          BLOCK_HALF: tl.constexpr, USE_PDL: tl.constexpr, K_OUT: tl.constexpr,
                          NORM: tl.constexpr):
    """Grid (T, cdiv(Hq, BLOCK_HQ) + cdiv(Hk, BLOCK_HK)): the first blocks of axis 1 rotate q heads,
    the rest rotate k heads into the pool (and into ``k_out`` when K_OUT) and copy the matching v heads;
    with NORM each q and k head is RMS-normalized (its own weights) before it is rotated."""
    pdl_prologue(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    n_q_blocks = tl.cdiv(n_q_heads, BLOCK_HQ)
    pos = tl.load(positions + t).to(tl.int64)
    cos_row = cos_cache + pos * cos_st
    sin_row = sin_cache + pos * sin_st
    if blk < n_q_blocks:
        _rope_tile(q + t * q_st, q_sh, q_out + t * qo_st, qo_sh, cos_row, sin_row, blk * BLOCK_HQ, n_q_heads,
                   q_norm_w, eps, HALF, BLOCK_HQ, BLOCK_HALF, NORM)
    else:
        head0 = (blk - n_q_blocks) * BLOCK_HK
        slot = tl.load(out_loc + t).to(tl.int64)
        _rope_tile(k + t * k_st, k_sh, k_buf + slot * kb_ss, kb_sh, cos_row, sin_row, head0, n_kv_heads,
                   k_norm_w, eps, HALF, BLOCK_HK, BLOCK_HALF, NORM)
        if K_OUT:
            _rope_tile(k + t * k_st, k_sh, k_out + t * ko_st, ko_sh, cos_row, sin_row, head0, n_kv_heads,
                       k_norm_w, eps, HALF, BLOCK_HK, BLOCK_HALF, NORM)
        _copy_tile(v + t * v_st, v_sh, v_buf + slot * vb_ss, vb_sh, head0, n_kv_heads,
                   HALF, BLOCK_HK, BLOCK_HALF)


def _heads_per_program(n_heads: int, head_dim: int) -> int:
    return min(triton.next_power_of_2(n_heads), max(1, _TILE_ELEMS // head_dim))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
           k_buffer: torch.Tensor, v_buffer: torch.Tensor, q_out: torch.Tensor) -> None:
    """Shape/stride checks on host metadata only (no device sync)."""
    t, _, d = q.shape
    if d % 2 or k.shape != v.shape or k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"bad q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k_buffer.shape[1:] != k.shape[1:] or v_buffer.shape[1:] != k.shape[1:]:
        raise ValueError(f"KV buffers {tuple(k_buffer.shape)} / {tuple(v_buffer.shape)} "
                         f"do not match k {tuple(k.shape)}")
    if cos_cache.shape[1:] != (d,) or sin_cache.shape != cos_cache.shape:
        raise ValueError(f"cos/sin caches {tuple(cos_cache.shape)} / {tuple(sin_cache.shape)} must be [P, {d}]")
    if q_out.shape != q.shape:
        raise ValueError(f"q_out shape {tuple(q_out.shape)} != q shape {tuple(q.shape)}")
    if any(x.stride(-1) != 1 for x in (q, k, v, cos_cache, sin_cache, k_buffer, v_buffer, q_out)):
        raise ValueError("q, k, v, cos/sin caches, KV buffers and q_out need a contiguous last dim")


def rope_and_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_cache: torch.Tensor, sin_cache: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                      out_cache_loc: torch.Tensor, q_out: torch.Tensor | None = None,
                      k_out: torch.Tensor | None = None, q_norm_weight: torch.Tensor | None = None,
                      k_norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6) -> torch.Tensor:
    """Neox-style RoPE on q and k, with k and v written into one layer's paged KV pool, in one kernel.

    q [T, Hq, D], k/v [T, Hk, D] may be strided views (e.g. of a fused qkv output) but need a
    contiguous last dim; positions [T] and out_cache_loc [T] are integer tensors (int64);
    cos_cache/sin_cache [max_positions, D] are ``RotaryEmbedding``'s buffers (row stride free, last
    dim contiguous); k_buffer/v_buffer [num_slots + 1, Hk, D] with contiguous last dim.

    Effect: ``k_buffer[out_cache_loc[t]] = rope(k[t])``, ``v_buffer[out_cache_loc[t]] = v[t]`` (cast to
    the buffer dtype). Returns ``rope(q)`` as ``q_out`` [T, Hq, D] (allocated contiguous in q's dtype when
    None). With ``k_out`` [T, Hk, D] (last dim contiguous) it also gets ``rope(k)`` in its own dtype (the
    attention of a fresh prefill over a float8 pool reads it there, unrounded to float8).
    rope(x) = x * cos + rotate_half(x) * sin, computed in float32 and rounded once on store.
    With ``q_norm_weight`` and ``k_norm_weight`` [D] (both or neither; Qwen3's ``q_norm``/``k_norm``) every q
    and k head is first replaced by ``RMSNorm`` of it as ``rollout.layers.norm.RMSNorm``'s torch path computes
    it (float32 statistics, ``norm_eps``, rounded to the input dtype before and after the weight), so
    rope(norm(q)) and rope(norm(k)) come out of this one kernel.
    out_cache_loc must be distinct per token (duplicate slots race). No host sync; CUDA-graph safe
    when q_out is given.
    """
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both q_norm_weight and k_norm_weight, or neither")
    norm = q_norm_weight is not None
    if norm and (q_norm_weight.shape != (q.shape[2],) or k_norm_weight.shape != (q.shape[2],)
                 or not q_norm_weight.is_contiguous() or not k_norm_weight.is_contiguous()):
        raise ValueError(f"q/k norm weights {tuple(q_norm_weight.shape)} / {tuple(k_norm_weight.shape)} "
                         f"must be contiguous [{q.shape[2]}]")
    if q_out is None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _check(q, k, v, cos_cache, sin_cache, k_buffer, v_buffer, q_out)
    t, n_q, d = q.shape
    n_kv = k.shape[1]
    if t == 0:
        return q_out
    block_hq, block_hk = _heads_per_program(n_q, d), _heads_per_program(n_kv, d)
    grid = (t, triton.cdiv(n_q, block_hq) + triton.cdiv(n_kv, block_hk))
    if k_out is not None and (k_out.shape != k.shape or k_out.stride(-1) != 1):
        raise ValueError(f"k_out {tuple(k_out.shape)} must have k's shape {tuple(k.shape)}, last dim contiguous")
    ko = k_out if k_out is not None else q_out  # unused when None
    q_w = q_norm_weight if norm else cos_cache  # unused when not norm
    k_w = k_norm_weight if norm else cos_cache
    _rope_store_kv_kernel[grid](
        q, k, v, positions, cos_cache, sin_cache, k_buffer, v_buffer, out_cache_loc, q_out, ko, q_w, k_w,
        float(norm_eps), *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], cos_cache.stride(0),
        sin_cache.stride(0), *k_buffer.stride()[:2], *v_buffer.stride()[:2], *q_out.stride()[:2],
        *ko.stride()[:2], n_q, n_kv,
        HALF=d // 2, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=triton.next_power_of_2(d // 2),
        K_OUT=k_out is not None, NORM=norm, num_warps=_NUM_WARPS, **pdl_launch(q.device))
    return q_out
