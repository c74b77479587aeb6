"""How long the host takes to launch one eager prefill step, against the GPU time of that step, and where the
host's time goes (cProfile). A ModelRunner in this process (random weights, no scheduler): B fresh prompts
of L tokens per step, launched as the scheduler overlaps them (step s+1 launched before s is read).

    python tools/exp_prefill_host.py --preset qwen3-0.6b --batch 28 --context 570
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    from gpu_checks.profile_step import build, prefill_input
    from rollout.layers.sampling_info import SamplingRow
    from rollout.sampling_params import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--batch", type=int, default=28)
    p.add_argument("--context", type=int, default=570)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--enable-piecewise-cuda-graph", action="store_true", help="replay piecewise CUDA graphs")
    args = p.parse_args()
    ns = argparse.Namespace(model=None, preset=args.preset, batch=args.batch, context=args.context, steps=4,
                            device="cuda", no_graph=False, kv_cache_dtype="auto", quantization=None,
                            page_size=1, decode_attention_backend="auto",
                            enable_piecewise_cuda_graph=args.enable_piecewise_cuda_graph)
    start = time.perf_counter()
    runner, cfg, _ = build(ns)
    pieces = runner.piecewise_runner
    print(f"runner built in {time.perf_counter() - start:.1f} s; piecewise CUDA graphs: "
          f"{pieces.sizes if pieces is not None else 'off'}", flush=True)
    b, ctx = args.batch, args.context
    params = SamplingParams(temperature=0.6, ignore_eos=True, logprobs=0)
    info = runner.sampling_info([SamplingRow(params, seed=i, output_len=0, prompt_token_ids=[], output_token_ids=[],
                                             eos_token_ids=[]) for i in range(b)])
    inputs = [prefill_input(runner, b, ctx, cfg.vocab_size) for _ in range(args.steps)]

    def run(steps, profiler=None):
        """Overlapped launches; per step (host launch s, GPU ms between the events around its launch)."""
        prev, out = None, []
        for step in steps:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            t = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            res = runner.run_step(step, list(range(b)), info)
            if profiler is not None:
                profiler.disable()
            host = time.perf_counter() - t
            e1.record()
            if prev is not None:
                prev.wait()
            prev = res
            out.append((host, e0, e1))
        prev.wait()
        torch.cuda.synchronize()
        return [(h, a.elapsed_time(b_)) for h, a, b_ in out]

    run(inputs[:3])
    t0 = time.perf_counter()
    timed = run(inputs)
    wall = time.perf_counter() - t0
    print(f"{args.preset}: prefill steps of {b} x {ctx} tokens, {len(inputs)} overlapped: "
          f"{wall / len(inputs) * 1e3:.2f}"
          f" ms per step wall; host launch per step {[round(h * 1e3, 2) for h, _ in timed]} ms; GPU span per step "
          f"{[round(g, 2) for _, g in timed]} ms", flush=True)
    gpu = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))  # the GPU waits ~1-2 s while the host queues every step behind the events
    gpu[0].record()
    for step in inputs:  # GPU alone: all launched before the GPU starts, then read
        res = runner.run_step(step, list(range(b)), info)
    gpu[1].record()
    res.wait()
    torch.cuda.synchronize()
    print(f"GPU time per step with the launches far ahead: {gpu[0].elapsed_time(gpu[1]) / len(inputs):.2f} ms")
    prof = cProfile.Profile()
    run(inputs[:4], prof)
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
        print(f"--- cProfile of 4 launches by {key}\n" + s.getvalue()[-9000:])


if __name__ == "__main__":
    main()
