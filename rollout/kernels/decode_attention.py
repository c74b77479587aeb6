"""Split-KV decode attention over a page-size-1 KV pool, in Triton.

One program owns one KV head of one request (its GROUP q heads, padded to 16 rows) and one slice of
the request's tokens. K/V tiles of BLOCK_N tokens stream through a software-pipelined loop
(``num_stages`` tiles in flight), are widened to the compute type in registers (float8 pools: unit
scale) and meet the queries on tensor cores with float32 accumulation and an online softmax (base 2).

    stage 1, grid (batch, kv_heads, splits) (or kv_heads first): a partial output and log-sum-exp (base 2)
    per split; the last program of each (request, KV head) to finish its split (an atomic count per pair in
    ``counters``) merges the pair's splits (``_merge_slots``) and sets the count back to 0. One split: the
    program writes the output itself.

Cascade (shared-prefix) decode, ``SharedPrefixArgs``: requests whose first P KV slots are the same (GRPO's N
samples of one cached prompt) form a group, and a stage 0 launch, grid (groups, kv_heads, prefix_splits),
reads each group's prefix once for all its members' queries (members x GROUP rows of one MMA tile) and writes
their partials after the SPLITS slots of the split buffer; stage 1 then covers each member's own suffix only
and its merge takes the prefix partials in. A prefix read once instead of N times is the whole gain: decode
attention is bound by KV bytes.

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

from rollout.kernels.decode_indices import check_launch_order
from rollout.kernels.pdl import pdl_launch, pdl_prologue

_LOG2E = 1.4426950408889634

@dataclass(frozen=True)
class DecodeLaunch:
    """Launch settings of stage 1 (``default_launch`` picks them per pool dtype)."""

    block_n: int = 64  # tokens per pipelined tile
    num_warps: int = 4
    num_stages: int = 3
    heads_first: bool = True  # launch order: a request's KV heads next to each other (else its requests)


def default_launch(kv_dtype: torch.dtype) -> DecodeLaunch:
    """float8 pools: 32 tokens / 1 warp / 6 stages, requests first (the fastest of ``tools/sweep_decode.py``
    on H200 at 256 requests; docs/benchmarks.md). 16-bit pools: 64 / 4 / 3, a request's KV heads launched next
    to each other, so the programs reading one token's heads run at once: the fastest or within 2% of it at
    every batch of ``tools/exp_decode_order.py`` on H200, requests of mixed lengths and equal ones (was
    64 / 2 / 4 requests first, 6-10% slower at mixed lengths; docs/results/2026-11-26-h200-decode-order.txt)."""
    return DecodeLaunch(32, 1, 6, heads_first=False) if kv_dtype.itemsize == 1 else DecodeLaunch()


@triton.jit
def _attend(qv, k_base, v_base, kv_indices, start, lo, hi, k_ss, v_ss, d_ok, qk_scale, v_scale,
            BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Online softmax of the query tile ``qv`` [BLOCK_H, BLOCK_D] (already in the compute type) over the tokens
    ``kv_indices[start + lo : start + hi]``: (unnormalized output, row sums, row maxima in log2 units)."""
    compute = qv.dtype
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
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
        if v_base.dtype.element_ty.primitive_bitwidth == 8:
            # Scaling the widened tile by the pool's (unit) scale, a runtime value, keeps the widening where
            # the tile was loaded (16-byte shared-memory reads, then ldmatrix.trans on the 16-bit copy);
            # a bare widening is moved into the MMA operand layout, which reads the float8 V tile from
            # shared memory one byte at a time. (A re-mask does the same at 2.5x the instructions.)
            vt = vt * tl.cast(v_scale, compute)
        acc = acc * alpha[:, None] + tl.dot(p.to(compute), vt)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _query_tile(q, offsets, mask, k_buf):
    """The query rows at ``q + offsets`` in the compute type: float16 for float8 pools (float8 widens to it
    exactly; a bf16 query rounds to it exactly within float16's range, as FlashInfer's float8 kernels take
    it) and for queries that are not 16-bit, else q's dtype."""
    compute = q.dtype.element_ty
    if q.dtype.element_ty.primitive_bitwidth != 16 or k_buf.dtype.element_ty.primitive_bitwidth == 8:
        compute = tl.float16
    return tl.load(q + offsets, mask=mask, other=0.0).to(compute)


@triton.jit
def _slice(length, splits, index, BLOCK_N: tl.constexpr):
    """Token range [lo, hi) of slice ``index`` of ``splits`` over ``length`` tokens (whole tiles per slice;
    trailing slices may be empty)."""
    per_split = tl.cdiv(tl.cdiv(length, splits), BLOCK_N) * BLOCK_N
    lo = index * per_split
    return lo, tl.minimum(lo + per_split, length)


@triton.jit
def _store_partial(mid_o, mid_lse, o_row, lse_row, row_ok, d, d_ok, split, acc, l_i, m_i, m_ss):
    """One split's normalized partial output and log-sum-exp (base 2) per row, at ``mid_o + o_row`` and
    ``mid_lse + lse_row`` (each row's request and head offsets); an empty split leaves acc = 0 and lse = m_i =
    -inf, which the merge weighs as 0."""
    l_safe = tl.maximum(l_i, 1e-30)
    o = acc / l_safe[:, None]
    lse = m_i + tl.log2(l_safe)
    tl.store(mid_o + o_row[:, None] + split * m_ss + d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(mid_lse + lse_row + split, lse, mask=row_ok)


@triton.jit(do_not_specialize=["prefix_splits"])
def _decode_split_kernel(q, k_buf, v_buf, kv_indptr, kv_indices, out, mid_o, mid_lse, qk_scale, v_scale,
                         q_sb, q_sh, k_ss, k_sh, v_ss, v_sh, o_sb, o_sh, m_sb, m_sh, m_ss, l_sb, l_sh,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                         NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr, counters,
                         req_prefix, prefix_splits, order, CASCADE: tl.constexpr, HEADS_FIRST: tl.constexpr,
                         ORDERED: tl.constexpr):
    if HEADS_FIRST:  # grid (kv_heads, batch, splits)
        kv_head = tl.program_id(0)
        b = tl.program_id(1)
        num_kv_heads = tl.num_programs(0)
    else:  # grid (batch, kv_heads, splits)
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    pdl_prologue(USE_PDL)
    if ORDERED:  # the b-th request launched (longest first: written by the step's index kernel)
        b = tl.load(order + b)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_H)  # q heads of this KV head (GROUP of them, padded to the MMA height)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    qv = _query_tile(q, b * q_sb + heads[:, None] * q_sh + d[None, :], row_ok[:, None] & d_ok[None, :], k_buf)
    start = tl.load(kv_indptr + b)
    seq_len = tl.load(kv_indptr + b + 1) - start
    skip = tl.zeros([], tl.int32)
    if CASCADE:  # the group's prefix is stage 0's: this request's own tokens follow it
        skip = tl.load(req_prefix + b)
    start += skip
    seq_len -= skip
    lo, hi = _slice(seq_len, SPLITS, split, BLOCK_N)
    acc, l_i, m_i = _attend(qv, k_buf + kv_head * k_sh + d[None, :], v_buf + kv_head * v_sh + d[None, :],
                            kv_indices, start, lo, hi, k_ss, v_ss, d_ok, qk_scale, v_scale,
                            BLOCK_H, BLOCK_D, BLOCK_N, NUM_STAGES)
    if SPLITS == 1 and not CASCADE:
        o = acc / l_i[:, None]
        tl.store(out + b * o_sb + heads[:, None] * o_sh + d[None, :], o.to(out.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        _store_partial(mid_o, mid_lse, b * m_sb + heads * m_sh, b * l_sb + heads * l_sh, row_ok, d, d_ok, split,
                       acc, l_i, m_i, m_ss)
        _merge_if_last(mid_o, mid_lse, out, counters + b * num_kv_heads + kv_head, b, heads, row_ok, d, d_ok,
                       m_sb, m_sh, m_ss, l_sb, l_sh, o_sb, o_sh, BLOCK_H, BLOCK_D, SPLITS,
                       prefix_splits if CASCADE else 0, skip)


@triton.jit(do_not_specialize=["splits", "prefix_splits"])
def _shared_prefix_kernel(q, k_buf, v_buf, kv_indptr, kv_indices, groups, mid_o, mid_lse, qk_scale, v_scale,
                          q_sb, q_sh, k_ss, k_sh, v_ss, v_sh, m_sb, m_sh, m_ss, l_sb, l_sh, g_s, splits,
                          prefix_splits, GROUP: tl.constexpr, MEMBERS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                          NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    """Stage 0: one group's prefix (``groups[g]`` = prefix length, then MEMBERS batch rows, -1 for none; a
    length of 0 marks an unused group) for one KV head and one of ``prefix_splits`` slices, the queries of
    every member in one tile (row r: member r // GROUP, head kv_head * GROUP + r % GROUP). The prefix's slots
    are the first member's first entries in ``kv_indices``. Writes split slot ``splits`` + slice of each
    member. The split counts are runtime values: one compiled kernel serves every CUDA graph size."""
    pdl_prologue(USE_PDL)
    g = tl.program_id(0)
    kv_head = tl.program_id(1)
    ps = tl.program_id(2)
    plen = tl.load(groups + g * g_s)
    if plen > 0:
        rows = tl.arange(0, BLOCK_R)
        member = rows // GROUP
        b = tl.load(groups + g * g_s + 1 + member, mask=member < MEMBERS, other=-1)
        row_ok = b >= 0
        b = tl.where(row_ok, b, 0)
        heads = kv_head * GROUP + rows % GROUP
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        qv = _query_tile(q, b[:, None] * q_sb + heads[:, None] * q_sh + d[None, :], row_ok[:, None] & d_ok[None, :],
                         k_buf)
        start = tl.load(kv_indptr + tl.load(groups + g * g_s + 1))
        lo, hi = _slice(plen, prefix_splits, ps, BLOCK_N)
        acc, l_i, m_i = _attend(qv, k_buf + kv_head * k_sh + d[None, :], v_buf + kv_head * v_sh + d[None, :],
                                kv_indices, start, lo, hi, k_ss, v_ss, d_ok, qk_scale, v_scale,
                                BLOCK_R, BLOCK_D, BLOCK_N, NUM_STAGES)
        _store_partial(mid_o, mid_lse, b * m_sb + heads * m_sh, b * l_sb + heads * l_sh, row_ok, d, d_ok,
                       splits + ps, acc, l_i, m_i, m_ss)


@triton.jit
def _merge_slots(out_ptrs, o_row, lse_row, first, count, o_stride, row_ok, d_ok, BLOCK_H: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """Online merge of partial slots [first, first + count) by their log-sum-exp (base 2) into ``out_ptrs``
    [BLOCK_H, BLOCK_D]: slot s's partial output at ``o_row + s * o_stride``, its log-sum-exp at ``lse_row + s``,
    both read past L1 (``.cg``: other programs wrote them). The first slot is never empty; a later empty one
    (log-sum-exp -inf) weighs 0. The one merge of the split, cascade and balanced decode kernels."""
    mask = row_ok[:, None] & d_ok[None, :]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    w_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in tl.range(first, first + count):
        lse = tl.load(lse_row + s, mask=row_ok, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        old = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * old[:, None] + tl.load(o_row + s * o_stride, mask=mask, other=0.0,
                                           cache_modifier=".cg") * w[:, None]
        w_sum = w_sum * old + w
        m = m_new
    merged = acc / tl.where(row_ok, w_sum, 1.0)[:, None]
    tl.store(out_ptrs, merged.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _merge_if_last(mid_o, mid_lse, out, counter, b, heads, row_ok, d, d_ok, m_sb, m_sh, m_ss, l_sb, l_sh, o_sb,
                   o_sh, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, prefix_splits,
                   prefix_len):
    """Count this split of (request, KV head) as done; the last of the SPLITS merges the pair's partials
    (``_merge_slots``) into ``out`` and resets the count for the next launch: its SPLITS, and when
    ``prefix_len`` (a tensor) > 0 the ``prefix_splits`` after them that stage 0 wrote (an earlier launch).
    The barrier makes every thread's partial stores precede the release of the count."""
    tl.debug_barrier()
    done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if done == SPLITS - 1:
        count = SPLITS + prefix_splits * (prefix_len > 0).to(tl.int32)
        _merge_slots(out + b * o_sb + heads[:, None] * o_sh + d[None, :],
                     mid_o + b * m_sb + heads[:, None] * m_sh + d[None, :], mid_lse + b * l_sb + heads * l_sh,
                     0, count, m_ss, row_ok, d_ok, BLOCK_H, BLOCK_D)
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def num_kv_splits(batch_size: int, num_kv_heads: int, num_sms: int, kv_itemsize: int = 2, max_splits: int = 16) -> int:
    """Splits per request so that stage 1 has at least ``programs_per_sm`` programs per SM, rounded down to
    a power of two (1..max_splits): 8 for 16-bit pools (H200, ``tools/exp_decode_order.py``: 2 splits at 128
    requests, 4 at 32, 8 at 16 are the fastest with the default launch at mixed lengths); 16 for float8 pools,
    whose one-warp programs are short and leave the last wave of 2,048 equal programs (256 requests x 8 KV
    heads) mostly empty (``tools/sweep_decode.py``: 2 splits faster there, and at 128 and 192 requests;
    docs/benchmarks.md). Depends on the batch size only, so a CUDA graph captured for a batch size keeps it."""
    programs_per_sm = 16 if kv_itemsize == 1 else 8
    want = triton.cdiv(programs_per_sm * num_sms, max(1, batch_size * num_kv_heads))
    return min(max_splits, 1 << (want.bit_length() - 1))


@dataclass(frozen=True)
class SharedPrefixArgs:
    """The groups of a decode batch whose members' first KV slots are the same, on the device (stage 0).

    ``groups``: int32 [G, 1 + M], contiguous: per group its prefix length P (0: an unused row, skipped), then
    M batch rows (-1: none), the first a real member: every member's first P entries of ``kv_indices`` are the
    first member's, and its seq len is above P. ``req_prefix``: int32 [>= B], each batch row's P (0 for a row
    in no group). ``splits``: stage 0 programs per group and KV head, a power of two."""

    groups: torch.Tensor
    req_prefix: torch.Tensor
    splits: int
    # stage 0's tile, warps and stages: the fastest or within 3% of it at every shape of
    # ``tools/bench_cascade.py --stage0`` on an H200 (docs/results/2026-11-26-h200-cascade-decode.txt)
    launch: DecodeLaunch = DecodeLaunch(128, 4, 3)

    @property
    def max_members(self) -> int:
        return self.groups.shape[1] - 1


def max_prefix_members(group: int) -> int:
    """Members one stage 0 tile takes (members x ``group`` query heads per KV head, up to 32 rows; 1: a model
    with more query heads per KV head than that gains nothing from cascade decode)."""
    return max(1, 32 // group)


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, sm_scale: float, num_splits: int, out: torch.Tensor | None = None,
                     launch: DecodeLaunch | None = None, counters: torch.Tensor | None = None,
                     shared_prefix: SharedPrefixArgs | None = None, order: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per request against its paged KV (see the module docstring).

    q [B, Hq, D] (any float dtype); ``out`` [B, Hq, D] of any float dtype (default: new, q's dtype) gets
    the result rounded once from float32; k_buffer/v_buffer [num_slots, Hk, D] with a
    contiguous last dim, any float dtype incl. float8 (Hq a multiple of Hk); kv_indptr [B + 1] and
    kv_indices [kv_indptr[B]] int32 on q's device, every request with at least one token;
    ``num_splits`` a power of two (``num_kv_splits``); ``launch`` None: ``default_launch`` of the pool dtype.
    ``counters``: int32, at least B * Hk elements, all 0 (they are 0 again when the kernel ends): the splits
    merge inside the kernel (None: a zeroed buffer is made for the call when there are splits to merge; the
    engine passes its own, so CUDA graphs hold no allocation). ``shared_prefix``: cascade
    decode (needs ``counters``); the result is the same attention over each request's whole KV. ``order``:
    int32 [>= B] holding a permutation of 0..B-1 in its first B entries, the order the requests' programs are
    launched in (``decode_indices``' longest first); it changes no result, only which programs run together.
    No host sync; CUDA-graph safe.
    """
    b, hq, d = q.shape
    hk = k_buffer.shape[1]
    check_decode_inputs(q, k_buffer, v_buffer)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    prefix_splits = 0 if shared_prefix is None else shared_prefix.splits
    if shared_prefix is not None:
        _check_shared_prefix(shared_prefix, b, counters)
    check_launch_order(order, b)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if b == 0:
        return out
    group = hq // hk
    block_d = triton.next_power_of_2(d)
    launch = launch or default_launch(k_buffer.dtype)
    pdl = pdl_launch(q.device)
    total = num_splits + prefix_splits
    if total > 1:
        mid_o = torch.empty((b, hq, total, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((b, hq, total), dtype=torch.float32, device=q.device)
        counters = torch.zeros(b * hk, dtype=torch.int32, device=q.device) if counters is None else counters
        check_counters(counters, b * hk)
    else:
        mid_o, mid_lse = out, out  # unused
    mid_strides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2) if total > 1 else 0, mid_lse.stride(0),
                   mid_lse.stride(1))
    if shared_prefix is not None and shared_prefix.groups.shape[0] > 0:
        groups = shared_prefix.groups
        members = shared_prefix.max_members
        _shared_prefix_kernel[(groups.shape[0], hk, prefix_splits)](
            q, k_buffer, v_buffer, kv_indptr, kv_indices, groups, mid_o, mid_lse, sm_scale * _LOG2E, 1.0,
            q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
            v_buffer.stride(1), *mid_strides, groups.stride(0), num_splits, prefix_splits,
            GROUP=group, MEMBERS=members, HEAD_DIM=d, BLOCK_R=max(16, triton.next_power_of_2(members * group)),
            BLOCK_D=block_d, BLOCK_N=shared_prefix.launch.block_n, NUM_STAGES=shared_prefix.launch.num_stages,
            num_warps=shared_prefix.launch.num_warps, **pdl)
    grid = (hk, b, num_splits) if launch.heads_first else (b, hk, num_splits)
    _decode_split_kernel[grid](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, out, mid_o, mid_lse, sm_scale * _LOG2E, 1.0,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        out.stride(0), out.stride(1), *mid_strides,
        GROUP=group, HEAD_DIM=d, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=launch.block_n, SPLITS=num_splits, NUM_STAGES=launch.num_stages,
        counters=out if total == 1 else counters,
        req_prefix=out if shared_prefix is None else shared_prefix.req_prefix, prefix_splits=prefix_splits,
        order=out if order is None else order, CASCADE=shared_prefix is not None, HEADS_FIRST=launch.heads_first,
        ORDERED=order is not None, num_warps=launch.num_warps, **pdl)
    return out


def check_decode_inputs(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> None:
    """q [B, Hq, D] against KV buffers [slots, Hk, D] (Hq a multiple of Hk), each with a contiguous last dim."""
    d, hq, hk = q.shape[2], q.shape[1], k_buffer.shape[1]
    if hq % hk or k_buffer.shape[2] != d or v_buffer.shape[1:] != k_buffer.shape[1:]:
        raise ValueError(f"bad shapes q {tuple(q.shape)}, k {tuple(k_buffer.shape)}, v {tuple(v_buffer.shape)}")
    if q.stride(-1) != 1 or k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1:
        raise ValueError("q and the KV buffers need a contiguous last dim")


def check_counters(counters: torch.Tensor, need: int) -> None:
    """The in-kernel merge's counts: a contiguous int32 tensor of at least ``need`` entries."""
    if counters.dtype != torch.int32 or counters.numel() < need or not counters.is_contiguous():
        raise ValueError(f"counters must be a contiguous int32 tensor of >= {need} zeros")


def _check_shared_prefix(args: SharedPrefixArgs, batch_size: int, counters: torch.Tensor | None) -> None:
    groups, req_prefix = args.groups, args.req_prefix
    if counters is None:
        raise ValueError("cascade decode (shared_prefix) merges inside stage 1: pass counters")
    if args.splits < 1 or args.splits & (args.splits - 1):
        raise ValueError(f"shared_prefix.splits must be a power of two, got {args.splits}")
    if groups.dtype != torch.int32 or groups.dim() != 2 or groups.shape[1] < 2 or groups.stride(1) != 1:
        raise ValueError("shared_prefix.groups must be int32 [G, 1 + M] with M >= 1, stride 1 along its rows")
    if req_prefix.dtype != torch.int32 or req_prefix.numel() < batch_size or not req_prefix.is_contiguous():
        raise ValueError(f"shared_prefix.req_prefix must be a contiguous int32 tensor of >= {batch_size} entries")
