"""Experiment: does decode attention over short contexts lose its read bandwidth to each program's ramp (the
pipeline filling, the index loads before the first K/V loads), and does a program that walks several KV heads in
one pipelined loop win it back?

    python tools/exp_persistent_decode.py [--batches 256,128] [--contexts 600,1200] [--varied]

The engine's split kernel gives each (request, KV head) its own program, so at 600 tokens a program streams only
~10 tiles of 64 tokens. Here program (b, g) walks KV heads g * HP ... g * HP + HP - 1 of request b as one flat loop
of HP x tiles (the softmax state reset where a head starts, the output stored where it ends), so the loop is
pipelined across head boundaries. HP = 1 is the split kernel with one split; the engine's kernel at its default
split count runs beside it. Uniform lengths in the engine's slot layout, or (``--varied``) the nano-vllm
protocol's mixed lengths. Not used by the engine.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout.kernels.decode_attention import decode_attention, num_kv_splits  # noqa: E402
from tools.exp_decode_order import decode_inputs  # noqa: E402
from tools.timing import graph_ms  # noqa: E402


@triton.jit
def _heads_loop_kernel(q, k_buf, v_buf, kv_indptr, kv_indices, out, qk_scale, q_sb, q_sh, k_ss, k_sh, v_ss, v_sh,
                       o_sb, o_sh, HP: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    b = tl.program_id(0)
    h0 = tl.program_id(1) * HP
    start = tl.load(kv_indptr + b)
    length = tl.load(kv_indptr + b + 1) - start
    n_tiles = tl.cdiv(length, BLOCK_N)
    rows = tl.arange(0, BLOCK_H)
    row_ok = rows < GROUP
    d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for t in tl.range(0, HP * n_tiles, num_stages=NUM_STAGES):
        hh = t // n_tiles
        j = t - hh * n_tiles
        h = h0 + hh
        heads = h * GROUP + rows
        qv = tl.load(q + b * q_sb + heads[:, None] * q_sh + d[None, :], mask=row_ok[:, None], other=0.0)
        n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < length
        slot = tl.load(kv_indices + start + n, mask=n_ok, other=0).to(tl.int64)
        kt = tl.load(k_buf + slot[:, None] * k_ss + h * k_sh + d[None, :], mask=n_ok[:, None], other=0.0)
        vt = tl.load(v_buf + slot[:, None] * v_ss + h * v_sh + d[None, :], mask=n_ok[:, None], other=0.0)
        first = j == 0
        m_i = tl.where(first, float("-inf"), m_i)
        l_i = tl.where(first, 0.0, l_i)
        acc = tl.where(first, 0.0, acc)
        s = tl.dot(qv, tl.trans(kt)) * qk_scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        last = row_ok & (rows * 0 + j == n_tiles - 1)  # the head's last tile: its output
        tl.store(out + b * o_sb + heads[:, None] * o_sh + d[None, :], (acc / l_i[:, None]).to(out.dtype.element_ty),
                 mask=last[:, None] & (d[None, :] < HEAD_DIM))


def heads_loop_attention(q, k_buf, v_buf, kv_indptr, kv_indices, scale, out, hp: int, block_n: int = 64,
                         warps: int = 4, stages: int = 3) -> torch.Tensor:
    b, hq, d = q.shape
    hk = k_buf.shape[1]
    group = hq // hk
    _heads_loop_kernel[(b, hk // hp)](q, k_buf, v_buf, kv_indptr, kv_indices, out, scale * 1.4426950408889634,
                                      q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0),
                                      v_buf.stride(1), out.stride(0), out.stride(1), HP=hp, GROUP=group,
                                      HEAD_DIM=d, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
                                      NUM_STAGES=stages, num_warps=warps)
    return out


def case(batch: int, context: int, varied: bool, hq: int = 16, hk: int = 8, d: int = 128) -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    q, k, v, indptr, indices, slots, extra = decode_inputs(batch, context, hq, hk, d, varied)
    counters = torch.zeros(batch * hk, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    gb = 2 * slots * hk * d * 2 / 1e9
    label = f"{batch}x{slots // batch}{extra}"
    splits = num_kv_splits(batch, hk, sms)
    ref = decode_attention(q, k, v, indptr, indices, d ** -0.5, splits, counters=counters).float()
    ms = graph_ms(lambda: decode_attention(q, k, v, indptr, indices, d ** -0.5, splits, out=out, counters=counters))
    print(f"{label} engine split kernel, splits {splits}: {ms:.4f} ms  {gb / ms:.2f} TB/s", flush=True)
    for hp in (1, 2, 4, 8):
        for block_n, warps, stages in ((64, 4, 3), (64, 4, 4), (32, 4, 4), (64, 8, 3)):
            def run(hp=hp, block_n=block_n, warps=warps, stages=stages):
                heads_loop_attention(q, k, v, indptr, indices, d ** -0.5, out, hp, block_n, warps, stages)
            try:
                ms = graph_ms(run)
            except Exception as e:  # noqa: BLE001  (a setting the compiler refuses)
                print(f"{label} HP {hp} n{block_n} w{warps} s{stages}: failed {type(e).__name__}"[:200], flush=True)
                continue
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            print(f"{label} heads loop HP {hp} n{block_n:<3d} w{warps} s{stages}: {ms:.4f} ms  {gb / ms:.2f} TB/s  "
                  f"err {err:.1e}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="256,128")
    p.add_argument("--contexts", default="600,1200")
    p.add_argument("--varied", action="store_true", help="also the nano-vllm protocol's mixed lengths")
    args = p.parse_args()
    for batch in (int(x) for x in args.batches.split(",")):
        for context in (int(x) for x in args.contexts.split(",")):
            case(batch, context, False)
        if args.varied:
            case(batch, 0, True)


if __name__ == "__main__":
    main()
