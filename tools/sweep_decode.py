"""Decode attention speed on the GPU: the Triton kernel's launch settings against FlashInfer.

    python tools/sweep_decode.py [--quick | --grid 'N;W;S'] [--cases fp8,bf16,bf16-d64,bf16-qwen]
                                 [--layouts random,engine] [--context N]

One layer at 256 requests: Llama-3.1-8B heads (32 q / 8 KV, dim 128) x 1,500 cached tokens, bf16 and
float8 (e4m3) pools; Llama-3.2-1B heads (32 / 8, dim 64) x 256 cached tokens (row 4's decode), bf16;
Qwen3-0.6B heads (16 / 8, dim 128) x 600 cached tokens (the nano-vllm protocol's mean at batch 256), bf16. Two slot layouts: ``random`` (every token's slot drawn at random) and
``engine`` (the first two thirds of each request contiguous, as a prefill allocates them; the rest
interleaved across requests, as decode steps allocate them). Times are per call, averaged over 20
back-to-back calls (CUDA events), median of 7. Each Triton setting is checked against FlashInfer.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout.kernels.decode_attention import DecodeLaunch, decode_attention, num_kv_splits  # noqa: E402
from tools.timing import eager_ms  # noqa: E402


def slot_layout(kind: str, batch: int, context: int, device: torch.device) -> torch.Tensor:
    """kv_indices [batch * context] int32 (slots from 1): "random" (a permutation), "contiguous" (each request's
    slots in a row), else the engine's (the first 2/3 a prefill's run, then one slot per request per step)."""
    if kind == "contiguous":
        return torch.arange(1, batch * context + 1, dtype=torch.int32, device=device)
    if kind == "random":
        return (torch.randperm(batch * context, device=device) + 1).to(torch.int32)
    prefill = context * 2 // 3
    rows = torch.arange(batch, device=device)[:, None]
    first = rows * prefill + torch.arange(prefill, device=device)[None, :]
    rest = batch * prefill + torch.arange(context - prefill, device=device)[None, :] * batch + rows
    return (torch.cat([first, rest], 1).reshape(-1) + 1).to(torch.int32)


def sweep(q, k, v, indptr, indices, ref, settings, label: str, gb: float,
          counters: torch.Tensor) -> tuple[float, tuple]:
    """Time the Triton kernel at each (block_n, warps, stages, splits); the best time and setting.
    ``counters``: the in-kernel merge's counts, made once as the engine does (not a buffer per call)."""
    best = (float("inf"), settings[0])
    d = q.shape[-1]
    for block_n, warps, stages, splits in settings:
        launch = DecodeLaunch(block_n, warps, stages)
        try:
            out = decode_attention(q, k, v, indptr, indices, d ** -0.5, splits, launch=launch, counters=counters)
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            ms = eager_ms(lambda: decode_attention(q, k, v, indptr, indices, d ** -0.5, splits, launch=launch,
                                                  counters=counters))
        except Exception as e:  # noqa: BLE001  (a setting the compiler refuses, e.g. out of shared memory)
            print(f"{label} triton {launch}: failed {type(e).__name__}: {e}"[:300], flush=True)
            continue
        print(f"{label} triton n{block_n:<3d} w{warps} s{stages} splits {splits:2d} "
              f"{ms:.3f} ms  {gb / ms:.2f} TB/s  err {err:.1e}", flush=True)
        best = min(best, (ms, (block_n, warps, stages, splits)))
    return best


def run_case(batch: int, context: int, hq: int, hk: int, d: int, kv_dtype: torch.dtype, grid, workspace,
             layouts: tuple[str, ...] = ("random", "engine"), q_dtype: torch.dtype = torch.bfloat16) -> None:
    """FlashInfer, then the Triton settings, on each slot layout: the sweep on the first, then its best
    setting at other split counts on every layout."""
    import flashinfer

    dev = workspace.device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    slots = batch * context
    indptr = torch.arange(0, slots + 1, context, dtype=torch.int32, device=dev)
    last = torch.ones(batch, dtype=torch.int32, device=dev)
    splits = num_kv_splits(batch, hk, sms, kv_dtype.itemsize)
    settings = [(n, w, s, splits) for n, w, s in itertools.product(*grid)]
    q = torch.randn(batch, hq, d, device=dev, dtype=q_dtype)
    k = torch.randn(slots + 1, hk, d, device=dev).to(kv_dtype)
    v = torch.randn(slots + 1, hk, d, device=dev).to(kv_dtype)
    gb = 2 * slots * hk * d * k.element_size() / 1e9
    counters = torch.zeros(batch * hk, dtype=torch.int32, device=dev)
    best = None
    for layout in layouts:
        label = f"{str(kv_dtype).removeprefix('torch.'):13s} q {str(q_dtype).removeprefix('torch.'):8s} d{d} {batch}x{context} {layout:6s}"
        indices = slot_layout(layout, batch, context, dev)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        w.plan(indptr, indices, last, hq, hk, d, 1, q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=d ** -0.5)
        ref = w.run(q, (k.unsqueeze(1), v.unsqueeze(1)))
        ms = eager_ms(lambda: w.run(q, (k.unsqueeze(1), v.unsqueeze(1))))
        print(f"{label} flashinfer                   {ms:.3f} ms  {gb / ms:.2f} TB/s", flush=True)
        if best is None:
            best = sweep(q, k, v, indptr, indices, ref, settings, label, gb, counters)[1]
            print(f"{label} best {best}", flush=True)
        n, wp, st, sp = best
        sweep(q, k, v, indptr, indices, ref,
              [(n, wp, st, s) for s in (1, 2, 4, 8) if layout != layouts[0] or s != sp], label, gb, counters)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="a few settings only")
    p.add_argument("--cases", default="fp8,bf16,bf16-d64",
                   help="comma-separated subset of fp8,bf16,bf16-d64,bf16-qwen")
    p.add_argument("--grid", help="'N;W;S': comma lists of block_n, warps, stages")
    p.add_argument("--fp8-query", default="float16", choices=["float16", "bfloat16"],
                   help="query dtype of the fp8 case (the engine's is the model dtype)")
    p.add_argument("--layouts", default="random,engine", help="slot layouts; the sweep runs on the first")
    p.add_argument("--batch", type=int, default=256, help="requests of the 8B-head and Qwen cases")
    p.add_argument("--context", type=int, default=600, help="cached tokens per request of the Qwen case")
    args = p.parse_args()
    cases = args.cases.split(",")
    layouts = tuple(args.layouts.split(","))
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    grid = ([32, 64], [1, 2], [3, 4]) if args.quick else ([16, 32, 64, 128], [1, 2, 4], [2, 3, 4])
    if args.grid:
        grid = tuple([int(x) for x in part.split(",")] for part in args.grid.split(";"))
    if "fp8" in cases:
        run_case(args.batch, 1500, 32, 8, 128, torch.float8_e4m3fn, grid, workspace, layouts,
                 getattr(torch, args.fp8_query))
    if "bf16" in cases:
        run_case(args.batch, 1500, 32, 8, 128, torch.bfloat16, grid, workspace, layouts)
    if "bf16-d64" in cases:
        run_case(256, 256, 32, 8, 64, torch.bfloat16, grid, workspace, layouts)
    if "bf16-qwen" in cases:
        run_case(args.batch, args.context, 16, 8, 128, torch.bfloat16, grid, workspace, layouts)


if __name__ == "__main__":
    main()
