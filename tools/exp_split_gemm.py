"""Experiment: split-K decode projections whose partial sums the next kernel adds up.

At decode batch sizes the O and down projections of a small model (N = hidden = 1,024) have few output tiles,
so cuBLAS runs them on a fraction of the SMs or adds a split-K reduce kernel. Here the K dimension is cut into
S slices that one strided-batched cuBLAS call computes as S float32 partial products, and the kernel that
follows anyway (the residual add + RMSNorm) sums the slices first, so no kernel is added.

    python tools/exp_split_gemm.py [--rows 16,32,64,128,256] [--splits 2,4,8] [--context 600] [--no-step]

A. Per projection of Qwen3-0.6B (and, with ``--model 8b``, Llama-3.1-8B), a CUDA graph of 28 GEMMs with
   distinct weights (read from HBM as in a decode step), us per GEMM: ``torch.mm`` to bf16 (the engine),
   ``torch.mm`` to float32, and the split ``torch.bmm`` to float32 partials for each S.
B. The Qwen3-0.6B-shaped decode forward of ``tools/exp_tbo.Step`` (28 layers, the engine's Triton decode
   attention over ``--context`` tokens per request) with O and down split into S float32 partials and a Triton
   sum + residual add + RMSNorm in place of FlashInfer's fused add + RMSNorm, ms per forward against the
   unsplit forward. The split product and the add + norm are the engine's (``rollout/layers/split_k.py``,
   ``rollout/kernels/add_rmsnorm.py``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout.kernels.add_rmsnorm import add_rmsnorm_split_k  # noqa: E402
from rollout.kernels.decode_attention import decode_attention  # noqa: E402
from rollout.layers.split_k import split_k_matmul  # noqa: E402
from tools.exp_tbo import HIDDEN, HK, HQ, INTER, LAYERS, D, Step, step_kv, step_weights  # noqa: E402
from tools.timing import graph_ms  # noqa: E402

SHAPES = {"0.6b": {"qkv": ((HQ + 2 * HK) * D, HIDDEN), "o": (HIDDEN, HQ * D), "gate_up": (2 * INTER, HIDDEN),
                   "down": (HIDDEN, INTER)},
          "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}}


def split_mm(x: torch.Tensor, w: torch.Tensor, s: int) -> torch.Tensor:
    """S float32 partial products of ``x @ w.T`` [S, M, N]: the engine's ``split_k_matmul``."""
    return split_k_matmul(x, w, s).partials


def sum_add_rmsnorm(part: torch.Tensor, res: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The engine's add + RMSNorm of the partials' sum (``add_rmsnorm_split_k``)."""
    return add_rmsnorm_split_k(part, res, weight, 1e-6)


def per_gemm(model: str, rows: list[int], splits: list[int]) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    for name, (n, k) in SHAPES[model].items():
        ws = [torch.randn(n, k, device=dev, dtype=dt) for _ in range(LAYERS)]
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=dt)
            y = torch.empty(m, n, device=dev, dtype=dt)
            y32 = torch.empty(m, n, device=dev, dtype=torch.float32)
            cols = [f"mm {graph_ms(lambda: [torch.mm(x, w.t(), out=y) for w in ws], calls=1) * 1e3 / LAYERS:5.2f}"]
            cols.append("mm->f32 %5.2f" % (graph_ms(lambda: [torch.mm(x, w.t(), out_dtype=torch.float32, out=y32)
                                                             for w in ws], calls=1) * 1e3 / LAYERS))
            for s in splits:
                t = graph_ms(lambda: [split_mm(x, w, s) for w in ws], calls=1) * 1e3 / LAYERS
                cols.append(f"S{s} {t:5.2f}")
            print(f"A {model} {name:8s} N{n:<6d} K{k:<6d} M{m:<4d} us/GEMM: " + "  ".join(cols), flush=True)


class SplitStep(Step):
    """``Step`` with O and down as S float32 partials, summed by the add + RMSNorm that follows."""

    def __init__(self, s: int, *args) -> None:
        super().__init__(*args)
        self.s = s

    def __call__(self) -> None:
        import flashinfer

        part = None
        for w_qkv, w_o, w_gu, w_down, n1, n2 in self.w:
            if part is None:
                flashinfer.norm.fused_add_rmsnorm(self.x, self.res, n1, 1e-6)
                x = self.x
            else:
                x = sum_add_rmsnorm(part, self.res, n1)
            q = F.linear(x, w_qkv)[:, :HQ * D].view(-1, HQ, D)
            decode_attention(q, self.kv[0], self.kv[1], self.indptr, self.indices, D ** -0.5, self.splits,
                             out=self.out, counters=self.counters)
            h = sum_add_rmsnorm(split_mm(self.out.view(-1, HQ * D), w_o, self.s), self.res, n2)
            part = split_mm(flashinfer.activation.silu_and_mul(F.linear(h, w_gu)), w_down, self.s)


def whole_step(rows: list[int], splits: list[int], context: int) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    torch.manual_seed(0)
    weights = step_weights(dev, dt)
    for batch in rows:
        kv, indptr, indices = step_kv(batch, context, dev, dt)
        base = Step(weights, kv, indptr, indices, 0, batch, sms)
        cols = [f"base {graph_ms(base, calls=1, repeats=15):.3f}"]
        for s in splits:
            step = SplitStep(s, weights, kv, indptr, indices, 0, batch, sms)
            cols.append(f"S{s} {graph_ms(step, calls=1, repeats=15):.3f}")
        cols.append(f"base again {graph_ms(base, calls=1, repeats=15):.3f}")
        print(f"B batch {batch:<4d} x {context} tokens, ms per forward: " + "  ".join(cols), flush=True)
        del kv, base
        torch.cuda.empty_cache()


def check(splits: list[int]) -> None:
    """The split product and the fused sum + add + norm against torch (float32 product, HF's norm)."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(64, 3072, device=dev, dtype=dt)
    w = torch.randn(1024, 3072, device=dev, dtype=dt) * 0.02
    ref = x.float() @ w.float().t()
    for s in splits:
        part = split_mm(x, w, s)
        res = torch.randn(64, 1024, device=dev, dtype=dt)
        nw = torch.rand(1024, device=dev, dtype=dt)
        h = (res.float() + ref.to(dt).float()).to(dt)
        want = ((h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt).float()
                * nw.float()).to(dt)
        got = sum_add_rmsnorm(part, res, nw)
        print(f"check S{s}: partial sum vs float32 max abs {(part.sum(0) - ref).abs().max().item():.2e}; "
              f"norm out vs torch max abs {(got.float() - want.float()).abs().max().item():.2e}; "
              f"residual max abs {(res.float() - h.float()).abs().max().item():.2e}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="16,32,64,128,256")
    p.add_argument("--splits", default="2,4,8")
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--model", default="0.6b", help="A's shapes: 0.6b, 8b or 0.6b,8b")
    p.add_argument("--no-gemm", action="store_true", help="skip A")
    p.add_argument("--no-step", action="store_true", help="skip B")
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    splits = [int(s) for s in args.splits.split(",")]
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    check(splits)
    if not args.no_gemm:
        for model in args.model.split(","):
            per_gemm(model, rows, splits)
    if not args.no_step:
        whole_step(rows, splits, args.context)


if __name__ == "__main__":
    main()
