"""The fused decode projections (``rollout/kernels/decode_gemm.py``) against what they replace, per projection.

    python tools/exp_decode_gemm.py [--shapes qwen3-0.6b,llama-3.1-8b] [--rows 1,16,32,64] [--quick]

For each decoder-layer projection and row count: the layer's kernels as the engine runs them without the fused
path (FlashInfer's add + RMSNorm before QKV and gate_up, cuBLAS's ``F.linear``, FlashInfer's SiLU·mul after
gate_up; the O and down GEMMs alone, their residual add being the next norm's), then ``decode_gemm`` doing the
same work (norm in the prologue, SiLU·mul or the residual add in the epilogue) over a grid of launches. Each
case runs 28 calls with distinct weights (as a model's layers) captured in one CUDA graph; median of 7
replays, per call. The last lines sum each side's best per projection into one layer.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout.kernels import decode_gemm as dg  # noqa: E402
from tools.timing import graph_ms  # noqa: E402

SHAPES = {  # per projection: (name, N out, K, kind); gate_up's N is its SiLU·mul output (half its rows)
    "qwen3-0.6b": [("qkv", 4096, 1024, "norm"), ("o", 1024, 2048, "residual"), ("gate_up", 3072, 1024, "silu"),
                   ("down", 1024, 3072, "residual")],
    "llama-3.1-8b": [("qkv", 6144, 4096, "norm"), ("o", 4096, 4096, "residual"), ("gate_up", 14336, 4096, "silu"),
                     ("down", 4096, 14336, "residual")],
}
LAYERS = 28


def us(fn) -> float:
    return graph_ms(fn, calls=1, warmup=2) * 1e3 / LAYERS


def baseline(kind: str, x, hidden, res, ws, norm_w):
    from flashinfer.activation import silu_and_mul
    from flashinfer.norm import fused_add_rmsnorm

    def run():
        for w in ws:
            if kind in ("norm", "silu"):
                fused_add_rmsnorm(hidden, res, norm_w, 1e-6)
                y = F.linear(hidden, w)
                if kind == "silu":
                    silu_and_mul(y)
            else:
                F.linear(x, w)
    return run


def fused(kind: str, x, res, ss, ws, norm_w, scratch, config):
    def run():
        for w in ws:
            if kind == "residual":
                dg.decode_gemm(x, w, scratch, residual=(res, ss), config=config)
            else:
                dg.decode_gemm(res, w, scratch, norm=(ss, norm_w, 1e-6), silu_mul=kind == "silu", config=config)
    return run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-0.6b")
    p.add_argument("--rows", default="1,16,32,64")
    p.add_argument("--quick", action="store_true", help="a smaller launch grid")
    args = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    grid = ([16, 32, 64, 128], [1, 2, 4, 8], [4, 8], [3, 4], [False, True])  # block_n, split, warps, stages, prefetch
    if args.quick:
        grid = ([32, 64, 128], [1, 2, 4, 8], [4], [4], [True])
    for shapes in args.shapes.split(","):
        for m in [int(r) for r in args.rows.split(",")]:
            total_base = total_best = 0.0
            for name, n, k, kind in SHAPES[shapes]:
                hidden_size = k if kind != "residual" else n
                rows = 2 * n if kind == "silu" else n
                ws = [torch.randn(rows, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(LAYERS)]
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                hidden = torch.randn(m, hidden_size, device=dev, dtype=torch.bfloat16)
                res = torch.randn(m, hidden_size, device=dev, dtype=torch.bfloat16)
                norm_w = torch.ones(hidden_size, device=dev, dtype=torch.bfloat16)
                scratch = dg.DecodeGemmScratch(max(n, hidden_size), dev)
                ss = dg.start_rows(res, scratch)
                base = us(baseline(kind, x, hidden, res, ws, norm_w))
                best = (float("inf"), None)
                for bn, split, warps, stages, prefetch in itertools.product(*grid):
                    if n % bn or k % (dg.BLOCK_K * split) or (n // bn) * split > 1024:
                        continue
                    config = dg.GemmConfig(bn, split, warps, stages, prefetch)
                    try:
                        t = us(fused(kind, x, res, ss, ws, norm_w, scratch, config))
                    except Exception as e:  # noqa: BLE001  (a launch the compiler refuses)
                        print(f"  {config}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
                        continue
                    best = min(best, (t, config), key=lambda b: b[0])
                default = us(fused(kind, x, res, ss, ws, norm_w, scratch, None))
                total_base += base
                total_best += best[0]
                print(f"{shapes:12s} M{m:<3d} {name:8s} N{n:<6d} K{k:<6d} unfused {base:6.2f} us | fused default "
                      f"{default:6.2f} us | best {best[0]:6.2f} us {best[1]}", flush=True)
            print(f"{shapes:12s} M{m:<3d} layer: unfused {total_base:6.2f} us, fused best {total_best:6.2f} us "
                  f"({total_base / total_best:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
