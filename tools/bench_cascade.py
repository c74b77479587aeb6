"""Cascade decode attention alone: one layer of the Triton decode kernel over requests in groups that share a
prompt, with the groups (stage 0 reads each prefix once) and without (every request reads its whole KV).

    python tools/bench_cascade.py [--heads 16,8] [--batch 64,256,512] [--prefix 500] [--suffix 100,500,1500]

B requests in groups of ``--group`` (GRPO's samples of one prompt) share a ``--prefix``-token prompt and each
has ``--suffix`` tokens of its own; the members are next to each other in the batch (as the engine admits
GRPO samples), or with ``--spread`` far apart. The prompt's slots are contiguous per group (a prefill allocates them),
the suffixes interleaved across requests (as decode steps allocate them). Each variant runs as the engine
runs it (split counters, the engine's split count for the batch; stage 0 splits as a CUDA graph of that
batch size picks them, over a table with room for B / 2 groups) inside a CUDA graph, 20 replays per timing,
median of 7. Prints time per layer, the KV bytes each variant must read, and the max |difference|.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout.kernels.decode_attention import (DecodeLaunch, SharedPrefixArgs, decode_attention,  # noqa: E402
                                              max_prefix_members, num_kv_splits)
from rollout.model_executor.forward_batch import SharedPrefixes  # noqa: E402
from tools.timing import graph_ms  # noqa: E402


def case(batch: int, group: int, prefix: int, suffix: int, hq: int, hk: int, d: int, dev: torch.device,
         spread: bool):
    """With ``spread`` a group's members sit ``batch // group`` rows apart instead of next to each other."""
    groups = batch // group
    slots = groups * prefix + batch * suffix + 2
    k = torch.randn(slots, hk, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(slots, hk, d, device=dev, dtype=torch.bfloat16)
    rows = []
    group_of = [r % groups if spread else r // group for r in range(batch)]
    for r in range(batch):
        g = group_of[r]
        own = groups * prefix + 1 + torch.arange(suffix, device=dev) * batch + r
        rows.append(torch.cat([1 + g * prefix + torch.arange(prefix, device=dev), own]))
    indices = torch.cat(rows).to(torch.int32)
    indptr = torch.arange(0, batch + 1, device=dev, dtype=torch.int32) * (prefix + suffix)
    q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
    shared = SharedPrefixes(tuple([prefix] * groups), tuple(tuple(r for r in range(batch) if group_of[r] == g)
                                                          for g in range(groups)))
    return q, k, v, indptr, indices, shared


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default="16,8", help="query heads, KV heads (Qwen3-0.6B: 16,8; Llama-3.1-8B: 32,8)")
    p.add_argument("--batch", default="64,256,512")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prefix", default="500")
    p.add_argument("--suffix", default="100,500,1500")
    p.add_argument("--stage0", default="128;4;3",
                   help="stage 0 launches to time, 'N;W;S' (tokens per tile; warps; stages), comma-separated")
    p.add_argument("--spread", action="store_true",
                   help="a group's members far apart in the batch (not scheduled together: no L2 reuse between them)")
    args = p.parse_args()
    dev = torch.device("cuda")
    hq, hk = map(int, args.heads.split(","))
    d = 128
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    members = max_prefix_members(hq // hk)
    launches = [DecodeLaunch(*map(int, x.split(";"))) for x in args.stage0.split(",")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; heads {hq}/{hk}, dim {d}, bf16 KV; groups of "
          f"{args.group}, members {'far apart' if args.spread else 'next to each other'} in the batch")
    print(f"{'batch':>5} {'prefix':>6} {'suffix':>6} | {'plain ms':>8} {'GB':>6} | {'cascade ms':>10} {'GB':>6} | "
          f"{'speedup':>7} {'max |d|':>8}")
    for batch in map(int, args.batch.split(",")):
        for prefix in map(int, args.prefix.split(",")):
            for suffix in map(int, args.suffix.split(",")):
                q, k, v, indptr, indices, shared = case(batch, args.group, prefix, suffix, hq, hk, d, dev,
                                                           args.spread)
                splits = num_kv_splits(batch, hk, sms)
                counters = torch.zeros(batch * hk, dtype=torch.int32, device=dev)
                max_groups = batch // 2
                table = shared.pack(batch, max_groups, members).to(dev)
                prefix_splits = num_kv_splits(max(1, batch // 8), hk, sms)
                out_p = torch.empty_like(q)
                out_c = torch.empty_like(q)

                def plain():
                    decode_attention(q, k, v, indptr, indices, d ** -0.5, splits, out=out_p, counters=counters)

                tp = graph_ms(plain)
                per_token = 2 * hk * d * 2
                gb_p = batch * (prefix + suffix) * per_token / 1e9
                gb_c = (batch // args.group * prefix + batch * suffix) * per_token / 1e9
                for launch in launches:
                    stage0 = SharedPrefixArgs(table[batch:].view(max_groups, 1 + members), table[:batch],
                                              prefix_splits, launch)

                    def cascade():
                        decode_attention(q, k, v, indptr, indices, d ** -0.5, splits, out=out_c, counters=counters,
                                         shared_prefix=stage0)

                    tc = graph_ms(cascade)
                    diff = (out_p.float() - out_c.float()).abs().max().item()
                    tag = f"{launch.block_n};{launch.num_warps};{launch.num_stages}"
                    print(f"{batch:>5} {prefix:>6} {suffix:>6} | {tp:>8.4f} {gb_p:>6.3f} | {tc:>10.4f} {gb_c:>6.3f} | "
                          f"{tp / tc:>6.2f}x {diff:>8.1e}  stage 0 {tag}", flush=True)


if __name__ == "__main__":
    main()
