"""The engine against transformers on tiny random checkpoints: greedy ids and logprobs (float32, CPU)."""

from __future__ import annotations

import pytest

from conftest import prompts_of_lengths
from rollout import Engine, SamplingParams

LENGTHS = [3, 17, 5, 40, 9, 1, 26, 12, 64, 7]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_and_logprobs_match_transformers(arch, tiny_dir, hf_reference):
    path = tiny_dir(arch)
    prompts = prompts_of_lengths(LENGTHS, seed=1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True, logprobs=0)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, ignore_eos=True, logprobs=0, seed=7)
    with Engine(path, dtype="float32", device="cpu") as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
        samples = engine.generate(prompt_token_ids=prompts, sampling_params=sampled, use_tqdm=False)
    hf = hf_reference(path)
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0]
        assert out.prompt_token_ids == prompt
        assert got.token_ids == hf.greedy(prompt, 16), f"prompt of {len(prompt)} tokens"
        assert got.finish_reason == "length"
        ref = hf.logprobs(prompt, got.token_ids)
        assert max(abs(a - b) for a, b in zip(got.token_logprobs, ref)) < 1e-4
    for prompt, out in zip(prompts, samples):
        got = out.outputs[0]
        assert len(got.token_ids) == 12
        ref = hf.logprobs(prompt, got.token_ids)
        assert max(abs(a - b) for a, b in zip(got.token_logprobs, ref)) < 1e-4
