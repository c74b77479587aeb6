"""The bench's workload (random token-id prompts with exact output lengths) and one timed run's result."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Workload:
    """Prompts (random token ids) and each prompt's exact output length."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_prompts: int, vocab_size: int, seed: int, input_len: int, output_len: int,
                  length_range: tuple[int, int] | None = None) -> Workload:
    """``num_prompts`` prompts of uniform random token ids in [0, vocab). Fixed lengths, or with
    ``length_range=(lo, hi)`` input and output lengths each drawn uniformly from [lo, hi] (nano-vllm)."""
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_prompts):
        n_in = rng.randint(*length_range) if length_range else input_len
        n_out = rng.randint(*length_range) if length_range else output_len
        prompts.append([rng.randrange(vocab_size) for _ in range(n_in)])
        outs.append(n_out)
    return Workload(prompts, outs)


@dataclass
class RunResult:
    """One timed generation run: token counts and wall time."""

    num_requests: int
    input_tokens: int
    output_tokens: int
    elapsed_s: float

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "output_tok_s": self.output_tok_s, "total_tok_s": self.total_tok_s}
