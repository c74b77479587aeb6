"""Tensor parallelism on CPU (gloo, two scheduler processes) gives the same tokens as TP=1 and transformers."""

from __future__ import annotations

import pytest

from conftest import prompts_of_lengths
from rollout import Engine, SamplingParams


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen3", {}), ("qwen2", {"num_key_value_heads": 1})])
def test_tp2_matches_tp1(arch, overrides, tiny_dir, hf_reference, tmp_path):
    path = tiny_dir(arch, **overrides)
    prompts = prompts_of_lengths([4, 19, 33, 8, 11, 2, 27, 15], seed=3)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, logprobs=0)
    seeded = SamplingParams(temperature=0.8, max_new_tokens=12, ignore_eos=True, seed=5)
    with Engine(path, tp_size=2, dtype="float32", device="cpu") as tp2:
        out2 = tp2.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        traces = tp2.start_profile(output_dir=str(tmp_path))["traces"]  # one trace per rank, one name
        sampled2 = tp2.generate(prompt_token_ids=prompts, sampling_params=seeded, use_tqdm=False)
        assert tp2.stop_profile()["steps"] >= 12 and traces == [str(p) for p in sorted(tmp_path.iterdir())]
    with Engine(path, tp_size=1, dtype="float32", device="cpu") as tp1:
        out1 = tp1.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        sampled1 = tp1.generate(prompt_token_ids=prompts, sampling_params=seeded, use_tqdm=False)
    # every subprocess ended cleanly by itself: no rank aborted at exit (gloo's threads against finalization)
    for engine in (tp2, tp1):
        assert engine._procs.exit_codes and set(engine._procs.exit_codes.values()) == {0}, engine._procs.exit_codes
    hf = hf_reference(path)
    for prompt, a, b in zip(prompts, out1, out2):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == hf.greedy(prompt, 12)
        assert max(abs(x - y) for x, y in zip(a.outputs[0].token_logprobs, b.outputs[0].token_logprobs)) < 1e-4
    assert [o.outputs[0].token_ids for o in sampled1] == [o.outputs[0].token_ids for o in sampled2]
