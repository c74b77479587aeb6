"""Does capturing piecewise (extend) CUDA graphs slow the decode graphs' replays, by capture order and stream?

    python tools/exp_graph_capture_order.py [--preset qwen3-0.6b] [--cases decode_only:none,pieces_first:stream,...]

Each case runs in a fresh process (the effect is process-wide): a ModelRunner with random weights and no graphs,
then, by hand, decode graphs for batch sizes 1..16 and piecewise graphs for 64/128/256-token extend steps, in
the case's order (``decode_only``, ``decode_first``, ``pieces_first``) and sharing (``none``: each runner its own
capture stream and pool; ``stream``: one capture stream; ``stream_pool``: one stream and one memory pool). It
prints the batch-16 decode graph's replay time (50 replays alone, GPU events, 3 rounds). Its static inputs are
the capture's padding (one cached token a row), so the times are short; compare cases, not absolutes.
One H100 (2026-11-26): pieces captured first on the decode graphs' stream cost nothing; every other arrangement
tried cost ~0.1 ms a replay (the decode graph's kernels stop overlapping through programmatic dependent
launch), which is why the model runner captures every graph on one stream, the pieces first.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = "decode_only:none,decode_first:none,pieces_first:none,pieces_first:stream,pieces_first:stream_pool," \
        "decode_first:stream_pool"


def run_case(preset: str, order: str, share: str) -> None:
    import torch

    import rollout.model_executor.cuda_graph_runner as cgr
    import rollout.model_executor.piecewise_graph_runner as pgr
    from gpu_checks.profile_step import build

    ns = argparse.Namespace(model=None, preset=preset, batch=16, context=600, steps=60, device="cuda", no_graph=True,
                            kv_cache_dtype="auto", quantization=None, page_size=1, decode_attention_backend="auto",
                            enable_piecewise_cuda_graph=False)
    runner, _, _ = build(ns)
    dev = runner.device
    shared = torch.cuda.Stream(dev)

    def stream():
        return torch.cuda.Stream(dev) if share == "none" else shared

    def decode() -> None:
        runner.graph_runner = cgr.CudaGraphRunner(runner, runner.attn_backend, cgr.default_batch_sizes(16),
                                                  runner.shared_prefix_members > 0, stream())

    def pieces() -> None:
        runner.piecewise_runner = pgr.PiecewiseCudaGraphRunner(runner, [64, 128, 256], stream())

    if share == "stream_pool":  # the runner captured second takes the first one's pool
        second = pgr.PiecewiseCudaGraphRunner if order == "decode_first" else cgr.CudaGraphRunner

        def into_first_pool(self, _capture=second.capture) -> None:
            first = runner.graph_runner if order == "decode_first" else runner.piecewise_runner
            self.pool = first.pool
            _capture(self)
        second.capture = into_first_pool
    steps = {"decode_only": [decode], "decode_first": [decode, pieces], "pieces_first": [pieces, decode]}[order]
    for step in steps:
        step()
    graph = runner.graph_runner.graphs[(16, "plain")]
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(f"{start.elapsed_time(end) / 50:.3f}")
    print(f"{order:12s} {share:11s}: batch-16 decode graph alone {' '.join(times)} ms", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--cases", default=CASES, help="order:share pairs, comma-separated")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one case in this process
    args = p.parse_args()
    if args.one:
        run_case(args.preset, *args.one.split(":"))
        return
    for case in args.cases.split(","):
        subprocess.run([sys.executable, os.path.abspath(__file__), "--preset", args.preset, "--one", case], check=False)


if __name__ == "__main__":
    main()
