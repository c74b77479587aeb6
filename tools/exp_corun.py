"""Can a prefill chunk's compute-bound work hide under the memory-bound decode step on one GPU? Two CUDA
streams, each replaying its own CUDA graph, timed alone and together (NanoFlow's premise).

    python tools/exp_corun.py [--tokens 8192] [--batch 256] [--context 1500] [--gemm-sm-carveout 0,16,32]

Stream A: the Llama-3.1-8B MLP and QKV/O projections of a prefill chunk (``--tokens`` rows, bf16 GEMMs,
compute-bound). Stream B: decode attention of one 8B layer over a bf16 paged KV pool at ``--batch``
requests of ``--context`` tokens (the engine's Triton kernel, memory-bound), repeated so both streams run
for about as long. Prints each alone, both at once, and ``overlap = (alone_A + alone_B) / together``
(1.0: they only take turns; 2.0: perfect overlap), for each ``--gemm-sm-carveout`` (the GEMMs captured
with that many SMs left to the other stream, NanoFlow's SM partitioning), also against A on all SMs.
The engine does not run prefill and decode this way (docs/rl_rollouts.md); this measures whether it would pay.
"""

from __future__ import annotations

import argparse

import torch


def capture_graph(fn, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """``fn`` run once eagerly on ``stream`` (warm-up), then captured there as a CUDA graph (also used by
    ``exp_tbo.py``)."""
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            fn()
    torch.cuda.synchronize()
    return g


def _time(run, repeats: int = 5) -> float:
    """Best wall time in ms of ``run()`` (which launches work on its streams), synchronized."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b))
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1500)
    p.add_argument("--gemm-sm-carveout", default="0,16,32,48,66",
                   help="SMs the prefill GEMMs leave free (cuBLAS SM count target), comma-separated; 0 first")
    args = p.parse_args()
    from rollout.kernels.decode_attention import decode_attention, num_kv_splits

    dev, dt = torch.device("cuda"), torch.bfloat16
    h, inter, hq, hk, d = 4096, 14336, 32, 8, 128
    x = torch.randn(args.tokens, h, device=dev, dtype=dt)
    w_qkv = torch.randn((hq + 2 * hk) * d, h, device=dev, dtype=dt) * 0.02
    w_o = torch.randn(h, hq * d, device=dev, dtype=dt) * 0.02
    w_gu = torch.randn(2 * inter, h, device=dev, dtype=dt) * 0.02
    w_down = torch.randn(h, inter, device=dev, dtype=dt) * 0.02

    bias = {n: torch.zeros(n, device=dev, dtype=dt) for n in {(hq + 2 * hk) * d, h, 2 * inter}}

    def lin(a, w):  # addmm with a (zero) bias: cuBLASLt, which honors the SM carveout (plain `@` may not)
        return torch.addmm(bias[w.shape[0]], a, w.t())

    def prefill_layer():
        qkv = lin(x, w_qkv)
        o = lin(qkv[:, :hq * d], w_o)
        gu = lin(o, w_gu)
        return lin(gu[:, :inter] * gu[:, inter:], w_down)

    slots = args.batch * args.context
    k_buf = torch.randn(slots + 1, hk, d, device=dev, dtype=dt)
    v_buf = torch.randn_like(k_buf)
    q = torch.randn(args.batch, hq, d, device=dev, dtype=dt)
    indptr = torch.arange(0, slots + 1, args.context, device=dev, dtype=torch.int32)
    indices = (torch.randperm(slots, device=dev) + 1).to(torch.int32)
    splits = num_kv_splits(args.batch, hk, torch.cuda.get_device_properties(dev).multi_processor_count)
    out = torch.empty_like(q)
    counters = torch.zeros(args.batch * hk, dtype=torch.int32, device=dev)  # the engine's merge counts

    def decode_layer():
        decode_attention(q, k_buf, v_buf, indptr, indices, d ** -0.5, splits, out=out, counters=counters)

    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
    gb = capture_graph(decode_layer, sb)
    kv_gb = 2 * slots * hk * d * 2 / 1e9
    flops = 2 * args.tokens * h * ((hq + 2 * hk) * d) + 2 * args.tokens * hq * d * h + 2 * args.tokens * h * 3 * inter
    t_b1 = _time(lambda: replay_on_streams([(gb, sb, 1)]))
    print(f"{torch.cuda.get_device_name(dev)}; prefill: {args.tokens} tokens x one 8B layer's GEMMs "
          f"({flops / 1e12:.2f} TFLOP); decode attention: batch {args.batch} x {args.context} tokens, {splits} splits "
          f"({kv_gb:.2f} GB, {kv_gb / t_b1:.2f} TB/s alone)")
    base_a = None
    for carveout in (int(c) for c in args.gemm_sm_carveout.split(",")):
        torch._C._set_sm_carveout_experimental(carveout or None)  # read when a GEMM is captured
        ga = capture_graph(prefill_layer, sa)
        torch._C._set_sm_carveout_experimental(None)
        t_a1 = _time(lambda: replay_on_streams([(ga, sa, 1)]))
        reps_a = 4
        reps_b = reps_a * max(1, round(t_a1 / t_b1))
        t_a = _time(lambda: replay_on_streams([(ga, sa, reps_a)]))
        t_b = _time(lambda: replay_on_streams([(gb, sb, reps_b)]))
        t_ab = _time(lambda: replay_on_streams([(ga, sa, reps_a), (gb, sb, reps_b)]))
        base_a = base_a or t_a  # the first carveout's A is the reference (list 0 first)
        print(f"GEMM SM carveout {carveout:3d}: {flops / t_a1 / 1e9:.0f} TFLOP/s alone; A = {reps_a} prefill layers "
              f"{t_a:.3f} ms alone; B = {reps_b} decode layers {t_b:.3f} ms alone; together {t_ab:.3f} ms; "
              f"overlap (A + B) / together = {(t_a + t_b) / t_ab:.2f}, against A without carveout "
              f"{(base_a + t_b) / t_ab:.2f}", flush=True)


def replay_on_streams(graph_reps: list[tuple[torch.cuda.CUDAGraph, torch.cuda.Stream, int]]) -> None:
    """Replay each graph ``reps`` times on its own stream (entries of one stream in list order), all after and
    before the current stream."""
    cur = torch.cuda.current_stream()
    for g, stream, reps in graph_reps:
        stream.wait_stream(cur)
        with torch.cuda.stream(stream):
            for _ in range(reps):
                g.replay()
    for _, stream, _ in graph_reps:
        cur.wait_stream(stream)


if __name__ == "__main__":
    main()
