"""Decode-sized GEMMs (y = x @ W.T, M <= 256 rows): cuBLAS (torch's F.linear) against a Triton kernel.

    python tools/exp_small_gemm.py [--shapes qwen3-0.6b|llama-3.1-8b] [--rows 16,64,128,256] [--quick]

At decode batch sizes the projections read their weights once and do little math, so their floor is the
weight bytes at HBM speed. cuBLAS tiles the rows small, so every row tile streams the whole weight through
L2 again; at 256 rows a Qwen3-0.6B layer's four GEMMs take ~30 us on an H100 for 31 MB of weights. The
Triton kernel here swaps the operands (the weight's rows fill the MMA's M side, the tokens its N side, up
to 256), so the weight is read once, and splits K over ``split`` programs per output tile to fill the SMs;
the last program of a tile sums the float32 partials in a fixed order (no second launch, deterministic).

Each case times 28 calls with distinct weights (as a model's layers; weights leave L2 between them)
captured in one CUDA graph, median of 7 replays, and checks the result against F.linear.
"""

from __future__ import annotations

import argparse
import os
import sys
import itertools

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout.kernels.pdl import pdl_enabled  # noqa: E402
from tools.timing import graph_ms  # noqa: E402

SHAPES = {  # (name, N, K) of each decoder-layer projection
    "qwen3-0.6b": [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)],
    "llama-3.1-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
}
LAYERS = 28


@triton.jit
def _swap_ab_gemm(x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                  BN: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                  STAGES: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """Program (n tile, k split, token tile): acc[BN, BT] = W[n tile, k part] @ x[t tile, k part].T; with SPLIT > 1 the
    partial goes to ``ws`` and the tile's last program sums the SPLIT partials in order into ``y``.
    ``PREFETCH`` (with ``USE_PDL``): before waiting for the previous kernel, bulk-prefetch this program's
    weight rows into L2 (they do not depend on it), so the weight read overlaps the kernels before."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_t = tl.program_id(2)
    tile_id = pid_t * tl.num_programs(0) + pid_n
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_t = pid_t * BT + tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    k_part = K // SPLIT
    if USE_PDL:
        if PREFETCH:
            rows = w_ptr + offs_n.to(tl.int64) * stride_wn + pid_s * k_part
            tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                      [rows, tl.full([BN], 2, tl.int32) * k_part], dtype=tl.int32,
                                      is_pure=False, pack=1)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (pid_s * k_part + offs_k)[None, :]
    x_ptrs = x_ptr + offs_t[:, None] * stride_xm + (pid_s * k_part + offs_k)[None, :]
    t_ok = offs_t[:, None] < M
    acc = tl.zeros([BN, BT], tl.float32)
    for _ in tl.range(0, k_part, BK, num_stages=STAGES):
        w = tl.load(w_ptrs)
        x = tl.load(x_ptrs, mask=t_ok, other=0.0)
        if UPCAST:  # Triton's CPU interpreter gets bf16 dots wrong; bf16 products are exact in float32
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BK
        x_ptrs += BK
    y_ptrs = y_ptr + offs_t[None, :] * stride_ym + offs_n[:, None]
    y_ok = offs_t[None, :] < M
    if SPLIT == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_ok)
    else:
        tile = tl.arange(0, BN)[:, None] * BT + tl.arange(0, BT)[None, :]
        part = ws_ptr + (tile_id * SPLIT).to(tl.int64) * (BN * BT)
        tl.store(part + pid_s * (BN * BT) + tile, acc)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:
            total = tl.zeros([BN, BT], tl.float32)
            for s in tl.static_range(SPLIT):
                total += tl.load(part + s * (BN * BT) + tile, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_ok)
            tl.store(cnt_ptr + tile_id, 0)


class SwapAB:
    """One launch setting of the Triton kernel with its scratch (partials and per-tile counts)."""

    def __init__(self, bn: int, bk: int, split: int, stages: int, warps: int, max_n: int, device,
                 pdl: int = 0, max_bt: int = 256) -> None:
        """``pdl``: 0 off, 1 PDL, 2 PDL with the weight prefetch; ``max_bt``: most token rows per program."""
        self.bn, self.bk, self.split, self.stages, self.warps, self.max_bt = bn, bk, split, stages, warps, max_bt
        self.pdl = pdl if pdl_enabled(torch.device(device)) else 0
        self.ws = torch.empty(max_n * split * 256 * 2, dtype=torch.float32, device=device)
        self.cnt = torch.zeros((max_n // bn + 1) * 16, dtype=torch.int32, device=device)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        n = w.shape[0]
        bt = min(self.max_bt, max(16, triton.next_power_of_2(m)))
        _swap_ab_gemm[(n // self.bn, self.split, triton.cdiv(m, bt))](
            x, w, y, self.ws, self.cnt, m, n, k, x.stride(0), w.stride(0), y.stride(0), BN=self.bn, BT=bt,
            BK=self.bk, SPLIT=self.split, STAGES=self.stages, UPCAST=x.device.type != "cuda",
            USE_PDL=self.pdl > 0, PREFETCH=self.pdl == 2, launch_pdl=self.pdl > 0, num_warps=self.warps)
        return y

    def __str__(self) -> str:
        return f"bn{self.bn} bt{self.max_bt} bk{self.bk} split{self.split} s{self.stages} w{self.warps} pdl{self.pdl}"


def graph_us(fn) -> float:
    """Median time of one replay of a graph that runs ``fn`` once, in microseconds."""
    return graph_ms(fn, calls=1, warmup=1) * 1e3


def tunableop(shapes: str, rows: list[int]) -> None:
    """F.linear per shape and row count as cuBLAS picks it, then with PyTorch's TunableOp enabled and tuned on
    that shape (it times the cuBLAS and cuBLASLt candidates and keeps the fastest; tuned eagerly, replayed in
    the graph), same timing as above."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    for name, n, k in SHAPES[shapes]:
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(LAYERS)]
        mb = n * k * 2 / 1e6
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = torch.nn.functional.linear(x, ws[0]).float()
            base = graph_us(lambda: [torch.nn.functional.linear(x, w) for w in ws]) / LAYERS
            torch.cuda.tunable.enable(True)
            torch.cuda.tunable.tuning_enable(True)
            out = torch.nn.functional.linear(x, ws[0]).float()  # tunes this shape
            torch.cuda.tunable.tuning_enable(False)
            tuned = graph_us(lambda: [torch.nn.functional.linear(x, w) for w in ws]) / LAYERS
            torch.cuda.tunable.enable(False)
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            print(f"{name:8s} N{n:<6d} K{k:<6d} M{m:<4d} cublas {base:7.2f} us {mb / base:5.2f} TB/s | tunableop "
                  f"{tuned:7.2f} us {mb / tuned:5.2f} TB/s err {err:.1e}", flush=True)
    results = torch.cuda.tunable.get_results()
    print(f"tunableop picks ({len(results)}):", flush=True)
    for r in results:
        print("  ", r, flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--rows", default="16,64,128,256")
    p.add_argument("--quick", action="store_true", help="fewer Triton settings")
    p.add_argument("--pdl", default="0,1,2", help="PDL modes: 0 off, 1 on, 2 on with the weight prefetch")
    p.add_argument("--max-bt", default="256", help="most token rows per program (token tiles above), comma list")
    p.add_argument("--tunableop", action="store_true",
                   help="time cuBLAS only: its default pick, then the fastest of TunableOp's candidates per shape")
    args = p.parse_args()
    if args.tunableop:
        tunableop(args.shapes, [int(r) for r in args.rows.split(",")])
        return
    dev = torch.device("cuda")
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    grid = ([64, 128], [64, 128], [1, 2, 4], [3, 4], [4, 8])  # block_n, block_k, split, stages, warps
    if args.quick:
        grid = ([64, 128], [64], [1, 2, 4], [4], [4])
    pdl_modes = [int(v) for v in args.pdl.split(",")]
    max_bts = [int(v) for v in args.max_bt.split(",")]
    for name, n, k in SHAPES[args.shapes]:
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(LAYERS)]
        mb = n * k * 2 / 1e6
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ys = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
            ref = torch.nn.functional.linear(x, ws[0])
            us = graph_us(lambda: [torch.nn.functional.linear(x, w) for w in ws]) / LAYERS
            print(f"{name:8s} N{n:<6d} K{k:<6d} M{m:<4d} cublas                        {us:7.2f} us "
                  f"{mb / us:5.2f} TB/s", flush=True)
            best = (float("inf"), "")
            for bn, bk, split, stages, warps, pdl, max_bt in itertools.product(*grid, pdl_modes, max_bts):
                if n % bn or k % (bk * split) or (n // bn) * split > 8 * sms or (max_bt < 256 and m <= max_bt):
                    continue
                gemm = SwapAB(bn, bk, split, stages, warps, n, dev, pdl, max_bt)
                try:
                    out = gemm(x, ws[0], ys[0])
                    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    us = graph_us(lambda: [gemm(x, w, y) for w, y in zip(ws, ys)]) / LAYERS
                except Exception as e:  # noqa: BLE001  (a setting the compiler refuses)
                    print(f"{name:8s} M{m:<4d} {gemm}: failed {type(e).__name__}: {e}"[:200], flush=True)
                    continue
                best = min(best, (us, str(gemm)))
                print(f"{name:8s} N{n:<6d} K{k:<6d} M{m:<4d} triton {str(gemm):22s} {us:7.2f} us "
                      f"{mb / us:5.2f} TB/s err {err:.1e}", flush=True)
            print(f"{name:8s} N{n:<6d} K{k:<6d} M{m:<4d} best triton {best[1]} {best[0]:.2f} us", flush=True)


if __name__ == "__main__":
    main()
