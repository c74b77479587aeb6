"""Experiment: would the decode step's GEMMs run faster from L2, with their weights prefetched there on a side
stream while the (bandwidth-bound) attention runs?

    python tools/exp_l2_prefetch.py [--batch 32,256] [--context 600]

A. Per projection shape of Qwen3-0.6B, a CUDA graph of 28 GEMMs: distinct weights (read from HBM, as in a
   decode step) against one weight 28 times (hot in L2). The gap bounds what a prefetch could give.
B. A Qwen3-0.6B-shaped decode forward (``tools/exp_tbo.Step``: 28 layers of add+RMSNorm, QKV, the engine's
   Triton decode attention, O, add+RMSNorm, gate_up, SiLU*mul, down), every layer's four weights in one
   buffer, layers in order. With ``prefetch``: after a layer's QKV GEMM, a side stream bulk-prefetches into L2
   the bytes from that layer's O weight to the end of the next layer's QKV weight (``cp.async.bulk.prefetch.L2``;
   ``evict_last``: with an L2 evict-last policy), and the main stream waits for it before the O GEMM.
   (Triton 3.6 has no L2 evict-first hint for the attention's K/V loads: ``.cs`` is for stores only.)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout.kernels.decode_attention import decode_attention  # noqa: E402
from tools.exp_tbo import HIDDEN, HK, HQ, INTER, LAYERS, D, Step, step_kv  # noqa: E402
from tools.timing import graph_ms  # noqa: E402

SHAPES = {"qkv": ((HQ + 2 * HK) * D, HIDDEN), "o": (HIDDEN, HQ * D), "gate_up": (2 * INTER, HIDDEN),
          "down": (HIDDEN, INTER)}
_PLAIN = tl.constexpr("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;")
_EVICT_LAST = tl.constexpr("{ .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0;\n\t"
                           "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; }\n\tmov.u32 $0, 0;")


@triton.jit
def _prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, PIECES: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Program p bulk-prefetches bytes [p * CHUNK, (p + 1) * CHUNK) of ``base`` (uint8) in PIECES pieces."""
    piece = CHUNK // PIECES
    offs = tl.program_id(0) * CHUNK + tl.arange(0, PIECES) * piece
    size = tl.maximum(tl.minimum(nbytes - offs, piece), 0)
    ptrs = base + tl.where(size > 0, offs, 0)
    sizes = tl.where(size > 0, size, 16)
    if EVICT_LAST:
        tl.inline_asm_elementwise(_EVICT_LAST, "=r,l,r", [ptrs, sizes], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(_PLAIN, "=r,l,r", [ptrs, sizes], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(buf: torch.Tensor, evict_last: bool, chunk: int = 1 << 18) -> None:
    """Bulk-prefetch the bytes of ``buf`` (contiguous, 16-byte aligned, size a multiple of 16) into L2."""
    flat = buf.view(torch.uint8)
    _prefetch_kernel[(triton.cdiv(flat.numel(), chunk),)](flat, flat.numel(), CHUNK=chunk, PIECES=16,
                                                          EVICT_LAST=evict_last, num_warps=1)


def gemm_from_l2(rows: list[int]) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=dt) for _ in range(LAYERS)]
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=dt)
            y = torch.empty(m, n, device=dev, dtype=dt)
            cold = graph_ms(lambda: [torch.mm(x, w.t(), out=y) for w in ws], calls=1) * 1e3 / LAYERS
            hot = graph_ms(lambda: [torch.mm(x, ws[0].t(), out=y) for _ in ws], calls=1) * 1e3 / LAYERS
            print(f"A {name:8s} N{n} K{k} M{m:<4d} distinct weights {cold:5.2f} us  one weight (L2) {hot:5.2f} us",
                  flush=True)


class PrefetchStep(Step):
    """``Step`` with a layer's O, gate_up and down weights and the next layer's QKV weight prefetched into L2
    beside the attention (``mode`` 0: off, 1: plain, 2: evict_last)."""

    def __init__(self, flat: torch.Tensor, bounds: list[int], mode: int, *args) -> None:
        super().__init__(*args)
        self.flat, self.bounds, self.mode = flat, bounds, mode
        self.side = torch.cuda.Stream()

    def __call__(self) -> None:
        import flashinfer

        main = torch.cuda.current_stream()
        x = self.x
        for i, (w_qkv, w_o, w_gu, w_down, n1, n2) in enumerate(self.w):
            flashinfer.norm.fused_add_rmsnorm(x, self.res, n1, 1e-6)
            q = F.linear(x, w_qkv)[:, :HQ * D].view(-1, HQ, D)
            if self.mode:
                self.side.wait_stream(main)
                with torch.cuda.stream(self.side):
                    prefetch_l2(self.flat[self.bounds[i]:self.bounds[i + 1]], self.mode == 2)
            decode_attention(q, self.kv[0], self.kv[1], self.indptr, self.indices, D ** -0.5, self.splits,
                             out=self.out, counters=self.counters)
            if self.mode:
                main.wait_stream(self.side)
            o = F.linear(self.out.view(-1, HQ * D), w_o)
            flashinfer.norm.fused_add_rmsnorm(o, self.res, n2, 1e-6)
            x = F.linear(flashinfer.activation.silu_and_mul(F.linear(o, w_gu)), w_down)


def layer_weights(dev: torch.device, dt: torch.dtype) -> tuple[torch.Tensor, list[tuple], list[int]]:
    """All layers' weights in one buffer (qkv, o, gate_up, down per layer), the per-layer views, and the
    prefetch bounds: layer i's range runs from its O weight to the end of layer i + 1's QKV weight."""
    sizes = [n * k for n, k in SHAPES.values()]
    per_layer = sum(sizes)
    flat = torch.randn(LAYERS * per_layer + sizes[0], device=dev, dtype=dt) * 0.02
    weights, bounds = [], []
    for i in range(LAYERS):
        base = i * per_layer
        views, off = [], base
        for (n, k), size in zip(SHAPES.values(), sizes):
            views.append(flat[off:off + size].view(n, k))
            off += size
        norm = torch.ones(HIDDEN, device=dev, dtype=dt)
        weights.append((*views, norm, norm))
        bounds.append(base + sizes[0])
    bounds.append(LAYERS * per_layer + sizes[0])
    return flat, weights, bounds


def forward_with_prefetch(batches: list[int], context: int) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    torch.manual_seed(0)
    flat, weights, bounds = layer_weights(dev, dt)
    for batch in batches:
        kv, indptr, indices = step_kv(batch, context, dev, dt)
        for mode in (0, 1, 2, 0):
            step = PrefetchStep(flat, bounds, mode, weights, kv, indptr, indices, 0, batch, sms)
            ms = graph_ms(step, calls=1, repeats=11)
            print(f"B batch {batch} x {context}: prefetch {('off', 'plain', 'evict_last')[mode]:10s} "
                  f"{ms:.3f} ms per forward", flush=True)
        del kv
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", default="32,256")
    p.add_argument("--context", type=int, default=600)
    args = p.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    print(torch.cuda.get_device_name(0), torch.__version__, triton.__version__, flush=True)
    gemm_from_l2(batches)
    forward_with_prefetch(batches, args.context)


if __name__ == "__main__":
    main()
