"""Experiment: variants of the float8 decode kernel (not used by the engine).

    python tools/exp_decode_variants.py [--variants ...]

CVT  0: widen with .to() and re-mask V (the engine's kernel); 1: widen V (and K when CVT_K) by inline
     PTX cvt in the load layout; 2: .to() without the re-mask.
LAZY 1: rescale the accumulator only when a row's max grows by more than 8 (log2 units; exact).
QK8  1: the query split as hi + lo float8 (per-row power-of-two scale) for Q.K^T on float8 tensor cores.
     Triton 3.6 compiles it to float16 MMAs with both operands widened (one-warp programs have no wgmma),
     so K is still widened: 1261 loop instructions per tile vs 1092; not timed as a win.
CVT 3 (``mulV``) is what the engine kernel does since 2026-11-22 (docs/results/*decode-variants*).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CVT_ASM = tl.constexpr("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; "
            "cvt.rn.f16x2.e4m3x2 $1, hi; }")


@triton.jit
def _widen(x, CVT: tl.constexpr):
    if CVT == 1:
        return tl.inline_asm_elementwise(_CVT_ASM, "=r,=r,r", [x.to(tl.uint8, bitcast=True)],
                                         dtype=tl.float16, is_pure=True, pack=4)
    else:
        return x.to(tl.float16)


@triton.jit
def _rescale(acc, l_i, m_i, m_tile):
    """Online softmax: move the accumulator and the sum to the new running max (base 2)."""
    m_new = tl.maximum(m_i, m_tile)
    alpha = tl.exp2(m_i - m_new)
    return acc * alpha[:, None], l_i * alpha, m_new


@triton.jit
def exp_decode_kernel(q, k_buf, v_buf, kv_indptr, kv_indices, out, sm_scale, v_one, v_zero,
                      q_sb, q_sh, k_ss, k_sh, v_ss, v_sh, o_sb, o_sh,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, CVT: tl.constexpr,
                      CVT_K: tl.constexpr, LAZY: tl.constexpr, QK8: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, HEAD_DIM)
    qv = tl.load(q + b * q_sb + heads[:, None] * q_sh + d[None, :], mask=row_ok[:, None], other=0.0)
    qscale = sm_scale * 1.4426950408889634  # scores in log2 units
    if QK8:
        qf = qv.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(qf), 1), 1e-30)
        rs = tl.exp2(tl.ceil(tl.log2(amax)) - 8.0)  # power of two: max |q / rs| <= 256
        qs = qf / rs[:, None]
        q_hi = qs.to(tl.float8e4nv)
        q_lo = (qs - q_hi.to(tl.float32)).to(tl.float8e4nv)
        row_scale = rs * qscale
    else:
        qh = qv.to(tl.float16)
    start = tl.load(kv_indptr + b)
    seq_len = tl.load(kv_indptr + b + 1) - start
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    k_base = k_buf + kv_head * k_sh + d[None, :]
    v_base = v_buf + kv_head * v_sh + d[None, :]
    for n0 in tl.range(0, seq_len, BLOCK_N, num_stages=NUM_STAGES):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < seq_len
        slot = tl.load(kv_indices + start + n, mask=n_ok, other=0).to(tl.int64)
        kt = tl.load(k_base + slot[:, None] * k_ss, mask=n_ok[:, None], other=0.0)
        vt = tl.load(v_base + slot[:, None] * v_ss, mask=n_ok[:, None], other=0.0)
        if QK8:
            s = tl.dot(q_hi, tl.trans(kt)) + tl.dot(q_lo, tl.trans(kt))
            s = s * row_scale[:, None]
        else:
            if CVT_K:
                kh = _widen(kt, CVT)
            else:
                kh = kt.to(tl.float16)
            s = tl.dot(qh, tl.trans(kh)) * qscale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_tile = tl.max(s, 1)
        if LAZY:  # rescale only when the running max grows by more than 2**8
            if tl.max(m_tile - m_i, 0) > 8.0:
                acc, l_i, m_i = _rescale(acc, l_i, m_i, m_tile)
        else:
            acc, l_i, m_i = _rescale(acc, l_i, m_i, m_tile)
        p = tl.exp2(s - m_i[:, None])
        if CVT == 0:
            vh = tl.where(n_ok[:, None], vt.to(tl.float16), 0.0)
        elif CVT == 3:
            vh = vt.to(tl.float16) * v_one.to(tl.float16)
        elif CVT == 4:
            vh = vt.to(tl.float16) + v_zero.to(tl.float16)
        elif CVT == 2:
            vh = vt.to(tl.float16)
        else:
            vh = _widen(vt, CVT)
        acc = acc + tl.dot(p.to(tl.float16), vh)
        l_i = l_i + tl.sum(p, 1)
    o = acc / l_i[:, None]
    tl.store(out + b * o_sb + heads[:, None] * o_sh + d[None, :], o.to(out.dtype.element_ty),
             mask=row_ok[:, None])


def run_variant(q, k, v, indptr, indices, out, scale, block_n, warps, stages, cvt, cvt_k, lazy, qk8):
    b, hq, d = q.shape
    hk = k.shape[1]
    exp_decode_kernel[(b, hk)](
        q, k, v, indptr, indices, out, scale, 1.0, 0.0, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), GROUP=hq // hk, HEAD_DIM=d,
        BLOCK_H=max(16, triton.next_power_of_2(hq // hk)), BLOCK_N=block_n, NUM_STAGES=stages, CVT=cvt,
        CVT_K=cvt_k, LAZY=lazy, QK8=qk8, num_warps=warps)
    return out


def _variants() -> dict[str, tuple[int, ...]]:
    """name -> (block_n, warps, stages, cvt, cvt_k, lazy, qk8); the names of docs/results/*decode-variants*."""
    named = {"base": (0, 0, 0, 0), "plain": (2, 0, 0, 0), "mulV": (3, 0, 0, 0), "mulV-lazy": (3, 0, 1, 0),
             "asmV": (1, 0, 0, 0), "asmKV": (1, 1, 0, 0), "asmV-qk8": (1, 0, 0, 1)}
    out = {name: (32, 1, 4, *flags) for name, flags in named.items()}
    out.update({"mulV-s3": (32, 1, 3, 3, 0, 0, 0), "mulV-s5": (32, 1, 5, 3, 0, 0, 0),
                "mulV-64w2": (64, 2, 4, 3, 0, 0, 0), "mulV-64w1": (64, 1, 3, 3, 0, 0, 0),
                "mulV-16w1": (16, 1, 4, 3, 0, 0, 0)})
    for n, w, st in [(16, 1, 6), (16, 1, 8), (16, 1, 10), (32, 1, 5), (32, 1, 6), (32, 1, 7), (32, 1, 8),
                     (32, 2, 5), (32, 2, 6), (64, 2, 5), (64, 2, 6), (64, 4, 5), (64, 4, 6)]:
        out[f"mulV-{n}w{w}s{st}"] = (n, w, st, 3, 0, 0, 0)
        out[f"base-{n}w{w}s{st}"] = (n, w, st, 0, 0, 0, 0)
    return out


VARIANTS = _variants()


def staircase(args, dev, decode_attention, slot_layout, time_ms) -> None:
    """us per call and per request at each batch size: whole waves of programs show as steps."""
    hq, hk, d, context = 32, 8, 128, args.context
    for batch in [int(x) for x in args.staircase.split(",")]:
        slots = batch * context
        indptr = torch.arange(0, slots + 1, context, dtype=torch.int32, device=dev)
        indices = slot_layout("engine", batch, context, dev)
        q = torch.randn(batch, hq, d, device=dev).to(torch.bfloat16)
        k = torch.randn(slots + 1, hk, d, device=dev).to(torch.float8_e4m3fn)
        v = torch.randn(slots + 1, hk, d, device=dev).to(torch.float8_e4m3fn)
        row = [f"batch {batch:4d} programs {batch * hk:5d}"]
        for name in args.variants.split(","):
            out = torch.empty_like(q)
            ms = time_ms(lambda: run_variant(q, k, v, indptr, indices, out, d ** -0.5, *VARIANTS[name]))
            row.append(f"{name} {ms * 1e3:7.1f} us {ms * 1e3 / batch:6.3f} us/req")
        print(" | ".join(row), flush=True)


def main() -> None:
    from rollout.kernels.decode_attention import decode_attention
    from tools.sweep_decode import slot_layout
    from tools.timing import eager_ms as time_ms

    p = argparse.ArgumentParser()
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--staircase", help="comma list of batch sizes: time per request of each variant")
    p.add_argument("--context", type=int, default=1500)
    p.add_argument("--pool", default="slot-major", choices=["slot-major", "kv-interleaved", "head-major"])
    args = p.parse_args()
    dev = torch.device("cuda")
    if args.staircase:
        staircase(args, dev, decode_attention, slot_layout, time_ms)
        return
    batch, context, hq, hk, d = args.batch, args.context, 32, 8, 128
    slots = batch * context
    indptr = torch.arange(0, slots + 1, context, dtype=torch.int32, device=dev)
    indices = slot_layout("engine", batch, context, dev)
    q = (torch.randn(batch, hq, d, device=dev) * 3).to(torch.bfloat16)
    if args.pool == "slot-major":
        k = torch.randn(slots + 1, hk, d, device=dev).to(torch.float8_e4m3fn)
        v = torch.randn(slots + 1, hk, d, device=dev).to(torch.float8_e4m3fn)
    elif args.pool == "kv-interleaved":  # [slot, head, K|V, dim]: a token-head's K and V rows adjacent
        kv = torch.randn(slots + 1, hk, 2, d, device=dev).to(torch.float8_e4m3fn)
        k, v = kv[:, :, 0], kv[:, :, 1]
    else:  # [head, slot, dim]: a head's rows of consecutive slots adjacent
        k = torch.randn(hk, slots + 1, d, device=dev).to(torch.float8_e4m3fn).transpose(0, 1)
        v = torch.randn(hk, slots + 1, d, device=dev).to(torch.float8_e4m3fn).transpose(0, 1)
    print(f"pool {args.pool}: k strides {k.stride()}", flush=True)
    scale = d ** -0.5
    gb = 2 * slots * hk * d / 1e9
    ref = decode_attention(q, k, v, indptr, indices, scale, 1, out=torch.empty(q.shape, device=dev))
    ms = time_ms(lambda: decode_attention(q, k, v, indptr, indices, scale, 1, out=torch.empty_like(q)))
    print(f"engine kernel          {ms:.4f} ms  {gb / ms:.2f} TB/s", flush=True)
    for name in args.variants.split(","):
        cfg = VARIANTS[name]
        out = torch.empty_like(q)
        try:
            run_variant(q, k, v, indptr, indices, out, scale, *cfg)
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            ms = time_ms(lambda: run_variant(q, k, v, indptr, indices, out, scale, *cfg))
        except Exception as e:  # noqa: BLE001
            print(f"{name:22s} failed {type(e).__name__}: {e}"[:400], flush=True)
            continue
        print(f"{name:22s} {ms:.4f} ms  {gb / ms:.2f} TB/s  max err vs engine {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
