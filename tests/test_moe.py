"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers on tiny random checkpoints (float32,
CPU): greedy ids and logprobs at TP=1 and TP=2, and rollout routing replay (``return_routed_experts``)
against the top-k indices of transformers' own routers on the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import prompts_of_lengths
from rollout import Engine, SamplingParams
from rollout.io_struct import FinishReason, TokenOut
from rollout.request_state import ReqState, build_output

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, logprobs=0)
MOE_VARIANTS = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe_dense_layers": ("qwen3_moe", {"num_hidden_layers": 4, "mlp_only_layers": [0],
                                             "decoder_sparse_step": 2, "norm_topk_prob": False}),
    "mixtral": ("mixtral", {}),
}


def moe_path(tiny_dir, variant: str) -> str:
    arch, overrides = MOE_VARIANTS[variant]
    return tiny_dir(arch, **overrides)


def assert_matches_transformers(outs, prompts, hf, max_new_tokens: int = 12) -> None:
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0]
        assert got.token_ids == hf.greedy(prompt, max_new_tokens), f"prompt of {len(prompt)} tokens"
        ref = hf.logprobs(prompt, got.token_ids)
        assert max(abs(a - b) for a, b in zip(got.token_logprobs, ref)) < 1e-5


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_moe_greedy_and_logprobs_match_transformers_tp1_and_tp2(variant, tiny_dir, hf_reference):
    path = moe_path(tiny_dir, variant)
    prompts = prompts_of_lengths([3, 17, 5, 40, 9, 1, 26], seed=1)
    hf = hf_reference(path)
    for tp in (1, 2):
        with Engine(path, tp_size=tp, dtype="float32", device="cpu") as engine:
            outs = engine.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert_matches_transformers(outs, prompts, hf)


def test_moe_chunked_prefill_and_prefix_hits_match_transformers(tiny_dir, hf_reference):
    path = moe_path(tiny_dir, "qwen3_moe")
    hf = hf_reference(path)
    prompts = prompts_of_lengths([45, 30], seed=4)
    with Engine(path, dtype="float32", device="cpu", chunked_prefill_size=16) as engine:
        first = engine.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        again = engine.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in again)
    assert_matches_transformers(first, prompts, hf)
    assert_matches_transformers(again, prompts, hf)


# ---- routing replay ---------------------------------------------------------------------------------------

def hf_routing(model, token_ids: list[int]) -> np.ndarray:
    """transformers' routing of ``token_ids`` (one forward): int [len, num_layers, top_k], the top-k indices
    of each sparse layer's router (its ``gate``), -1 on dense layers."""
    layers = model.model.layers
    top_k = model.config.num_experts_per_tok
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(layers):
        router = getattr(layer.mlp, "gate", None)
        if router is not None and not hasattr(layer.mlp, "gate_proj"):  # a sparse block's router
            hooks.append(router.register_forward_hook(
                lambda mod, args, out, i=i: captured.__setitem__(i, out[2].reshape(-1, top_k))))
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]))
    finally:
        for h in hooks:
            h.remove()
    out = np.full((len(token_ids), len(layers), top_k), -1, dtype=np.int64)
    for i, ids in captured.items():
        out[:, i] = ids.numpy()
    return out


@pytest.mark.parametrize("variant,tp,chunk", [("qwen3_moe_dense_layers", 1, 8192), ("mixtral", 1, 16),
                                              ("qwen3_moe", 2, 16)])
def test_routed_experts_equal_transformers_routers(variant, tp, chunk, tiny_dir, hf_reference):
    """Fresh prompts, then prompts that extend an earlier prompt and its output (a prefix-cache hit that
    covers generated tokens too), with chunked prefill: every row equals transformers' routing."""
    path = moe_path(tiny_dir, variant)
    model = hf_reference(path).model
    prompts = prompts_of_lengths([3, 21, 40, 9], seed=2)
    params = SamplingParams(temperature=0.0, max_new_tokens=7, ignore_eos=True, return_routed_experts=True)
    with Engine(path, tp_size=tp, dtype="float32", device="cpu", chunked_prefill_size=chunk,
                enable_return_routed_experts=True) as engine:
        first = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        follow = [p + o.outputs[0].token_ids + [11, 12] for p, o in zip(prompts, first)]
        second = engine.generate(prompt_token_ids=follow, sampling_params=params.clone(routed_experts_start_len=5),
                                 use_tqdm=False)
    assert all(o.num_cached_tokens >= len(p) for o, p in zip(second, prompts)), "no prefix-cache hit"
    for batch, start in ((zip(prompts, first), 0), (zip(follow, second), 5)):
        for prompt, out in batch:
            seq = prompt + out.outputs[0].token_ids
            got = out.outputs[0].routed_experts
            assert got.dtype == np.int32 and got.shape == (len(seq) - 1 - start, model.config.num_hidden_layers,
                                                           model.config.num_experts_per_tok)
            np.testing.assert_array_equal(got, hf_routing(model, seq[:-1])[start:])


@pytest.fixture(scope="module")
def routing_engine(tiny_dir):
    """An engine on the tiny Qwen3-MoE with ``enable_return_routed_experts``, shared by the tests below."""
    with Engine(moe_path(tiny_dir, "qwen3_moe"), dtype="float32", device="cpu",
                enable_return_routed_experts=True) as engine:
        yield engine


def test_routed_experts_are_only_returned_when_asked_and_stream_ends_with_them(routing_engine):
    engine = routing_engine
    params = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    (plain,) = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, use_tqdm=False)
    chunks = list(engine.generate(prompt_token_ids=[[5, 6, 7]], stream=True,
                                  sampling_params=params.clone(return_routed_experts=True)))
    assert plain.outputs[0].routed_experts is None
    assert all(c.outputs[0].routed_experts is None for c in chunks[:-1])
    assert chunks[-1].outputs[0].routed_experts.shape == (3 + 5 - 1, 2, 2)


def test_a_stream_delivers_each_samples_routed_experts_once():
    """Delta chunks carry only what is new: a sample of an n > 1 stream that finished first came back in every
    later chunk (with no new tokens) still carrying its whole routed_experts array."""
    state = ReqState("r", None, [5, 6, 7], SamplingParams(n=2, max_new_tokens=4), lambda s: None)
    rows = [np.full((3 + k - 1, 2, 2), i, dtype=np.int32) for i, k in enumerate((2, 4))]
    state.apply(0, TokenOut("r", [8, 9], finished=FinishReason("length"), routed_experts=rows[0]))
    state.apply(1, TokenOut("r", [10, 11]))
    first = build_output(state, None, delta=True)
    state.apply(1, TokenOut("r", [12, 13], finished=FinishReason("length"), routed_experts=rows[1]))
    second = build_output(state, None, delta=True)
    assert first.outputs[0].routed_experts is rows[0] and first.outputs[1].routed_experts is None
    assert second.outputs[0].routed_experts is None and second.outputs[0].token_ids == []
    assert second.outputs[1].routed_experts is rows[1]
    whole = build_output(state, None)  # a whole output always carries them
    assert whole.outputs[0].routed_experts is rows[0] and whole.outputs[1].routed_experts is rows[1]


def test_routed_experts_bad_requests_are_clear_errors(tiny_dir, path, routing_engine):
    moe = moe_path(tiny_dir, "qwen3_moe")
    ask = SamplingParams(max_new_tokens=2, return_routed_experts=True)
    with Engine(path, dtype="float32", device="cpu", enable_return_routed_experts=True) as dense:
        with pytest.raises(ValueError, match="needs a mixture-of-experts model; LlamaForCausalLM"):
            dense.generate(prompt_token_ids=[[5, 6]], sampling_params=ask)
    with Engine(moe, dtype="float32", device="cpu") as off:
        with pytest.raises(ValueError, match="enable_return_routed_experts=True"):
            off.generate(prompt_token_ids=[[5, 6]], sampling_params=ask)
        assert off.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="return_routed_experts must be a bool"):
        SamplingParams(return_routed_experts="yes")
    with pytest.raises(ValueError, match="routed_experts_start_len must be in"):
        SamplingParams(routed_experts_start_len=-1)
    with pytest.raises(ValueError, match=r"routed_experts_start_len \(3\) must be at most the prompt length \(2\)"):
        routing_engine.generate(prompt_token_ids=[[5, 6]], sampling_params=ask.clone(routed_experts_start_len=3))


def test_an_aborted_request_returns_the_routing_of_its_partial_tokens(tiny_dir, hf_reference, routing_engine):
    """SGLang finishes an aborted running request like any other (``maybe_collect_routed_experts`` once it is
    finished), so its final output carries the routing of the tokens it generated: what a partial rollout
    (``pause_generation(mode="abort")``, then resubmitted) replays. Here an abort returned no routing."""
    path = moe_path(tiny_dir, "qwen3_moe")
    model = hf_reference(path).model
    prompt = [5, 6, 7, 8]
    params = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True, return_routed_experts=True)
    stream = routing_engine.generate(prompt_token_ids=[prompt], sampling_params=params, stream=True, request_id="r")
    chunks = [next(stream)]
    assert routing_engine.abort("r")
    chunks += list(stream)
    last = chunks[-1].outputs[0]
    tokens = [t for c in chunks for t in c.outputs[0].token_ids]
    assert last.finish_reason == "abort" and 0 < len(tokens) < 400
    seq = prompt + tokens
    assert last.routed_experts is not None and last.routed_experts.shape == (len(seq) - 1, 2, 2)
    np.testing.assert_array_equal(last.routed_experts, hf_routing(model, seq[:-1]))


def test_a_max_tokens_0_request_returns_the_routing_of_its_prompt(tiny_dir, hf_reference):
    """``max_tokens=0`` with ``return_routed_experts`` (scoring a given sequence's routing, as SGLang answers
    it): the prompt is prefilled and its rows ``[routed_experts_start_len, prompt - 1)`` come back. It finished
    without a prefill and returned none, unless prompt logprobs were asked for too."""
    path = moe_path(tiny_dir, "qwen3_moe_dense_layers")
    model = hf_reference(path).model
    prompt = prompts_of_lengths([9], seed=3)[0]
    ask = SamplingParams(max_tokens=0, return_routed_experts=True)
    with Engine(path, dtype="float32", device="cpu", enable_return_routed_experts=True) as engine:
        outs = engine.generate(prompt_token_ids=[prompt, prompt], use_tqdm=False,
                               sampling_params=[ask, ask.clone(routed_experts_start_len=4)])
        (plain,) = engine.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=0),
                                   use_tqdm=False)
    want = hf_routing(model, prompt[:-1])
    for out, start in zip(outs, (0, 4)):
        got = out.outputs[0]
        assert got.token_ids == [] and got.finish_reason == "length"
        assert got.routed_experts is not None, "no routing for a max_tokens=0 request"
        np.testing.assert_array_equal(got.routed_experts, want[start:])
    assert plain.outputs[0].routed_experts is None and plain.outputs[0].finish_reason == "length"


def test_multi_turn_rows_concatenate_with_start_len_the_rows_already_held(tiny_dir, hf_reference, routing_engine):
    """docs/moe.md's multi-turn recipe: the next turn's prompt is the previous prompt + completion + new tokens,
    asked with ``routed_experts_start_len`` = the rows already held (previous sequence length - 1, since its
    last token went through the model only in the next turn); the concatenated rows are the routing of every
    input position of the whole sequence. The docs said the previous sequence length, which drops that row."""
    path = moe_path(tiny_dir, "qwen3_moe")
    model = hf_reference(path).model
    prompt = prompts_of_lengths([11], seed=5)[0]
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, return_routed_experts=True)
    engine = routing_engine
    (first,) = engine.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    held = first.outputs[0].routed_experts
    turn2 = prompt + first.outputs[0].token_ids + [7, 8, 9]
    assert len(held) == len(prompt) + len(first.outputs[0].token_ids) - 1
    (second,) = engine.generate(prompt_token_ids=[turn2], use_tqdm=False,
                                sampling_params=params.clone(routed_experts_start_len=len(held)))
    seq = turn2 + second.outputs[0].token_ids
    rows = np.concatenate([held, second.outputs[0].routed_experts])
    np.testing.assert_array_equal(rows, hf_routing(model, seq[:-1]))


def test_the_greedy_oracle_attends_a_prompt_token_0(tiny_dir, hf_reference):
    """``hf_greedy`` (the tests' and rollout-smoke's greedy reference) passes ``generate`` a mask of every prompt
    token: without it ``generate`` took the prompt's token 0 (its pad id when no EOS is given) for padding and
    masked it, so a follow-up prompt holding a sampled 0 got a wrong reference (the engine's tokens looked wrong)."""
    from reference import hf_greedy

    model = hf_reference(moe_path(tiny_dir, "qwen3_moe")).model
    for prompt in prompts_of_lengths([12, 20, 7, 30, 16], seed=6):
        prompt[len(prompt) // 2] = 0
        with torch.no_grad():
            first = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
        assert hf_greedy(model, prompt, 1) == [first]
