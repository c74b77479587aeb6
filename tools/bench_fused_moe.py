"""The Triton ``fused_moe`` on Qwen3-30B-A3B's routed experts (E=128, top-8, H=2048, I=768, bf16), on the GPU.

    python tools/bench_fused_moe.py [--sweep] [--breakdown] [--eager] [--tokens 1,8,64]

Checks the result against a float32 per-expert torch loop at T=64 (max abs difference, bf16 noise expected),
then times ``fused_moe`` per token count T with random router-like routing (top-8 distinct experts per token,
uniform): per call, the median of 20 replays of a CUDA graph of 8 calls, each on its own routing (``--eager``:
plain launches). Prints the distinct experts touched, the expert weight bytes they hold (each read at least
once), the implied GB/s and the time over the floor ``bytes / 4.0e12`` (about an H200's HBM read rate).
``--sweep`` times GEMM1 and GEMM2 alone with a handful of tile launches per T and prints the best next to the
default;
``--breakdown`` times the steps alone (alignment, GEMM1 with SiLU·mul, GEMM2, sum over the K slots).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools.timing

from rollout.kernels.fused_moe import (MoeLaunch, default_moe_launch, fused_moe, moe_align_block_size,  # noqa: E402
                                       moe_gemm)
from tools.timing import eager_ms, graph_ms  # noqa: E402

E, TOP_K, H, I = 128, 8, 2048, 768
TOKENS = (1, 8, 32, 64, 128, 256, 512, 1024, 4096)
HBM_BYTES_PER_S = 4.0e12
CALLS = 8  # routings per timed graph


def time_us(calls: list, graph: bool, runs: int = 20) -> float:
    """Time of one call in µs: the median over ``runs`` of the mean over ``calls`` (each on its own routing, so
    that one call's experts are not in L2 for the next), all replayed from one CUDA graph if ``graph``."""
    def run_all():
        for fn in calls:
            fn()

    timer = graph_ms if graph else eager_ms
    return timer(run_all, calls=1, repeats=runs, warmup=3) * 1e3 / len(calls)


def route(t: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32, topk_ids int32) [t, TOP_K]: distinct uniform random experts per token."""
    logits = torch.randn(t, E, device=dev)
    ids = torch.rand(t, E, device=dev).topk(TOP_K, dim=-1).indices
    return torch.softmax(logits.gather(1, ids), dim=-1), ids.to(torch.int32)


def reference(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Per-expert loop in float32 (no intermediate rounding)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        gate, up = (x[tok].float() @ w13[e].float().T).chunk(2, dim=-1)
        out.index_add_(0, tok, (F.silu(gate) * up @ w2[e].float().T) * topk_weights[tok, slot, None].float())
    return out


def sweep_launches(t: int) -> list[MoeLaunch]:
    """A handful of launches: 16- and 32-row blocks always, 64 and 128 once experts get enough rows."""
    out = [MoeLaunch(bm, bn, bk, 1, 4, st) for bm, (bn, bk), st in itertools.product(
        (16, 32), ((32, 128), (32, 256), (64, 64), (64, 128), (64, 256), (128, 64), (128, 128)), (3, 4))]
    if t * TOP_K / E >= 16:
        out += [MoeLaunch(bm, bn, bk, 8, w, 3) for bm, bn, bk, w in
                itertools.product((64, 128), (64, 128, 256), (64, 128), (4, 8)) if bm * bn <= 128 * 128]
    return out


def sweep(t, x, w13, w2, routes, default: tuple[MoeLaunch, MoeLaunch], graph: bool) -> None:
    """Times GEMM1 (with SiLU·mul) and GEMM2 alone for every launch of ``sweep_launches``; prints the best three
    of each and the best pair of one BLOCK_M (the alignment both share), against the defaults."""
    act = torch.empty(t * TOP_K, I, device=x.device, dtype=torch.bfloat16)
    down = torch.empty(t * TOP_K, H, device=x.device, dtype=torch.bfloat16)
    aligned = {}
    timed: dict[str, list[tuple[float, MoeLaunch]]] = {"gemm1": [], "gemm2": []}
    for i, launch in enumerate(list(default) + sweep_launches(t)):
        if launch.block_m not in aligned:
            aligned[launch.block_m] = [moe_align_block_size(ids, E, launch.block_m) for _, ids in routes]
        al = aligned[launch.block_m]
        calls = {"gemm1": [lambda a=a: moe_gemm(x, w13, act, None, *a, TOP_K, launch, swiglu=True) for a in al],
                 "gemm2": [lambda a=a, w=w: moe_gemm(act, w2, down, w, *a, 1, launch)
                           for a, (w, _) in zip(al, routes)]}
        for name, fns in calls.items():
            if i < 2 and name != ("gemm1", "gemm2")[i]:
                continue  # the defaults first: GEMM1's, then GEMM2's
            try:
                timed[name].append((time_us(fns, graph), launch))
            except Exception as e:  # noqa: BLE001 - a launch that does not fit (shared memory, registers)
                print(f"       {name} {launch}: {type(e).__name__}")
    for name, results in timed.items():
        base = results[0][0]
        for us, launch in sorted(results, key=lambda p: p[0])[:3]:
            print(f"       {name} {us:8.1f} us ({us / base:.2f}x default) {launch}")
    pairs = [(u1 + u2, l1, l2) for u1, l1 in timed["gemm1"] for u2, l2 in timed["gemm2"] if l1.block_m == l2.block_m]
    us, l1, l2 = min(pairs, key=lambda p: p[0])
    print(f"       best pair {us:.1f} us (default {timed['gemm1'][0][0] + timed['gemm2'][0][0]:.1f}): {l1} + {l2}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time a handful of tile launches per T")
    parser.add_argument("--breakdown", action="store_true", help="time each step of fused_moe alone")
    parser.add_argument("--eager", action="store_true", help="time plain launches instead of CUDA graph replays")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")
    args = parser.parse_args()
    dev = torch.device("cuda")
    print(f"GPU: {torch.cuda.get_device_name(dev)} (torch {torch.__version__}); E={E} top_k={TOP_K} H={H} I={I} "
          f"bf16, {'eager' if args.eager else 'CUDA graph'} timing")
    torch.manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) / H ** 0.5
    w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) / I ** 0.5
    x = torch.randn(64, H, device=dev, dtype=torch.bfloat16)
    topk_weights, topk_ids = route(64, dev)
    ref = reference(x, w13, w2, topk_weights, topk_ids)
    got = fused_moe(x, w13, w2, topk_weights, topk_ids).float()
    print(f"T=64 check: max |fused_moe - float32 reference| = {(got - ref).abs().max().item():.3e} "
          f"(max |reference| {ref.abs().max().item():.3f}; bf16 ulp there {ref.abs().max().item() / 128:.3e})")
    expert_bytes = (2 * I * H + H * I) * 2
    print(f"{'T':>5} {'us':>9} {'experts':>7} {'MB read':>8} {'GB/s':>6} {'x floor':>7}  launch")
    for t in map(int, args.tokens.split(",")):
        x = torch.randn(t, H, device=dev, dtype=torch.bfloat16)
        routes = [route(t, dev) for _ in range(CALLS)]
        experts = statistics.mean(ids.unique().numel() for _, ids in routes)
        nbytes = experts * expert_bytes
        default = (default_moe_launch(t, E, I, H, TOP_K), default_moe_launch(t, E, H, I, TOP_K))

        def moe_calls(launch=None):
            return [lambda w=w, ids=ids: fused_moe(x, w13, w2, w, ids, launch=launch) for w, ids in routes]

        us = time_us(moe_calls(), not args.eager)
        print(f"{t:>5} {us:9.1f} {experts:>7.1f} {nbytes / 1e6:8.1f} {nbytes / us / 1e3:6.0f} "
              f"{us / (nbytes / HBM_BYTES_PER_S * 1e6):7.2f}  default {default[0]}, down {default[1]}")
        if args.breakdown:
            aligned = [moe_align_block_size(ids, E, default[0].block_m) for _, ids in routes]
            act = torch.empty(t * TOP_K, I, device=dev, dtype=torch.bfloat16)
            down = torch.empty(t * TOP_K, H, device=dev, dtype=torch.bfloat16)
            steps = {
                "align": [lambda ids=ids: moe_align_block_size(ids, E, default[0].block_m) for _, ids in routes],
                "gemm1+silu_mul": [lambda al=al: moe_gemm(x, w13, act, None, *al, TOP_K, default[0], swiglu=True)
                                   for al in aligned],
                "gemm2": [lambda al=al, w=w: moe_gemm(act, w2, down, w, *al, 1, default[1])
                          for al, (w, _) in zip(aligned, routes)],
                "sum": [lambda: down.view(t, TOP_K, H).sum(dim=1)] * CALLS,
            }
            print("       " + ", ".join(f"{name} {time_us(fns, not args.eager):.1f}" for name, fns in steps.items()))
        if args.sweep:
            sweep(t, x, w13, w2, routes, default, not args.eager)


if __name__ == "__main__":
    main()
