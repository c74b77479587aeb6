"""The host's cost of one decode step at small batches, where the GPU waits for it: a ModelRunner in this process
(random weights, ``gpu_checks/profile_step.py``'s synthetic batch), per batch size:

- ``replay``: host time of ``graph.replay()`` alone with the GPU idle (synchronized first), i.e. cudaGraphLaunch;
- ``run_step``: host time of launching a whole step (input copy, prepare kernel, replay, sampler, copies back);
- ``gpu``: the decode graph replayed back to back (its GPU time);
- ``overlapped``: steps as the scheduler runs them (s+1 launched before s is read).

Run it with ``ROLLOUT_TRITON_PDL=0`` too: programmatic-dependent-launch edges are the suspect for a slow launch.

    python tools/exp_graph_launch.py [--preset qwen3-0.6b] [--batch 1,16,64,256] [--context 600]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "gpu_checks")]


def measure(runner, info, b: int, ctx: int, per_row: int, n: int = 20) -> dict[str, float]:
    from profile_step import decode_input

    step = iter(range(10_000))
    rows = list(range(b))

    def launch():
        return runner.run_step(decode_input(runner, b, ctx, next(step) % 50, per_row), rows, info)

    for _ in range(5):
        launch().wait()
    graph = runner.graph_runner.graphs[runner.graph_runner._padded(b), "plain"]
    out = {}
    host = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        host.append(time.perf_counter() - t0)
    out["replay"] = sorted(host)[n // 2] * 1e3
    host = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = launch()
        host.append(time.perf_counter() - t0)
        res.wait()
    out["run_step"] = sorted(host)[n // 2] * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    out["gpu"] = start.elapsed_time(end) / n
    prev = None
    t0 = time.perf_counter()
    for _ in range(n):
        res = launch()
        if prev is not None:
            prev.wait()
        prev = res
    prev.wait()
    out["overlapped"] = (time.perf_counter() - t0) / n * 1e3
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--batch", default="1,16,64,256")
    p.add_argument("--context", type=int, default=600)
    args = p.parse_args()
    from profile_step import build

    from rollout.layers.sampling_info import SamplingRow
    from rollout.sampling_params import SamplingParams

    batches = [int(x) for x in args.batch.split(",")]
    ns = argparse.Namespace(model=None, preset=args.preset, batch=max(batches), context=args.context, steps=80,
                            device="cuda", no_graph=False, kv_cache_dtype="auto", quantization=None,
                            decode_attention_backend="auto", page_size=1)
    runner, cfg, _ = build(ns)
    per_row = args.context + 64 + 64
    for r in range(max(batches)):
        runner.req_to_token.write(r, 0, torch.arange(1 + r * per_row, 1 + r * per_row + args.context))
    runner.last_token_ids.random_(3, cfg.vocab_size - 1)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, ROLLOUT_TRITON_PDL="
          f"{os.environ.get('ROLLOUT_TRITON_PDL', '1')}, {args.preset}, context {args.context}", flush=True)
    for b in batches:
        params = SamplingParams(temperature=0.6, ignore_eos=True)
        info = runner.sampling_info([SamplingRow(params, seed=i, output_len=0, prompt_token_ids=[],
                                                 output_token_ids=[], eos_token_ids=[]) for i in range(b)])
        m = measure(runner, info, b, args.context, per_row)
        print(f"batch {b:4d}: replay (host) {m['replay']:.3f} ms, run_step (host) {m['run_step']:.3f} ms, "
              f"graph (GPU) {m['gpu']:.3f} ms, overlapped step {m['overlapped']:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
