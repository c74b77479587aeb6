"""``kv_cache_dtype`` fp8: the engine against transformers whose attention reads float8-rounded K and V.

The reference is transformers' own model with an attention function (registered through
``AttentionInterface``) that rounds the post-RoPE keys and the values to the float8 type, unit scale,
before SDPA: exactly what an fp8 KV cache stores. Queries, weights and activations stay float32.
"""

from __future__ import annotations

import pytest
import torch

from conftest import prompts_of_lengths
from rollout import Engine, SamplingParams
from rollout.config import EngineConfig, kv_cache_torch_dtype
from reference import hf_greedy, hf_logprobs, rounded_kv_attention

LENGTHS = [3, 17, 40, 1, 26, 64]


def hf_with_fp8_kv(path: str, kv_dtype: torch.dtype):
    """transformers, float32, with K and V rounded to ``kv_dtype`` as attention reads them."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation=rounded_kv_attention(kv_dtype)).eval()


def shared_prefix_prompts() -> list[list[int]]:
    """Plain prompts plus two that extend the first: the second pass reads fp8 KV from the prefix cache."""
    prompts = prompts_of_lengths(LENGTHS, seed=3)
    return prompts + [prompts[1] + [7, 8, 9], prompts[2][:30] + [11]]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp8_kv_matches_transformers_reading_fp8_kv(arch, kv_cache_dtype, tiny_dir, hf_reference):
    path = tiny_dir(arch)
    prompts = shared_prefix_prompts()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, logprobs=0)
    with Engine(path, dtype="float32", device="cpu", kv_cache_dtype=kv_cache_dtype) as engine:
        first = engine.generate(prompt_token_ids=prompts[:len(LENGTHS)], sampling_params=greedy, use_tqdm=False)
        second = engine.generate(prompt_token_ids=prompts[len(LENGTHS):], sampling_params=greedy, use_tqdm=False)
    assert [o.num_cached_tokens for o in second] == [len(prompts[1]), 30]
    ref = hf_with_fp8_kv(path, kv_cache_torch_dtype(kv_cache_dtype, torch.float32))
    plain = hf_reference(path)
    gap_to_unrounded = 0.0
    for prompt, out in zip(prompts, first + second):
        got = out.outputs[0]
        assert got.token_ids == hf_greedy(ref, prompt, 12, None), f"prompt of {len(prompt)} tokens"
        want = hf_logprobs(ref, prompt, got.token_ids)
        assert max(abs(a - b) for a, b in zip(got.token_logprobs, want)) < 1e-4
        unrounded = plain.logprobs(prompt, got.token_ids)
        gap_to_unrounded = max(gap_to_unrounded, max(abs(a - b) for a, b in zip(got.token_logprobs, unrounded)))
    # the reference is not the plain model in disguise: fp8 rounding moves the logprobs well past 1e-4
    assert gap_to_unrounded > 1e-3


def test_fp8_pool_holds_four_times_the_float32_slots(tiny_dir):
    path = tiny_dir("llama")
    slots = {}
    for kv in ("auto", "fp8_e4m3"):
        with Engine(path, dtype="float32", device="cpu", cpu_kv_cache_gb=0.01, kv_cache_dtype=kv,
                    max_running_requests=4, context_length=64) as engine:
            slots[kv] = engine.get_server_info()["max_total_tokens"]
    # 10 MiB at 2 layers x 2 KV heads x 16 dims x (K, V): 128 elements per token, 4 bytes vs 1 byte,
    # each capped by max_running_requests x context
    per_token = 2 * 2 * 2 * 16
    assert slots["auto"] == min(int(0.01 * 2**30) // (per_token * 4), 4 * 64)
    assert slots["fp8_e4m3"] == min(int(0.01 * 2**30) // per_token, 4 * 64)


def test_unknown_kv_cache_dtype_or_decode_backend_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model_path="x", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="decode_attention_backend"):
        EngineConfig(model_path="x", decode_attention_backend="fa3")
