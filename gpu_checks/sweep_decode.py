"""Decode attention speed on the GPU: the Triton kernel's launch settings against FlashInfer.

    python gpu_checks/sweep_decode.py [--batch 256] [--context 1500] [--quick]

One layer of Llama-3.1-8B heads (32 q / 8 KV, dim 128) at ``batch`` requests x ``context`` cached tokens,
bf16 and float8 (e4m3) pools. Two slot layouts: ``random`` (every token's slot drawn at random) and
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

from rollout.attention.triton_decode import DecodeLaunch, decode_attention, heads_per_program, num_kv_splits  # noqa: E402


def time_ms(fn, calls: int = 20, repeats: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return sorted(times)[len(times) // 2]


def slot_layout(kind: str, batch: int, context: int, device: torch.device) -> torch.Tensor:
    """kv_indices [batch * context] int32 (slots from 1)."""
    if kind == "random":
        return (torch.randperm(batch * context, device=device) + 1).to(torch.int32)
    prefill = context * 2 // 3
    rows = torch.arange(batch, device=device)[:, None]
    first = rows * prefill + torch.arange(prefill, device=device)[None, :]
    rest = batch * prefill + torch.arange(context - prefill, device=device)[None, :] * batch + rows
    return (torch.cat([first, rest], 1).reshape(-1) + 1).to(torch.int32)


def sweep(q, k, v, indptr, indices, ref, settings, label: str, gb: float) -> tuple[float, tuple]:
    """Time the Triton kernel at each (heads, block_n, warps, stages, splits); the best time and setting."""
    best = (float("inf"), settings[0])
    d = q.shape[-1]
    for heads, block_n, warps, stages, splits in settings:
        launch = DecodeLaunch(heads, block_n, warps, stages)
        try:
            out = decode_attention(q, k, v, indptr, indices, d ** -0.5, splits, launch=launch)
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            ms = time_ms(lambda: decode_attention(q, k, v, indptr, indices, d ** -0.5, splits, launch=launch))
        except Exception as e:  # noqa: BLE001  (a setting the compiler refuses, e.g. out of shared memory)
            print(f"{label} triton {launch}: failed {type(e).__name__}: {e}"[:300], flush=True)
            continue
        print(f"{label} triton h{heads} n{block_n:<3d} w{warps} s{stages} splits {splits:2d} "
              f"{ms:.3f} ms  {gb / ms:.2f} TB/s  err {err:.1e}", flush=True)
        best = min(best, (ms, (heads, block_n, warps, stages, splits)))
    return best


def main() -> None:
    import flashinfer

    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1500)
    p.add_argument("--quick", action="store_true", help="a few settings only")
    args = p.parse_args()
    dev = torch.device("cuda")
    batch, context, hq, hk, d = args.batch, args.context, 32, 8, 128
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    slots = batch * context
    indptr = torch.arange(0, slots + 1, context, dtype=torch.int32, device=dev)
    last = torch.ones(batch, dtype=torch.int32, device=dev)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    grid = ([1, 8], [32], [4], [3]) if args.quick else ([1, 2, 8], [16, 32, 64], [4, 8], [2, 4])
    settings = [(h, n, w, s, num_kv_splits(batch, hk // heads_per_program(hk, h), sms))
                for h, n, w, s in itertools.product(*grid)]
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        q_dtype = torch.float16 if kv_dtype.itemsize == 1 else torch.bfloat16
        q = torch.randn(batch, hq, d, device=dev, dtype=q_dtype)
        k = torch.randn(slots + 1, hk, d, device=dev).to(kv_dtype)
        v = torch.randn(slots + 1, hk, d, device=dev).to(kv_dtype)
        gb = 2 * slots * hk * d * k.element_size() / 1e9
        best = None
        for layout in ("random", "engine"):
            label = f"{str(kv_dtype).removeprefix('torch.'):13s} {layout:6s}"
            indices = slot_layout(layout, batch, context, dev)
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
            w.plan(indptr, indices, last, hq, hk, d, 1, q_data_type=q_dtype, kv_data_type=kv_dtype,
                   sm_scale=d ** -0.5)
            ref = w.run(q, (k.unsqueeze(1), v.unsqueeze(1)))
            ms = time_ms(lambda: w.run(q, (k.unsqueeze(1), v.unsqueeze(1))))
            print(f"{label} flashinfer                          {ms:.3f} ms  {gb / ms:.2f} TB/s", flush=True)
            if best is None:
                best = sweep(q, k, v, indptr, indices, ref, settings, label, gb)[1]
                print(f"{label} best {best}", flush=True)
                h, n, wp, st, _ = best
                more = [(h, n, wp, st, s) for s in (1, 2, 4, 8) if s != best[4]]
                sweep(q, k, v, indptr, indices, ref, more, label, gb)  # the same setting, other splits
            else:
                sweep(q, k, v, indptr, indices, ref, [best], label, gb)
        del q, k, v


if __name__ == "__main__":
    main()
