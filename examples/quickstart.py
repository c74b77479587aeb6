"""Roll out a small batch on the default model (SmolLM2-135M-Instruct) with the Python API.

    python examples/quickstart.py [--model DIR] [--device cpu|cuda] [--tp-size N]
"""

import argparse

from rollout import Engine, SamplingParams
from rollout.default_model import ensure_default_model

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 7 times 8?",
             "Write a haiku about the sea."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory (default: the converted SmolLM2)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--tp-size", type=int, default=1)
    args = parser.parse_args()
    model = args.model or ensure_default_model()
    with Engine(model, tp_size=args.tp_size, device=args.device) as engine:
        chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
        greedy = engine.chat(chats, SamplingParams(temperature=0.0, max_new_tokens=64))
        for q, out in zip(QUESTIONS, greedy):
            print(f"Q: {q}\nA: {out.outputs[0].text.strip()}\n")
        group = engine.chat(chats[:1], SamplingParams(temperature=0.8, n=4, max_new_tokens=32, seed=0, logprobs=0))[0]
        print(f"4 samples of one prompt (prompt computed once; {group.num_cached_tokens} cached tokens reused):")
        for c in group.outputs:
            print(f"  [{c.index}] logprob {c.cumulative_logprob:7.2f}  {c.text.strip()!r}")


if __name__ == "__main__":
    main()
