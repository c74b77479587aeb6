"""Mixed prefill/decode steps (``enable_mixed_chunk``, SGLang's mixed chunk): prefill steps also decode the
running requests. Outputs equal transformers (greedy ids, logprobs within 1e-5) and seeded samples equal those
of an engine without mixing, at TP=1 and TP=2, for a dense and an MoE model (with its routing)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import prompts_of_lengths
from rollout import Engine, SamplingParams

LENGTHS = [3, 47, 5, 60, 9, 1, 33, 12, 25, 7, 40, 18]
# few running slots and small prefill steps: prompts keep arriving while others decode, in chunks
OPTIONS = dict(dtype="float32", device="cpu", max_running_requests=4, chunked_prefill_size=16, max_prefill_tokens=32)


@pytest.mark.parametrize("arch,tp", [("llama", 1), ("qwen3", 2)])
def test_mixed_steps_match_transformers_and_unmixed_sampling(arch, tp, tiny_dir, hf_reference):
    path = tiny_dir(arch)
    prompts = prompts_of_lengths(LENGTHS, seed=5)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=14, ignore_eos=True, logprobs=0)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=14, ignore_eos=True, seed=11, logprobs=0)
    with Engine(path, tp_size=tp, enable_mixed_chunk=True, **OPTIONS) as mixed:
        outs = mixed.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
        samples = mixed.generate(prompt_token_ids=prompts, sampling_params=seeded, use_tqdm=False)
        assert mixed.get_step_stats()["mixed_steps"] > 0, "no step mixed prefill and decode"
    with Engine(path, tp_size=tp, **OPTIONS) as plain:
        reference_samples = plain.generate(prompt_token_ids=prompts, sampling_params=seeded, use_tqdm=False)
        stats = plain.get_step_stats()
        assert stats["mixed_steps"] == 0 and stats["graph_replays"] == {}  # CPU: no CUDA graphs
    hf = hf_reference(path)
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0]
        assert got.token_ids == hf.greedy(prompt, 14), f"prompt of {len(prompt)} tokens"
        assert max(abs(a - b) for a, b in zip(got.token_logprobs, hf.logprobs(prompt, got.token_ids))) < 1e-5
    for prompt, a, b in zip(prompts, samples, reference_samples):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        ref = hf.logprobs(prompt, a.outputs[0].token_ids)
        assert max(abs(x - y) for x, y in zip(a.outputs[0].token_logprobs, ref)) < 1e-5


def test_mixed_steps_keep_moe_routing_exact(tiny_dir, hf_reference):
    from test_moe import hf_routing, moe_path

    path = moe_path(tiny_dir, "qwen3_moe")
    model = hf_reference(path).model
    prompts = prompts_of_lengths(LENGTHS[:8], seed=6)
    params = SamplingParams(temperature=0.0, max_new_tokens=9, ignore_eos=True, return_routed_experts=True)
    with Engine(path, enable_mixed_chunk=True, enable_return_routed_experts=True, **OPTIONS) as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert engine.get_step_stats()["mixed_steps"] > 0
    for prompt, out in zip(prompts, outs):
        seq = prompt + out.outputs[0].token_ids
        np.testing.assert_array_equal(out.outputs[0].routed_experts, hf_routing(model, seq[:-1]))
