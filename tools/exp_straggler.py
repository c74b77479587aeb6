"""Experiment: the whole engine's decode with one long request among short ones, with the load-balanced decode
kernel on for such steps (``decode_balance_ratio``) and off.

    python tools/exp_straggler.py [--preset qwen3-0.6b] [--batch 128] [--long 16384] [--short 1000] \
        [--output-len 256] [--ratios inf,4] [--groups 1] [--cascade on] [--kv-cache-dtype auto]

For each cascade setting and ratio an engine (random-weight preset, CUDA graphs) generates the workload once
untimed (so every graph variant the timed run replays is captured first), then once timed on fresh prompts:
one prompt of ``--long`` tokens and ``--batch - 1`` of ``--short`` (in ``--groups`` copies of each, as GRPO's
samples of one prompt, which cascade decode reads once a group), each ``--output-len`` tokens with
``ignore_eos``. Prints the decode
seconds and mean step from the engine's step stats and the decode steps replayed from each graph variant.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.presets import write_preset  # noqa: E402
from benchmarks.workload import make_workload  # noqa: E402


def straggler_prompts(args: argparse.Namespace, vocab: int, seed: int) -> list[list[int]]:
    """One ``--long`` prompt followed by ``--batch - 1`` prompts of ``--short`` tokens, ``--groups`` copies of each."""
    long = make_workload(1, vocab, seed, args.long, 1).prompts
    short = make_workload(-(-(args.batch - 1) // args.groups), vocab, seed + 1, args.short, 1).prompts
    return long + [p for p in short for _ in range(args.groups)][:args.batch - 1]


def run(args: argparse.Namespace, path: str, ratio: float, cascade: bool) -> None:
    from rollout.engine import Engine
    from rollout.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=args.output_len, temperature=1.0, ignore_eos=True)
    with Engine(path, skip_tokenizer_init=True, decode_balance_ratio=ratio, disable_cascade_attn=not cascade,
                kv_cache_dtype=args.kv_cache_dtype, seed=0) as engine:
        vocab = engine.model_config.vocab_size
        engine.generate(prompt_token_ids=straggler_prompts(args, vocab, 11), sampling_params=params, use_tqdm=False)
        engine.flush_cache()
        before = engine.get_step_stats(reset=True)  # the cascade counts are never reset
        start = time.perf_counter()
        engine.generate(prompt_token_ids=straggler_prompts(args, vocab, 23), sampling_params=params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        stats = engine.get_step_stats(reset=True)
    decode = stats.get("decode") or {}
    steps = sum(e["steps"] for e in decode.values())
    seconds = sum(e["seconds"] for e in decode.values())
    cascade_steps = stats.get("cascade_steps", 0) - before.get("cascade_steps", 0)
    prefill_s = stats.get("prefill", {}).get("seconds", 0)
    print(f"cascade {'on' if cascade else 'off'}, ratio {ratio}: {elapsed:.2f} s in all, decode {seconds:.2f} s over "
          f"{steps} steps ({1e3 * seconds / max(steps, 1):.2f} ms a step), prefill {prefill_s:.2f} s; "
          f"cascade steps {cascade_steps}; graph replays {stats.get('graph_replays')}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--long", type=int, default=16384)
    p.add_argument("--short", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--ratios", default="inf,4")
    p.add_argument("--groups", type=int, default=1, help="copies of each short prompt (GRPO's N)")
    p.add_argument("--cascade", default="on", help="cascade decode settings to run: on, off or on,off")
    p.add_argument("--kv-cache-dtype", default="auto", help="the engines' KV cache dtype (auto, fp8_e4m3)")
    args = p.parse_args()
    path = write_preset(args.preset)
    for cascade in args.cascade.split(","):
        for ratio in args.ratios.split(","):
            run(args, path, float(ratio), cascade == "on")


if __name__ == "__main__":
    main()
