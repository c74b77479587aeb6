"""Where one decode step's GPU time goes: a ModelRunner in this process (no scheduler, no IPC), a synthetic
batch of B requests with L cached tokens each (random weights and KV), CUDA-graph decode + sampling as the
engine runs them, timed, then one torch.profiler window summed by kernel.

    python gpu_checks/profile_step.py --preset llama-3.1-8b --batch 256 --context 1500
    python gpu_checks/profile_step.py --preset llama-3.1-8b --batch 1 --context 1000
    python gpu_checks/profile_step.py --preset llama-3.1-8b --batch 16 --context 1000 --prefill

With ``--prefill`` the step is instead a prefill of B fresh prompts of L tokens each (the bench's prefill
steps: 16 x 1,000 tokens), sampling each prompt's first token.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/ of the checkout


def build(args: argparse.Namespace):
    import json
    import tempfile

    from benchmarks.memory_floor import model_bytes
    from benchmarks.presets import preset_config
    from rollout.config import EngineConfig, ModelConfig, kv_cache_torch_dtype
    from rollout.distributed import TPGroup
    from rollout.model_executor.model_runner import ModelRunner

    path = args.model
    if path is None:  # random weights (load_format="dummy"): the preset's config.json is all it needs
        path = tempfile.mkdtemp()
        with open(f"{path}/config.json", "w") as f:
            json.dump(preset_config(args.preset), f)
    cfg = ModelConfig.from_path(path)
    page = args.page_size
    slots = -(-(args.batch * (args.context + args.steps + 64 + page) + 16) // page) * page
    config = EngineConfig(path, dtype="bfloat16", device=args.device, load_format="dummy", max_total_tokens=slots,
                          max_running_requests=max(args.batch, 1), disable_cuda_graph=args.no_graph,
                          kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization, page_size=page,
                          decode_attention_backend=args.decode_attention_backend,
                          enable_piecewise_cuda_graph=getattr(args, "enable_piecewise_cuda_graph", False))
    runner = ModelRunner(config, cfg, TPGroup(), torch.device(args.device))
    kv_bytes = kv_cache_torch_dtype(args.kv_cache_dtype, torch.bfloat16).itemsize
    return runner, cfg, model_bytes(cfg, 1, 2, kv_bytes, quantization=args.quantization)


def decode_input(runner, batch: int, context: int, step: int, per_row: int, base: int = 1):
    """Step ``step`` of B requests that each hold ``context`` tokens (rows 0..B-1, ``per_row`` slots per row
    from slot ``base``, ``context + step < per_row``; both multiples of the page size)."""
    from rollout.model_executor.forward_batch import ForwardMode
    from rollout.model_executor.model_runner import StepInput

    rows = list(range(batch))
    pos = [context + step] * batch
    slots = torch.tensor([base + r * per_row + context + step for r in rows], dtype=torch.int64)
    runner.req_to_token.write_many(rows, pos, slots, device=False)  # as the scheduler: the runner writes the device
    return StepInput(ForwardMode.DECODE, rows, None, pos, slots, [p + 1 for p in pos], [1] * batch)


def prefill_input(runner, batch: int, context: int, vocab: int):
    """A prefill of B fresh prompts of ``context`` random tokens (rows 0..B-1, consecutive slots)."""
    from rollout.model_executor.forward_batch import ForwardMode
    from rollout.model_executor.model_runner import StepInput

    rows = list(range(batch))
    slots = torch.arange(1, 1 + batch * context, dtype=torch.int64)
    positions = list(range(context)) * batch
    # the host table only, as the scheduler writes it: the step's forward writes the device table
    runner.req_to_token.write_many([r for r in rows for _ in range(context)], positions, slots, device=False)
    ids = torch.randint(3, vocab - 1, (batch * context,)).tolist()
    return StepInput(ForwardMode.EXTEND, rows, ids, positions, slots, [context] * batch, [context] * batch)


def main() -> None:
    from rollout.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1500)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--prefill", action="store_true", help="profile a prefill of B x L fresh tokens instead")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS)
    p.add_argument("--decode-attention-backend", default="auto")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--enable-piecewise-cuda-graph", action="store_true", help="piecewise CUDA graphs for prefill")
    args = p.parse_args()
    from rollout.layers.sampling_info import SamplingRow
    from rollout.sampling_params import SamplingParams

    runner, cfg, mb = build(args)
    b, ctx = args.batch, args.context
    page = args.page_size
    per_row = -(-(ctx + 64 + args.steps) // page) * page  # whole pages per row, from page 1 (slot ``page``)
    for r in range(b):  # every row's first ctx tokens: random KV in consecutive slots
        runner.req_to_token.write(r, 0, torch.arange(page + r * per_row, page + r * per_row + ctx))
    for buf in runner.kv_pool.k_buffers + runner.kv_pool.v_buffers:  # via float32: float8 has no normal_
        buf[:b * per_row + page].copy_(torch.randn(buf[:b * per_row + page].shape, device=buf.device))
    runner.last_token_ids.random_(3, cfg.vocab_size - 1)
    params = SamplingParams(temperature=args.temperature, ignore_eos=True, logprobs=0)
    info = runner.sampling_info([SamplingRow(params, seed=i, output_len=0, prompt_token_ids=[], output_token_ids=[],
                                             eos_token_ids=[]) for i in range(b)])
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def launch(step: int):
        if args.prefill:
            return runner.run_step(prefill_input(runner, b, ctx, cfg.vocab_size), list(range(b)), info)
        return runner.run_step(decode_input(runner, b, ctx, step, per_row, page), list(range(b)), info)

    def one(step: int) -> None:
        launch(step).wait()

    def overlapped(steps: range) -> None:
        """As the scheduler runs decode: step s+1 is launched before step s is waited for."""
        prev = None
        for s in steps:
            out = launch(s)
            if prev is not None:
                prev.wait()
            prev = out
        prev.wait()

    for s in range(5):
        one(s)
    sync()
    t0 = time.perf_counter()
    n = args.steps // 2
    for s in range(5, 5 + n):
        one(s)
    sync()
    step_ms = (time.perf_counter() - t0) / n * 1000
    kv_bytes = b * (ctx + 10) * mb.kv_bytes_per_token
    if args.prefill:
        print(f"prefill of {b} x {ctx} tokens: {step_ms:.2f} ms per step (launch + wait), "
              f"{b * ctx / step_ms * 1000:.0f} tok/s", flush=True)
    else:
        print(f"batch {b}, context {ctx}: {step_ms:.2f} ms per decode step (launch + wait, no overlap); weights "
              f"read {mb.weight_bytes_read / 1e9:.2f} GB, KV read {kv_bytes / 1e9:.2f} GB", flush=True)
    if not args.prefill:
        t0 = time.perf_counter()
        overlapped(range(5 + n, 5 + 2 * n))
        print(f"overlapped as the scheduler runs them (step s+1 launched before s is read): "
              f"{(time.perf_counter() - t0) / n * 1000:.2f} ms per decode step", flush=True)
    graphs = getattr(runner.graph_runner, "graphs", {})
    if not args.prefill and b in graphs:  # the forward's own GPU timeline: its graph replayed back to back
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graphs[b].replay()
        end.record()
        end.synchronize()
        print(f"decode graph replayed back to back (forward only, no sampling or host work): "
              f"{start.elapsed_time(end) / 20:.2f} ms", flush=True)
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=acts) as prof:
        if args.prefill:
            for s in range(5 + 2 * n, 5 + 2 * n + 5):
                one(s)
        else:
            overlapped(range(5 + 2 * n, 5 + 2 * n + 5))
        sync()
    key = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70))
    if args.device == "cuda":
        print_gaps(prof)


def print_gaps(prof, top: int = 12) -> None:
    """The profiled window's GPU busy and idle time, idle summed by the pair of kernels around it
    (``benchmarks.trace_gaps``)."""
    import tempfile

    from benchmarks.trace_gaps import format_summary, load_events, summarize

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = load_events(f.name)
    print(format_summary(summarize(events), top))


if __name__ == "__main__":
    main()
