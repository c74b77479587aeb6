"""Prefix cache, n-sample sharing, chunked prefill, KV pressure, seeds and stop strings, against transformers;
each with KV pages of 1 token and of 4 (``page_size``: prefixes shared in whole pages)."""

from __future__ import annotations

import pytest

from conftest import prompts_of_lengths
from rollout import Engine, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=[1, 4], ids=["page1", "page4"])
def page(request):
    return request.param


@pytest.fixture(scope="module")
def engine(path, page):
    with Engine(path, dtype="float32", device="cpu", page_size=page) as e:
        yield e


@pytest.fixture(scope="module")
def chunked_engine(path, page):
    with Engine(path, dtype="float32", device="cpu", chunked_prefill_size=4, max_prefill_tokens=8, page_size=page) as e:
        yield e


def whole_pages(n: int, page: int) -> int:
    return n - n % page


def test_common_prefix_is_shared_and_exact(engine, path, page, hf_reference):
    hf = hf_reference(path)
    prefix = prompts_of_lengths([30], seed=11)[0]
    suffixes = prompts_of_lengths([1, 4, 2, 7, 3, 5, 6, 2], seed=12)
    params = SamplingParams(max_new_tokens=10, **GREEDY)
    first = engine.generate(prompt_token_ids=[prefix + suffixes[0]], sampling_params=params, use_tqdm=False)[0]
    outs = engine.generate(prompt_token_ids=[prefix + s for s in suffixes[1:]], sampling_params=params,
                           use_tqdm=False)
    for s, out in zip(suffixes, [first] + outs):
        assert out.outputs[0].token_ids == hf.greedy(prefix + s, 10)
    assert all(out.num_cached_tokens >= whole_pages(30, page) for out in outs)


def test_common_prefix_submitted_together(engine, path, page, hf_reference):
    hf = hf_reference(path)
    prefix = prompts_of_lengths([40], seed=21)[0]
    prompts = [prefix + s for s in prompts_of_lengths([3, 5, 2, 8, 4, 6, 1, 7], seed=22)]
    outs = engine.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_new_tokens=8, **GREEDY),
                           use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf.greedy(prompt, 8)
    assert sum(out.num_cached_tokens >= whole_pages(40, page) for out in outs) >= len(prompts) - 1


def test_n_samples_share_the_prompt(engine, path, page, hf_reference):
    prompt = prompts_of_lengths([25], seed=31)[0]
    out = engine.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(n=8, max_new_tokens=12, **GREEDY),
                          use_tqdm=False)[0]
    expected = hf_reference(path).greedy(prompt, 12)
    assert len(out.outputs) == 8 and [o.index for o in out.outputs] == list(range(8))
    assert all(o.token_ids == expected for o in out.outputs)
    assert out.num_cached_tokens == whole_pages(len(prompt) - 1, page)


def test_chunked_prefill_is_exact(chunked_engine, path, hf_reference):
    hf = hf_reference(path)
    prompts = prompts_of_lengths([33, 5, 19, 2, 50, 11, 8, 27], seed=41)
    outs = chunked_engine.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_new_tokens=10, **GREEDY),
                                   use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf.greedy(prompt, 10)


def test_tiny_kv_pool_retracts_and_finishes_everything(path, page, hf_reference):
    """With no reserve for the running requests' next tokens (schedule_conservativeness 0) a tiny pool admits
    everything and must retract; SGLang's estimate (the default) admits fewer at once and retracts less.
    Both finish every request exactly as transformers does."""
    hf = hf_reference(path)
    prompts = prompts_of_lengths([12, 20, 9, 15, 18, 7, 22, 14], seed=51)
    params = SamplingParams(max_new_tokens=24, logprobs=0, **GREEDY)
    retractions = {}
    for conservativeness in (0.0, 1.0):
        with Engine(path, dtype="float32", device="cpu", max_total_tokens=96, page_size=page,
                    schedule_conservativeness=conservativeness) as engine:
            outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            info = engine.get_server_info()
        assert info["max_total_tokens"] == 96
        retractions[conservativeness] = info["retractions"]
        for prompt, out in zip(prompts, outs):
            got = out.outputs[0]
            assert got.finish_reason == "length"
            assert got.token_ids == hf.greedy(prompt, 24)
            assert max(abs(a - b) for a, b in zip(got.token_logprobs, hf.logprobs(prompt, got.token_ids))) < 1e-4
    assert retractions[0.0] > 0
    assert retractions[1.0] < retractions[0.0]


def test_seeded_sampling_reproducible_across_batches_and_engines(engine, chunked_engine):
    target = prompts_of_lengths([14], seed=61)[0]
    others = prompts_of_lengths([5, 30, 9, 21], seed=62)
    seeded = SamplingParams(temperature=1.0, top_k=50, max_new_tokens=20, seed=1234, ignore_eos=True)
    free = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True)

    def run(e, companions, order_first):
        prompts = [target] + companions if order_first else companions + [target]
        params = [seeded] + [free] * len(companions) if order_first else [free] * len(companions) + [seeded]
        outs = e.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return outs[0 if order_first else -1].outputs[0].token_ids

    a = run(engine, [], True)
    assert a == run(engine, others, False) == run(engine, others[:2], True) == run(chunked_engine, others, True)
    other_seed = engine.generate(prompt_token_ids=[target], sampling_params=seeded.clone(seed=99), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != a
    n_out = engine.generate(prompt_token_ids=[target], sampling_params=seeded.clone(n=4), use_tqdm=False)[0]
    assert n_out.outputs[0].token_ids == a
    assert len({tuple(o.token_ids) for o in n_out.outputs}) == 4


def test_stop_strings_trim_text(engine):
    prompt = "the sky is blue and the sun"
    base = engine.generate([prompt], SamplingParams(max_new_tokens=30, **GREEDY), use_tqdm=False)[0].outputs[0]
    text = base.text
    assert len(text) > 8
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text.index(stop)
    out = engine.generate([prompt], SamplingParams(max_new_tokens=30, stop=[stop], **GREEDY), use_tqdm=False)[0]
    got = out.outputs[0]
    assert got.text == text[:cut]
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert got.token_ids == base.token_ids[:len(got.token_ids)]
    kept = engine.generate([prompt], SamplingParams(max_new_tokens=30, stop=[stop], include_stop_str_in_output=True,
                                                    **GREEDY), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:cut + len(stop)]


def test_stop_token_ids_and_min_new_tokens(engine):
    prompt = prompts_of_lengths([10], seed=71)[0]
    base = engine.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_new_tokens=12, **GREEDY),
                           use_tqdm=False)[0].outputs[0].token_ids
    stop_id = base[5]
    first = base.index(stop_id)
    out = engine.generate(prompt_token_ids=[prompt], use_tqdm=False,
                          sampling_params=SamplingParams(max_new_tokens=12, stop_token_ids=[stop_id], **GREEDY))
    assert out[0].outputs[0].token_ids == base[:first + 1]
    assert out[0].outputs[0].finish_reason == "stop" and out[0].outputs[0].stop_reason == stop_id
