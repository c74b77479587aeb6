"""Where a decode step's time goes: run the engine with ROLLOUT_PROFILE_DIR set, print the top of the
scheduler's cProfile.   python tools/profile_decode.py --preset qwen3-0.6b --batch 1 --steps 200"""

from __future__ import annotations

import argparse
import os
import pstats
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/ of the checkout


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    out = tempfile.mkdtemp()
    os.environ["ROLLOUT_PROFILE_DIR"] = out
    from benchmarks.presets import write_preset
    from rollout import Engine, SamplingParams

    path = write_preset(args.preset)
    with Engine(path, dtype="bfloat16", skip_tokenizer_init=True) as engine:
        params = SamplingParams(temperature=0.6, max_new_tokens=args.steps, ignore_eos=True)
        prompts = [[5 + i] * 100 for i in range(args.batch)]
        engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        engine.get_step_stats(reset=True)
        engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        stats = engine.get_step_stats()
    print({b: round(v["seconds"] / v["steps"] * 1e3, 3) for b, v in stats["decode"].items()}, "ms per decode step")
    st = pstats.Stats(os.path.join(out, "scheduler-tp0.prof"))
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
