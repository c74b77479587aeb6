"""Online fp8 (W8A8) linear vs bf16 ``F.linear`` on the Llama-3.1-8B projection shapes, on the GPU.

    python tools/bench_fp8_gemm.py [--sweep]

Checks that the Triton per-token quantization is bit-identical to the torch version and that both fp8
products (``torch._scaled_mm`` row-wise, the Triton ``fp8_gemm``) match their float32 reference; then
times, per projection shape and token count, inside CUDA graphs (as decode runs): bf16 ``F.linear``,
``_scaled_mm``, ``fp8_gemm`` with its default launch (``--sweep``: every launch of a small grid) and
the whole ``fp8_linear`` (activation quantization included).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools.timing

from rollout.layers.quantization import (fp8_linear, quantize_fp8_rows, quantize_fp8_tokens,  # noqa: E402
                                         quantize_fp8_tokens_torch, reference_linear)
from rollout.kernels.fp8_gemm import GemmLaunch, default_launch, fp8_gemm  # noqa: E402
from tools.timing import graph_ms  # noqa: E402

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
          "down_proj": (4096, 14336)}
TOKENS = (1, 16, 64, 256, 8192)


def time_ms(fn) -> float:
    """ms per ``fn`` call: a CUDA graph of 20 calls, best of 5 replays."""
    return graph_ms(fn, calls=20, repeats=5, warmup=3, best=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def sweep_launches() -> list[GemmLaunch]:
    """Launches of one 16-row block (``mma.sync``, whose fp8 products accumulate in full float32;
    Hopper's wgmma, which Triton uses from 64 rows, does not)."""
    return [GemmLaunch(16, bn, bk, st, nw) for bn, bk, st, nw in
            itertools.product((16, 32, 64), (128, 256, 512), (3, 4, 5), (2, 4, 8))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="time every launch of a small grid")
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    for t in (1, 256, 8192):
        x = torch.randn(t, 14336, device=dev, dtype=torch.bfloat16) * 2
        q1, s1 = quantize_fp8_tokens(x)
        q2, s2 = quantize_fp8_tokens_torch(x)
        same = torch.equal(s1, s2) and torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))
        print(f"per-token quant T={t}: Triton == torch bit for bit: {same}")
    print(f"{'shape':>13} {'T':>5} {'bf16':>8} {'scaled_mm':>9} {'triton':>8} {'fp8_linear':>10} {'quant':>7} "
          f"{'GB/s trit':>9} {'err mm':>8} {'err trit':>8}  best launch")
    totals: dict[int, list[float]] = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_fp8_rows(w)
        for t in TOKENS:
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            xq, xs = quantize_fp8_tokens(x)
            ref = reference_linear(x, wq, ws)
            mm_out = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.float32)
            bf = time_ms(lambda: F.linear(x, w))
            mm = time_ms(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1),
                                                  out_dtype=torch.bfloat16))
            full = time_ms(lambda: fp8_linear(x, wq, ws))
            qt = time_ms(lambda: quantize_fp8_tokens(x))
            trit, err_t, best = float("nan"), float("nan"), ""
            if t <= 256:
                err_t = rel_err(fp8_gemm(xq, xs, wq, ws, torch.float32), ref)
                trit = time_ms(lambda: fp8_gemm(xq, xs, wq, ws, torch.bfloat16))
                if args.sweep and t == 1:
                    timed = []
                    for launch in sweep_launches():
                        try:
                            timed.append((time_ms(lambda: fp8_gemm(xq, xs, wq, ws, torch.bfloat16, launch)), launch))
                        except Exception as e:  # noqa: BLE001 - a launch that does not fit (shared memory)
                            print(f"  {launch}: {type(e).__name__}")
                    ms, launch = min(timed, key=lambda p: p[0])
                    best = (f"{ms:.4f} ms bn{launch.block_n} bk{launch.block_k} st{launch.num_stages} "
                            f"w{launch.num_warps} (default {default_launch(t, n, k)})")
            gbs = (n * k + t * k) / trit / 1e6 if t <= 256 else float("nan")
            totals.setdefault(t, [0.0, 0.0])
            totals[t][0] += bf
            totals[t][1] += full
            print(f"{name:>13} {t:>5} {bf:8.4f} {mm:9.4f} {trit:8.4f} {full:10.4f} {qt:7.4f} {gbs:9.0f} "
                  f"{rel_err(mm_out, ref):8.1e} {err_t:8.1e}  {best}")
    for t, (bf, fp) in totals.items():
        print(f"one layer's four projections, T={t}: bf16 {bf:.4f} ms, fp8_linear {fp:.4f} ms ({bf / fp:.2f}x)")


if __name__ == "__main__":
    main()
