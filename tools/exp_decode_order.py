"""Experiment: how close the Triton decode attention gets to the GPU's read bandwidth, and whether launching a
request's KV heads next to each other (``DecodeLaunch.heads_first``) reads the pool faster than launching the
requests of one KV head next to each other (the default order).

    python tools/exp_decode_order.py [--cases qwen,varied,straggler,llama8b,llama8b-varied] [--batches 64,128,256]

Read ceiling: a streaming Triton load-and-sum over 4 GiB and ``torch.Tensor.sum``, against a device copy
(read + write). Decode: one layer, the engine's slot layout (``tools/sweep_decode.slot_layout``), splits merged
inside the kernel (as the engine runs it), each setting as a CUDA graph of 20 calls; checked against the default.
The load-balanced kernel (``rollout.kernels.balanced_decode``) runs with each requests-first setting, its
plan made once beforehand.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout.kernels.balanced_decode import (DecodePieces, balanced_decode_attention, balanced_programs,  # noqa: E402
                                             plan_pieces)
from rollout.kernels.decode_attention import DecodeLaunch, decode_attention, default_launch, num_kv_splits  # noqa: E402
from tools.sweep_decode import slot_layout  # noqa: E402
from tools.timing import graph_ms  # noqa: E402


@triton.jit
def _read_sum(x, out, n, BLOCK: tl.constexpr):
    """Grid-stride load of ``x`` [n] in BLOCK tiles; each program's float32 sum to ``out``."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in tl.range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        acc += tl.load(x + start + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out + pid, tl.sum(acc, 0))


def read_ceiling(nbytes: int = 4 << 30) -> None:
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy (read + write) {2 * nbytes / graph_ms(lambda: y.copy_(x), calls=5) / 1e9:.2f} TB/s", flush=True)
    print(f"torch sum (read)    {nbytes / graph_ms(lambda: x.sum(), calls=5) / 1e9:.2f} TB/s", flush=True)
    for per_sm, block, warps in ((4, 4096, 8), (8, 4096, 8), (16, 2048, 4), (32, 2048, 4)):
        out = torch.empty(per_sm * sms, dtype=torch.float32, device="cuda")
        ms = graph_ms(lambda: _read_sum[(per_sm * sms,)](x, out, x.numel(), BLOCK=block, num_warps=warps), calls=5)
        print(f"triton read {per_sm:2d}/SM block {block} warps {warps}  {nbytes / ms / 1e9:.2f} TB/s", flush=True)


def varied_lengths(batch: int, seed: int = 0) -> torch.Tensor:
    """Context lengths of a running batch under the nano-vllm protocol: a prompt of 100-1,024 tokens plus a
    uniform share of an output of 100-1,024 (mean ~610)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(100, 1025, (batch,), generator=g)
    out = torch.randint(100, 1025, (batch,), generator=g)
    return prompt + (torch.rand(batch, generator=g) * out).long() + 1


def decode_inputs(batch: int, context: int, hq: int, hk: int, d: int, varied: bool = False, long_tail: int = 0,
                  order: str = "none", layout: str = "engine"):
    """One decode layer's random bf16 inputs on the GPU: ``(q, k, v, indptr, indices, slots, label)``, the label
    the case's suffix (" straggler N", " varied"). ``varied``: per-request lengths from ``varied_lengths`` (each
    request's slots contiguous); ``long_tail`` > 0: the first request that long instead (a GRPO straggler);
    else ``context`` tokens each in ``layout`` (``tools.sweep_decode.slot_layout``; "engine" by default).
    ``order`` (varied only): "desc" / "asc" puts the requests in the batch longest / shortest first, i.e. launches
    their programs in that order."""
    dev = torch.device("cuda")
    label = ""
    if varied:
        lens = varied_lengths(batch)
        if long_tail:
            lens[0] = long_tail
            label = f" straggler {long_tail}"
        if order != "none":
            lens = lens.sort(descending=order == "desc").values
            label += f" {order}"
        indptr = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32).to(dev)
        slots = int(lens.sum())
        indices = torch.arange(1, slots + 1, dtype=torch.int32, device=dev)
        label += " varied"
    else:
        slots = batch * context
        indptr = torch.arange(0, slots + 1, context, dtype=torch.int32, device=dev)
        indices = slot_layout(layout, batch, context, dev)
        label = "" if layout == "engine" else f" {layout}"
    q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(slots + 1, hk, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(slots + 1, hk, d, device=dev, dtype=torch.bfloat16)
    return q, k, v, indptr, indices, slots, label


def decode_case(label: str, batch: int, context: int, hq: int, hk: int, d: int, launches: list[DecodeLaunch],
                varied: bool = False, balanced: tuple[float, ...] = (), min_chunks: tuple[int, ...] = (256,),
                long_tail: int = 0, order: str = "none", layout: str = "engine") -> None:
    """``decode_inputs``' case (``varied``, ``long_tail``) under each launch, split count and balanced setting."""
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    q, k, v, indptr, indices, slots, extra = decode_inputs(batch, context, hq, hk, d, varied, long_tail, order, layout)
    label += extra
    context = slots // batch
    counters = torch.zeros(batch * hk, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    gb = 2 * slots * hk * d * 2 / 1e9
    splits = num_kv_splits(batch, hk, sms)
    ref = decode_attention(q, k, v, indptr, indices, d ** -0.5, splits, counters=counters).float()
    for launch in launches:
        for sp in sorted({splits, max(1, splits // 2), splits * 2}):
            def run(launch=launch, sp=sp):
                decode_attention(q, k, v, indptr, indices, d ** -0.5, sp, out=out, launch=launch, counters=counters)
            try:
                ms = graph_ms(run)
            except Exception as e:  # noqa: BLE001  (a setting the compiler refuses)
                print(f"{label} {launch}: failed {type(e).__name__}"[:200], flush=True)
                continue
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            tag = " (default)" if launch == default_launch(k.dtype) and sp == splits else ""
            print(f"{label} {batch}x{context} n{launch.block_n:<3d} w{launch.num_warps} s{launch.num_stages} "
                  f"{'heads-first' if launch.heads_first else 'batch-first'} splits {sp:2d}  {ms:.4f} ms  "
                  f"{gb / ms:.2f} TB/s  err {err:.1e}{tag}", flush=True)
        for scale, min_chunk in itertools.product(() if launch.heads_first else balanced, min_chunks):
            programs = max(1, int(scale * balanced_programs(hk, sms)))
            pieces = DecodePieces.new(batch, programs, dev)
            plan_pieces(indptr, batch, pieces, min_chunk)  # once per step in the engine, not per layer

            def run(launch=launch, pieces=pieces):
                balanced_decode_attention(q, k, v, indptr, indices, d ** -0.5, pieces, counters, out=out,
                                          launch=launch)
            ms = graph_ms(run)
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            print(f"{label} {batch}x{context} n{launch.block_n:<3d} w{launch.num_warps} s{launch.num_stages} "
                  f"balanced x{scale:g} ({programs} pieces/head beyond one a request, min {min_chunk}, "
                  f"{int(pieces.first[batch])} pieces)  {ms:.4f} ms  {gb / ms:.2f} TB/s  err {err:.1e}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="qwen,varied,llama8b")
    p.add_argument("--batches", default="64,128,256")
    p.add_argument("--grid", default="64,2,4;32,2,4;64,4,3;128,4,2",
                   help="'n,w,s;...' launch settings, each tried in both orders")
    p.add_argument("--balanced", default="1",
                   help="scales of balanced_programs for the load-balanced kernel (comma list; empty: none)")
    p.add_argument("--min-chunks", default="256", help="the balanced kernel's least tokens per range (a list)")
    p.add_argument("--orders", default="none", help="the varied cases' request orders, a list of none (as "
                   "generated), desc (longest first), asc (shortest first)")
    p.add_argument("--layouts", default="engine", help="the qwen case's slot layouts (engine, contiguous, random)")
    p.add_argument("--no-ceiling", action="store_true", help="skip the read-bandwidth probes")
    p.add_argument("--context", type=int, default=600, help="the qwen case's tokens per request (e.g. 4000: a "
                   "GRPO rollout's tail, few long requests)")
    args = p.parse_args()
    print(torch.cuda.get_device_name(0), torch.__version__, triton.__version__, flush=True)
    if not args.no_ceiling:
        read_ceiling()
    launches = []
    for part in args.grid.split(";"):
        n, w, s = (int(x) for x in part.split(","))
        launches += [DecodeLaunch(n, w, s, False), DecodeLaunch(n, w, s, True)]
    cases = set(args.cases.split(","))
    kw = {"balanced": tuple(float(x) for x in args.balanced.split(",") if x),
          "min_chunks": tuple(int(x) for x in args.min_chunks.split(","))}
    for batch in (int(b) for b in args.batches.split(",")):
        for layout in args.layouts.split(",") if "qwen" in cases else ():
            decode_case("qwen3-0.6b", batch, args.context, 16, 8, 128, launches, layout=layout, **kw)
        for order in args.orders.split(",") if "varied" in cases else ():
            decode_case("qwen3-0.6b", batch, 0, 16, 8, 128, launches, varied=True, order=order, **kw)
        if "straggler" in cases:
            decode_case("qwen3-0.6b", batch, 0, 16, 8, 128, launches, varied=True, long_tail=16384, **kw)
        if "llama8b-varied" in cases:
            decode_case("llama-8b", batch, 0, 32, 8, 128, launches, varied=True, **kw)
    if "llama8b" in cases:
        decode_case("llama-8b", 256, 1500, 32, 8, 128, launches, **kw)


if __name__ == "__main__":
    main()
