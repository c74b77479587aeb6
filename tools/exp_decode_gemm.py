"""Fused decode projections for small batches, against what they replace; an experiment the engine did not keep.

    python tools/exp_decode_gemm.py [--shapes qwen3-0.6b,llama-3.1-8b] [--rows 1,16,32,64] [--quick] [--chain 600]

At small decode batches a dense layer is ~10 kernels (add + RMSNorm, QKV, rope, attention, O, add + RMSNorm,
gate_up, SiLU·mul, down, cuBLAS's split-K reductions), each costing a few microseconds whatever its bytes. The
Triton kernel here (``decode_gemm``) computes ``y = x @ W.T`` for at most 64 rows with the weight's rows on the
MMA's M side (read once), K split over programs whose last one per tile sums the partials in a fixed order,
PDL with the weight rows prefetched into L2 before the wait, and, by flag: the input RMS-normalized on the fly
(Hugging Face's arithmetic, from per-row sums of squares the kernel before left), SiLU·mul of the gate and up
halves in the epilogue, or the output added into the residual stream in place (with the new rows' sums of
squares for the next norm). A dense layer becomes 6 kernels.

For each projection and row count this times the layer's kernels as the engine runs them (FlashInfer's add +
RMSNorm before QKV and gate_up, cuBLAS's ``F.linear``, FlashInfer's SiLU·mul after gate_up; O and down alone)
against ``decode_gemm`` doing the same work over a grid of launches: 28 calls with distinct weights captured
in one CUDA graph, median of 7 replays, per call. Caveat: consecutive calls of one kernel overlap through PDL
(the next one prefetches its weights while the previous computes), which flatters the Triton kernel: ``--chain``
times whole layers in order instead, with a memory-bound stand-in for the attention (one H100: 1.31x per
projection at 16 rows, 1.09x as layers). Wired
into the engine (commit e8d9349, ``decode_gemm_max_bs``), the whole decode step was not faster on an H100 at
any batch size (docs/rl_rollouts.md), so the engine keeps cuBLAS and FlashInfer.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout.kernels.pdl import pdl_launch, pdl_prologue  # noqa: E402
from tools.timing import graph_ms  # noqa: E402

MAX_ROWS = 64          # tokens one launch takes (a single token tile)
BLOCK_N = 64           # weight rows (outputs) per program; also the column width of one sum-of-squares part
BLOCK_K = 64
MAX_SPLIT = 8
MIN_BLOCK_N = 16
_STAGES = 4
_WARPS = 4


@dataclass
class SumSq:
    """Per-row sums of squares of the residual stream, as partial sums over column blocks ([rows, parts]
    float32, one per output tile of the kernel that wrote them), summed in order by the reader."""

    parts: torch.Tensor


class DecodeGemmScratch:
    """The split-K partials and per-tile counters one model's ``decode_gemm`` calls share (they run one after
    another on one stream). ``max_width``: the widest projection output (N; gate_up's N is its half)."""

    def __init__(self, max_width: int, device: torch.device) -> None:
        self.max_width = max_width
        # two partials (gate and up) per split per output element
        self.partials = torch.empty(max_width * MAX_SPLIT * 2 * MAX_ROWS, dtype=torch.float32, device=device)
        self.counters = torch.zeros(-(-max_width // MIN_BLOCK_N), dtype=torch.int32, device=device)


@dataclass(frozen=True)
class GemmConfig:
    """One launch setting: weight rows per program, K split, warps, pipeline stages, and whether a program
    prefetches its weight rows into L2 before waiting for the kernel before it (PDL only)."""

    block_n: int = BLOCK_N
    split: int = 1
    warps: int = _WARPS
    stages: int = _STAGES
    prefetch: bool = True


def _token_tile(m: int) -> int:
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"decode_gemm takes 1..{MAX_ROWS} rows, got {m}")
    return max(16, triton.next_power_of_2(m))


def choose_split(tiles: int, k: int, rows: int, num_sms: int, silu_mul: bool = False) -> int:
    """K split per output tile: the largest power of two <= MAX_SPLIT that keeps the programs' weight tiles
    within two per SM and each program at least 256 of K; halved for 64-row tiles (their partials are 4x
    larger). One H100 at Qwen3-0.6B's projections (``tools/exp_decode_gemm.py``) was fastest at or next to it."""
    weight_tiles = tiles * (2 if silu_mul else 1)
    split = 1
    while (split * 2 <= MAX_SPLIT and weight_tiles * split * 2 <= 2 * num_sms and k % (BLOCK_K * split * 2) == 0
           and k // (split * 2) >= 256):
        split *= 2
    return max(1, split // 2) if _token_tile(rows) >= 64 else split


@triton.jit
def _row_sumsq_kernel(x_ptr, ss_ptr, cnt_ptr, M, stride_xm, n_counters, H: tl.constexpr, PARTS: tl.constexpr,
                      BT: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
    """Program j: the column block j's sums of squares of every row; program 0 also zeroes the counters."""
    pdl_prologue(USE_PDL)
    j = tl.program_id(0)
    rows = tl.arange(0, BT)
    cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=(rows[:, None] < M) & (cols[None, :] < H),
                other=0.0).to(tl.float32)
    tl.store(ss_ptr + rows * PARTS + j, tl.sum(x * x, 1), mask=rows < M)
    if j == 0:
        for i in range(0, n_counters, 1024):
            offs = i + tl.arange(0, 1024)
            tl.store(cnt_ptr + offs, tl.zeros([1024], tl.int32), mask=offs < n_counters)


@triton.jit
def _decode_gemm_kernel(x_ptr, w_ptr, y_ptr, bias_ptr, ss_in_ptr, norm_w_ptr, eps, res_ptr, ss_out_ptr,
                        ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_rm, up_offset, parts_in,
                        PARTS_IN_P2: tl.constexpr, PARTS_OUT: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr,
                        BK: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, NORM: tl.constexpr,
                        SILU_MUL: tl.constexpr, RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                        UPCAST: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """Program (n tile, k split): acc[BN, BT] = W[n tile, k part] @ h[:, k part].T (and the up rows' acc with
    SILU_MUL); the tile's last program (all of them when SPLIT == 1) applies the epilogue and stores."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    k_part = K // SPLIT
    t_ok = offs_t < M
    if USE_PDL and PREFETCH:  # this program's weight rows into L2 while the kernel before still runs
        nbytes = tl.full([BN], k_part * 2, tl.int32)
        rows = w_ptr + offs_n.to(tl.int64) * stride_wn + pid_s * k_part
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                  [rows, nbytes], dtype=tl.int32, is_pure=False, pack=1)
        if SILU_MUL:
            tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                      [rows + up_offset, nbytes], dtype=tl.int32, is_pure=False, pack=1)
    pdl_prologue(USE_PDL)
    if NORM:  # the rows' 1 / RMS from the producer's partial sums, added in their fixed order
        parts = tl.arange(0, PARTS_IN_P2)
        ss = tl.load(ss_in_ptr + offs_t[:, None] * parts_in + parts[None, :],
                     mask=t_ok[:, None] & (parts[None, :] < parts_in), other=0.0)
        inv_rms = tl.rsqrt(tl.sum(ss, 1) / K + eps)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (pid_s * k_part + offs_k)[None, :]
    x_ptrs = x_ptr + offs_t[:, None] * stride_xm + (pid_s * k_part + offs_k)[None, :]
    nw_ptrs = norm_w_ptr + pid_s * k_part + offs_k
    acc = tl.zeros([BN, BT], tl.float32)
    acc_up = tl.zeros([BN, BT], tl.float32)
    for _ in tl.range(0, k_part, BK, num_stages=STAGES):
        x = tl.load(x_ptrs, mask=t_ok[:, None], other=0.0)
        if NORM:
            h = (x.to(tl.float32) * inv_rms[:, None]).to(x.dtype)
            x = (h.to(tl.float32) * tl.load(nw_ptrs).to(tl.float32)[None, :]).to(x.dtype)
            nw_ptrs += BK
        w = tl.load(w_ptrs)
        if UPCAST:  # Triton's CPU interpreter gets bf16 dots wrong; bf16 products are exact in float32
            x = x.to(tl.float32)
            acc = tl.dot(w.to(tl.float32), tl.trans(x), acc)
        else:
            acc = tl.dot(w, tl.trans(x), acc)
        if SILU_MUL:
            w_up = tl.load(w_ptrs + up_offset)
            if UPCAST:
                w_up = w_up.to(tl.float32)
            acc_up = tl.dot(w_up, tl.trans(x), acc_up)
        w_ptrs += BK
        x_ptrs += BK
    last = True
    if SPLIT > 1:  # partials to the scratch; the tile's last program to arrive sums them in split order
        tile = tl.arange(0, BN)[:, None] * BT + tl.arange(0, BT)[None, :]
        part = ws_ptr + (pid_n * SPLIT * 2).to(tl.int64) * (BN * BT)
        tl.store(part + pid_s * (BN * BT) + tile, acc)
        if SILU_MUL:
            tl.store(part + (SPLIT + pid_s) * (BN * BT) + tile, acc_up)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        last = done == SPLIT - 1
        if last:
            acc = tl.zeros([BN, BT], tl.float32)
            acc_up = tl.zeros([BN, BT], tl.float32)
            for s in tl.static_range(SPLIT):
                acc += tl.load(part + s * (BN * BT) + tile, cache_modifier=".cg")
                if SILU_MUL:
                    acc_up += tl.load(part + (SPLIT + s) * (BN * BT) + tile, cache_modifier=".cg")
            tl.store(cnt_ptr + pid_n, 0)
    if last:
        out_ty = x_ptr.dtype.element_ty
        n_ok = offs_n < N
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        y = acc.to(out_ty).to(tl.float32)
        if SILU_MUL:
            up = acc_up.to(out_ty).to(tl.float32)
            y = y / (1.0 + tl.exp(-y)) * up
        ok = n_ok[:, None] & t_ok[None, :]
        if RESIDUAL:  # residual += y, in place (each element read and written by this program only)
            r_ptrs = res_ptr + offs_t[None, :] * stride_rm + offs_n[:, None]
            s = (y.to(out_ty).to(tl.float32) + tl.load(r_ptrs, mask=ok, other=0.0).to(tl.float32)).to(out_ty)
            tl.store(r_ptrs, s, mask=ok)
            s32 = s.to(tl.float32)
            tl.store(ss_out_ptr + offs_t * PARTS_OUT + pid_n, tl.sum(s32 * s32, 0), mask=t_ok)
        else:
            tl.store(y_ptr + offs_t[None, :] * stride_ym + offs_n[:, None], y.to(out_ty), mask=ok)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the CPU interpreter: small, so the tests run the split paths


def start_rows(x: torch.Tensor, scratch: DecodeGemmScratch) -> SumSq:
    """The step's first kernel: ``x`` [M, H]'s (the embeddings') sums of squares, and the counters zeroed."""
    m, h = x.shape
    if h % BLOCK_N:
        raise ValueError(f"hidden size {h} is not a multiple of {BLOCK_N}")
    parts = torch.empty(m, h // BLOCK_N, dtype=torch.float32, device=x.device)
    _row_sumsq_kernel[(h // BLOCK_N,)](x, parts, scratch.counters, m, x.stride(0), scratch.counters.numel(), H=h,
                                      PARTS=h // BLOCK_N, BT=_token_tile(m), BLOCK_N=BLOCK_N,
                                      **pdl_launch(x.device))
    return SumSq(parts)


def decode_gemm(x: torch.Tensor, weight: torch.Tensor, scratch: DecodeGemmScratch, *, bias: torch.Tensor | None = None,
                norm: tuple[SumSq, torch.Tensor, float] | None = None, silu_mul: bool = False,
                residual: tuple[torch.Tensor, SumSq] | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """``x`` [M <= MAX_ROWS, K] (rows contiguous), ``weight`` [N (2N with ``silu_mul``), K] contiguous, both the
    model dtype. Returns y = h @ weight.T (+ bias) [M, N], where h = x, or with ``norm = (sumsq, w, eps)``
    h = RMSNorm(x) with weight ``w`` and the rows' sums of squares ``sumsq`` (of x itself); with ``silu_mul``
    y = silu(gate) * up of the two halves. With ``residual = (r, sumsq_out)`` (N = r's width): r += y in place,
    ``sumsq_out`` gets r's new sums of squares, and r is returned. ``config``: the launch (default: BLOCK_N
    rows per program, the split ``choose_split`` picks)."""
    m, k = x.shape
    n = weight.shape[0] // (2 if silu_mul else 1)
    if config is None:
        config = GemmConfig(split=choose_split(n // BLOCK_N, k, m, _num_sms(x.device), silu_mul))
    bn, split = config.block_n, config.split
    if x.stride(1) != 1 or weight.stride(1) != 1 or n % bn or k % (BLOCK_K * split):
        raise ValueError(f"decode_gemm needs contiguous rows, N a multiple of {bn} and K of {BLOCK_K * split}, "
                         f"got x {tuple(x.shape)} weight {tuple(weight.shape)}")
    if n > scratch.max_width or bn < MIN_BLOCK_N or split > MAX_SPLIT:
        raise ValueError(f"output width {n} over the scratch's {scratch.max_width}, or a launch out of range: {config}")
    tiles = n // bn
    if residual is not None and residual[1].parts.shape[1] != tiles:
        raise ValueError(f"the residual's sums of squares have {residual[1].parts.shape[1]} parts, this launch "
                         f"writes {tiles} (N / block_n)")
    if residual is not None:
        res, ss_out = residual
        y = res
    else:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        res, ss_out = y, None
    ss_in = norm[0].parts if norm is not None else y
    dummy = y
    _decode_gemm_kernel[(tiles, split)](
        x, weight, y, bias if bias is not None else dummy, ss_in, norm[1] if norm is not None else dummy,
        norm[2] if norm is not None else 0.0, res, ss_out.parts if ss_out is not None else dummy,
        scratch.partials, scratch.counters, m, n, k, x.stride(0), weight.stride(0), y.stride(0), res.stride(0),
        n * weight.stride(0), ss_in.shape[1] if norm is not None else 1,
        PARTS_IN_P2=triton.next_power_of_2(ss_in.shape[1]) if norm is not None else 1, PARTS_OUT=tiles, BN=bn,
        BT=_token_tile(m),
        BK=BLOCK_K, SPLIT=split, STAGES=config.stages, NORM=norm is not None, SILU_MUL=silu_mul,
        RESIDUAL=residual is not None, HAS_BIAS=bias is not None, UPCAST=x.device.type != "cuda",
        PREFETCH=config.prefetch, num_warps=config.warps, **pdl_launch(x.device))
    return y


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
                decode_gemm(x, w, scratch, residual=(res, ss), config=config)
            else:
                decode_gemm(res, w, scratch, norm=(ss, norm_w, 1e-6), silu_mul=kind == "silu", config=config)
    return run


def chain(shapes: str, m: int, context: int) -> None:
    """Whole layers in order, 28 of them in one CUDA graph, unfused against fused, with a stand-in for the
    attention between QKV and O (a sum over a KV-sized buffer of ``context`` tokens a row: a memory-bound kernel
    of about the attention's bytes, without PDL); ms per forward, median of 7 replays."""
    from flashinfer.activation import silu_and_mul
    from flashinfer.norm import fused_add_rmsnorm

    dev = torch.device("cuda")
    (_, n_qkv, hidden, _), (_, _, k_o, _), (_, inter, _, _), _ = SHAPES[shapes]

    def w(n, k):
        return torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5
    layers = [(w(n_qkv, hidden), w(hidden, k_o), w(2 * inter, hidden), w(hidden, inter)) for _ in range(LAYERS)]
    norm_w = torch.ones(hidden, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(m * context, n_qkv - k_o, device=dev, dtype=torch.bfloat16)  # one layer's K and V of the rows
    attn_x = torch.randn(m, k_o, device=dev, dtype=torch.bfloat16)
    h = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
    res = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
    scratch = DecodeGemmScratch(max(n_qkv, inter, hidden), dev)
    ss = start_rows(res, scratch)

    def unfused():
        x = h
        for w_qkv, w_o, w_gu, w_d in layers:
            fused_add_rmsnorm(x, res, norm_w, 1e-6)
            F.linear(x, w_qkv)
            kv.sum(0)
            o = F.linear(attn_x, w_o)
            fused_add_rmsnorm(o, res, norm_w, 1e-6)
            x = F.linear(silu_and_mul(F.linear(o, w_gu)), w_d)

    def fused_layers():
        for w_qkv, w_o, w_gu, w_d in layers:
            decode_gemm(res, w_qkv, scratch, norm=(ss, norm_w, 1e-6))
            kv.sum(0)
            decode_gemm(attn_x, w_o, scratch, residual=(res, ss))
            act = decode_gemm(res, w_gu, scratch, norm=(ss, norm_w, 1e-6), silu_mul=True)
            decode_gemm(act, w_d, scratch, residual=(res, ss))
    base, ours = graph_ms(unfused, calls=1), graph_ms(fused_layers, calls=1)
    print(f"{shapes:12s} M{m:<3d} chain of {LAYERS} layers (attention stand-in, {context} tokens a row): unfused "
          f"{base:.3f} ms, fused {ours:.3f} ms ({base / ours:.2f}x)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-0.6b")
    p.add_argument("--rows", default="1,16,32,64")
    p.add_argument("--quick", action="store_true", help="a smaller launch grid")
    p.add_argument("--chain", type=int, default=None, metavar="CONTEXT",
                   help="time whole layers in order instead (default launches), with an attention stand-in over "
                        "CONTEXT tokens a row")
    args = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    if args.chain is not None:
        for shapes in args.shapes.split(","):
            for m in [int(r) for r in args.rows.split(",")]:
                chain(shapes, m, args.chain)
        return
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
                scratch = DecodeGemmScratch(max(n, hidden_size), dev)
                ss = start_rows(res, scratch)
                base = us(baseline(kind, x, hidden, res, ws, norm_w))
                best = (float("inf"), None)
                for bn, split, warps, stages, prefetch in itertools.product(*grid):
                    if n % bn or k % (BLOCK_K * split) or (n // bn) * split > 1024:
                        continue
                    config = GemmConfig(bn, split, warps, stages, prefetch)
                    ss_out = SumSq(torch.zeros(m, n // bn, device=dev)) if kind == "residual" else ss
                    try:
                        t = us(fused(kind, x, res, ss_out, ws, norm_w, scratch, config))
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
