"""Would two-batch overlap pay for a small model's decode step? A Qwen3-0.6B-shaped decode forward (28 layers:
add+RMSNorm, QKV, the engine's Triton decode attention, O, add+RMSNorm, gate_up, SiLU*mul, down), each
layer's weights distinct, captured as CUDA graphs and timed three ways:

1. the whole batch on one stream;
2. two half batches one after the other on one stream (what splitting costs: weights read twice);
3. the two halves on two streams at once (two-batch overlap: one half's latency-bound GEMMs and norms
   run beside the other half's bandwidth-bound attention).

    python tools/exp_tbo.py [--batch 256,64] [--context 600]

Rope and the KV store are left out (~3 us per layer). Prints each time and ``gain = (1) / (3)``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout.kernels.decode_attention import decode_attention, num_kv_splits  # noqa: E402
from tools.exp_corun import capture_graph, replay_on_streams  # noqa: E402

LAYERS, HIDDEN, INTER, HQ, HK, D = 28, 1024, 3072, 16, 8, 128


class Step:
    """One decode forward over requests [first, first + batch) of a shared paged KV buffer."""

    def __init__(self, weights, kv, indptr, indices, first: int, batch: int, sms: int) -> None:
        dev, dt = kv[0].device, kv[0].dtype
        self.w, self.kv = weights, kv
        lo, hi = indptr[first].item(), indptr[first + batch].item()
        self.indptr = (indptr[first:first + batch + 1] - lo).contiguous()
        self.indices = indices[lo:hi].contiguous()
        self.x = torch.randn(batch, HIDDEN, device=dev, dtype=dt)
        self.res = torch.randn(batch, HIDDEN, device=dev, dtype=dt)
        self.out = torch.empty(batch, HQ, D, device=dev, dtype=dt)
        self.counters = torch.zeros(batch * HK, dtype=torch.int32, device=dev)
        self.splits = num_kv_splits(batch, HK, sms)

    def __call__(self) -> None:
        import flashinfer

        x = self.x
        for w_qkv, w_o, w_gu, w_down, n1, n2 in self.w:
            flashinfer.norm.fused_add_rmsnorm(x, self.res, n1, 1e-6)
            q = F.linear(x, w_qkv)[:, :HQ * D].view(-1, HQ, D)
            decode_attention(q, self.kv[0], self.kv[1], self.indptr, self.indices, D ** -0.5, self.splits,
                             out=self.out, counters=self.counters)
            o = F.linear(self.out.view(-1, HQ * D), w_o)
            flashinfer.norm.fused_add_rmsnorm(o, self.res, n2, 1e-6)
            x = F.linear(flashinfer.activation.silu_and_mul(F.linear(o, w_gu)), w_down)


def step_weights(dev: torch.device, dt: torch.dtype, scale: float = 0.02) -> list[tuple[torch.Tensor, ...]]:
    """``Step``'s weights: per layer (qkv, o, gate_up, down, input norm, post-attention norm), N(0, scale) and ones."""
    return [(torch.randn((HQ + 2 * HK) * D, HIDDEN, device=dev, dtype=dt) * scale,
             torch.randn(HIDDEN, HQ * D, device=dev, dtype=dt) * scale,
             torch.randn(2 * INTER, HIDDEN, device=dev, dtype=dt) * scale,
             torch.randn(HIDDEN, INTER, device=dev, dtype=dt) * scale,
             torch.ones(HIDDEN, device=dev, dtype=dt), torch.ones(HIDDEN, device=dev, dtype=dt))
            for _ in range(LAYERS)]


def step_kv(batch: int, context: int, dev: torch.device, dt: torch.dtype):
    """``Step``'s paged KV: (K and V pools of batch x context slots plus slot 0, indptr, indices), request r
    holding slots [1 + r * context, 1 + (r + 1) * context)."""
    slots = batch * context
    kv = (torch.randn(slots + 1, HK, D, device=dev, dtype=dt), torch.randn(slots + 1, HK, D, device=dev, dtype=dt))
    indptr = torch.arange(0, slots + 1, context, device=dev, dtype=torch.int32)
    return kv, indptr, (torch.arange(slots, device=dev) + 1).to(torch.int32)


def timed(entries: list[tuple[torch.cuda.CUDAGraph, torch.cuda.Stream, int]], repeats: int = 7) -> float:
    """Median ms of ``replay_on_streams(entries)``: each graph replayed on its stream, in order per stream,
    the streams at once."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay_on_streams(entries)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", default="256,64", help="whole batch sizes (even), comma-separated")
    p.add_argument("--context", type=int, default=600)
    args = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    torch.manual_seed(0)
    weights = step_weights(dev, dt)
    for batch in (int(b) for b in args.batch.split(",")):
        kv, indptr, indices = step_kv(batch, args.context, dev, dt)
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        steps = [Step(weights, kv, indptr, indices, first, n, sms)  # alive while their graphs replay
                 for first, n in ((0, batch), (0, batch // 2), (batch // 2, batch // 2))]
        whole, half_a, half_b = (capture_graph(step, s) for step, s in zip(steps, (s1, s1, s2)))
        t_whole = timed([(whole, s1, 1)])
        t_seq = timed([(half_a, s1, 1), (half_b, s1, 1)])
        t_tbo = timed([(half_a, s1, 1), (half_b, s2, 1)])
        kv_gb = LAYERS * 2 * batch * args.context * HK * D * 2 / 1e9
        print(f"{torch.cuda.get_device_name(dev)}; batch {batch} x {args.context} tokens ({kv_gb:.1f} GB of KV): "
              f"whole {t_whole:.3f} ms; halves in turn {t_seq:.3f} ms; halves on two streams {t_tbo:.3f} ms; "
              f"gain {t_whole / t_tbo:.3f}", flush=True)
        del kv, steps, whole, half_a, half_b
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
