"""The engine's side of the bench: start it, warm up, time one ``generate`` over the workload, read the
steady-batch decode step time from its step stats, and optionally probe decode at batch size 1."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.workload import RunResult, Workload, make_workload


@dataclass
class StepTiming:
    """Mean decode-step time at one batch size, and the mean KV tokens those steps read."""

    batch_size: int
    steps: int
    mean_step_ms: float
    mean_kv_tokens: float


@dataclass
class EngineRun:
    """The engine's timed run, its steady-batch decode timing, and the optional batch-1 timing."""

    result: RunResult
    steady: StepTiming | None
    batch1: StepTiming | None = None
    context_len: int = 0
    kv_tokens: int = 0
    step_stats: dict[str, Any] = field(default_factory=dict)


def steady_step(stats: dict[str, Any]) -> StepTiming | None:
    """From ``Engine.get_step_stats()``: the batch size with the most decode steps (ties: the larger)."""
    decode = stats.get("decode") or {}
    if not decode:
        return None
    bs = max(decode, key=lambda b: (decode[b]["steps"], b))
    return _timing(int(bs), decode[bs])


def _timing(batch_size: int, entry: dict[str, Any]) -> StepTiming:
    steps = entry["steps"]
    return StepTiming(batch_size, steps, 1000.0 * entry["seconds"] / steps, entry["kv_tokens"] / steps)


CUMULATIVE_COUNTS = ("mixed_steps", "retractions", "cascade_steps", "cascade_rows", "gen_tokens", "prefill_tokens")


def count_deltas(before: dict[str, Any], after: dict[str, Any],
                 keys: tuple[str, ...] = CUMULATIVE_COUNTS) -> dict[str, Any]:
    """The counts ``keys`` (of ``Engine.get_step_stats()``, which a reset does not zero) from ``before`` to ``after``."""
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


def counts_since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``after``, an ``Engine.get_step_stats(reset=True)`` read, with the counts a reset does not zero
    (``CUMULATIVE_COUNTS``: mixed steps, retractions, ...) taken since the ``before`` read, so that they
    cover the same steps as its reset timings (not the warm-up's)."""
    return {**after, **count_deltas(before, after)}


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """Engine keyword options from the flags; presets skip the tokenizer (no detokenizer process)."""
    opts: dict[str, Any] = {"seed": args.seed, "skip_tokenizer_init": bool(args.preset),
                            "load_format": getattr(args, "load_format", "auto")}
    for switch in ("enable_mixed_chunk", "disable_cascade_attn", "enable_piecewise_cuda_graph"):
        if getattr(args, switch, False):
            opts[switch] = True
    for name in ("max_running_requests", "mem_fraction_static", "max_total_tokens", "attention_backend",
                 "decode_attention_backend", "kv_cache_dtype", "quantization", "page_size", "chunked_prefill_size",
                 "max_prefill_tokens", "cuda_graph_max_bs", "schedule_conservativeness",
                 "decode_balance_ratio"):
        if getattr(args, name) is not None:
            opts[name] = getattr(args, name)
    return opts


def _sampling(output_len: int, temperature: float):
    from rollout.sampling_params import SamplingParams

    return SamplingParams(max_new_tokens=output_len, temperature=temperature, ignore_eos=True)


def check_context(engine: Any, prompts: list[list[int]], output_lens: list[int]) -> None:
    """Raise when a request's prompt and output lengths exceed the engine's context: the engine would end it
    at the context, and the run would time fewer output tokens than the workload asks for."""
    longest = max(len(p) + n for p, n in zip(prompts, output_lens))
    if longest > engine.context_len:
        raise ValueError(f"a request needs {longest} tokens but the engine's context is {engine.context_len}")


def run_engine(args: argparse.Namespace, model_path: str, device: str, dtype: str, work: Workload) -> EngineRun:
    """Start the engine, warm up, time one ``generate`` over the workload, then the batch-1 probe."""
    from rollout.engine import Engine

    with Engine(model_path, tp_size=args.tp_size, dtype=dtype, device=device, **engine_options(args)) as engine:
        check_context(engine, work.prompts, work.output_lens)
        if args.warmup:
            _engine_warmup(engine, work, args)
        before = engine.get_step_stats(reset=True)
        launched = before["launched_steps"]
        if args.profile:
            trace = start_profile(engine, args, launched)
        params = [_sampling(n, args.temperature) for n in work.output_lens]
        start = time.perf_counter()
        outs = engine.generate(prompt_token_ids=work.prompts, sampling_params=params, use_tqdm=True)
        elapsed = time.perf_counter() - start
        stats = counts_since(before, engine.get_step_stats(reset=True))
        if args.profile:
            report_profile(engine, trace, stats["launched_steps"] - launched)
        produced = sum(len(c.token_ids) for o in outs for c in o.outputs)
        run = EngineRun(RunResult(len(outs), work.input_tokens, produced, elapsed), steady_step(stats),
                        context_len=engine.context_len, kv_tokens=engine.get_server_info()["max_total_tokens"],
                        step_stats=stats)
        if args.batch1_steps:
            run.batch1 = _batch1_probe(engine, work, args)
    return run


def start_profile(engine: Any, args: argparse.Namespace, launched: int) -> str:
    """Arm ``Engine.start_profile`` for the timed run's steps ``--profile-start-step`` onwards -> rank 0's trace."""
    activities = args.profile_activities.split(",") if args.profile_activities else None
    out = engine.start_profile(output_dir=args.profile_dir, start_step=launched + args.profile_start_step,
                               num_steps=args.profile_num_steps, activities=activities,
                               with_stack=args.profile_with_stack,
                               profile_id=f"bench-{time.time():.0f}")
    return out["traces"][0]


def report_profile(engine: Any, trace: str, steps: int) -> None:
    """Print where the profiled steps' GPU time went (``benchmarks.trace_gaps``); stops a profile still open."""
    import os

    from benchmarks.trace_gaps import format_summary, load_events, summarize

    try:
        engine.stop_profile()
    except ValueError:  # it ended by itself after --profile-num-steps
        pass
    if not os.path.exists(trace):
        print(f"profile: no trace written (the timed run had {steps} steps)", flush=True)
        return
    print(f"profile: {trace}", flush=True)
    print(format_summary(summarize(load_events(trace))), flush=True)


def _engine_warmup(engine: Any, work: Workload, args: argparse.Namespace) -> None:
    """Untimed generates on separate random prompts, then drop their prefix-cache entries: a short one,
    and one whose prefill fills a whole prefill batch with prompts as long as the workload's longest,
    so that every kernel the timed run uses at those shapes is compiled and loaded first (the first 8B
    fp8 run on a fresh H200 had a 6.22 s prefill, the next run on the same machine 4.28 s)."""
    vocab = engine.model_config.vocab_size
    warm = make_workload(min(8, len(work.prompts)), vocab, args.seed + 1, 16, 8)
    engine.generate(prompt_token_ids=warm.prompts, sampling_params=_sampling(8, args.temperature),
                    use_tqdm=False)
    longest = max(len(p) for p in work.prompts)
    count = min(len(work.prompts), -(-engine.config.max_prefill_tokens // longest))
    full = make_workload(count, vocab, args.seed + 3, longest, 8)
    engine.generate(prompt_token_ids=full.prompts, sampling_params=_sampling(8, args.temperature),
                    use_tqdm=False)
    engine.flush_cache()


def _batch1_probe(engine: Any, work: Workload, args: argparse.Namespace) -> StepTiming | None:
    """One request alone for ``args.batch1_steps`` decode steps; its mean step time at batch size 1."""
    n_in = max(1, min(round(work.input_tokens / len(work.prompts)), engine.context_len - args.batch1_steps - 2))
    probe = make_workload(1, engine.model_config.vocab_size, args.seed + 2, n_in, args.batch1_steps + 1)
    engine.get_step_stats(reset=True)
    engine.generate(prompt_token_ids=probe.prompts, sampling_params=_sampling(args.batch1_steps + 1,
                                                                              args.temperature), use_tqdm=False)
    entry = (engine.get_step_stats(reset=True).get("decode") or {}).get(1)
    return _timing(1, entry) if entry else None
