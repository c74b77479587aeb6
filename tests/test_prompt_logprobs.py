"""Prompt (input) logprobs equal transformers' teacher-forced logprobs (float32, 1e-5): through chunked
prefill, prefix-cache hits, TP=2, streams and n > 1; over HTTP in the exact request shapes that
lm-evaluation-harness 0.4.13 sends for loglikelihood (``local-completions``: echo; ``sglang-generate``:
``logprob_start_len``), parsed the way it parses them."""

from __future__ import annotations

import pytest
import torch

from conftest import prompts_of_lengths
from rollout import Engine, SamplingParams
from server_harness import server_client

TOL = 1e-5


def teacher_forced(model, prompt: list[int], k: int) -> tuple[list[float], list[list[int]]]:
    """transformers: logprob of each prompt token after the first, and the top-k ids at each position."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    token = [lp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    top = [lp[i - 1].topk(k).indices.tolist() for i in range(1, len(prompt))] if k else []
    return token, top


def check(out, model, prompt: list[int], k: int, start: int = 0) -> None:
    token, top = teacher_forced(model, prompt, k)
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and all(e is None for e in plp[:start + 1])
    for pos in range(start + 1, len(prompt)):
        entry = plp[pos]
        assert abs(entry[prompt[pos]].logprob - token[pos - 1]) < TOL, pos
        if k:  # the entry holds the prompt token (its true rank) and the top-k (ranks 1..k)
            ranked = sorted(entry.items(), key=lambda item: item[1].rank)
            assert [tid for tid, lp in ranked if lp.rank <= k] == top[pos - 1], pos


@pytest.fixture(scope="module")
def model(path, hf_reference):
    return hf_reference(path).model


def test_prompt_logprobs_chunked_cached_streamed_and_sampled(path, model):
    prompts = prompts_of_lengths([70, 33, 9], seed=3)
    with Engine(path, dtype="float32", device="cpu", chunked_prefill_size=16, max_prefill_tokens=24) as engine:
        outs = engine.generate(prompt_token_ids=prompts, use_tqdm=False,
                               sampling_params=SamplingParams(max_tokens=4, prompt_logprobs=3, temperature=0))
        for p, out in zip(prompts, outs):  # chunked: the 70-token prompt takes five chunks
            check(out, model, p, 3)
        # the same prompts again: the prefix cache holds them, the logprobs are recomputed, never missing
        again = engine.generate(prompt_token_ids=prompts, use_tqdm=False,
                                sampling_params=SamplingParams(max_tokens=2, prompt_logprobs=0))
        for p, out in zip(prompts, again):
            check(out, model, p, 0)
        # logprob_start_len: earlier positions are None, the cached prefix up to it is reused
        out = engine.generate(prompt_token_ids=[prompts[0]], use_tqdm=False,
                              sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=1, logprob_start_len=50))[0]
        check(out, model, prompts[0], 1, start=50)
        assert out.num_cached_tokens >= 48
        # max_tokens=0: the prompt is only scored
        out = engine.generate(prompt_token_ids=[prompts[1]], use_tqdm=False,
                              sampling_params=SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
        check(out, model, prompts[1], 0)
        # a stream carries them in its first chunk; n > 1 samples share them
        chunks = list(engine.generate(prompt_token_ids=[prompts[2]], stream=True,
                                      sampling_params=SamplingParams(max_tokens=3, prompt_logprobs=2, n=3)))
        assert chunks[0].prompt_logprobs is not None and all(c.prompt_logprobs is None for c in chunks[1:])
        check(chunks[0], model, prompts[2], 2)
        assert len({c.index for ch in chunks for c in ch.outputs}) == 3
        load = engine.get_load()
        assert (load["running"], load["waiting"], load["kv_used"]) == (0, 0, 0)


def test_prompt_logprobs_tp2(path, model):
    prompts = prompts_of_lengths([40, 12], seed=4)
    with Engine(path, dtype="float32", device="cpu", tp_size=2, chunked_prefill_size=16) as engine:
        outs = engine.generate(prompt_token_ids=prompts, use_tqdm=False,
                               sampling_params=SamplingParams(max_tokens=2, prompt_logprobs=2))
    for p, out in zip(prompts, outs):
        check(out, model, p, 2)


# ---- lm-evaluation-harness's loglikelihood requests ---------------------------------------------------


@pytest.fixture(scope="module")
def http(path):
    with server_client(path) as client:
        yield client


def _local_completions_parse(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm_eval.models.openai_completions.LocalCompletionsAPI.parse_logprobs (0.4.13), restated."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        res.append((sum(lps), all(tok == max(top.values()) for tok, top in zip(lps, tops))))
    return res


def test_lm_eval_local_completions_loglikelihood(http, model):
    contexts = prompts_of_lengths([12, 7, 20], seed=5)
    continuations = prompts_of_lengths([3, 1, 5], seed=6)
    prompts = [c + x for c, x in zip(contexts, continuations)]
    body = {"model": None, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}  # LocalCompletionsAPI._create_payload(generate=False)
    body.pop("model")
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    for choice, p in zip(sorted(out["choices"], key=lambda c: c["index"]), prompts):
        assert len(choice["logprobs"]["token_logprobs"]) == len(p) + 1
        assert choice["logprobs"]["token_logprobs"][0] is None and choice["logprobs"]["top_logprobs"][0] is None
    got = _local_completions_parse(out, [len(c) for c in contexts])
    for (total, greedy), ctx, cont in zip(got, contexts, continuations):
        token, top = teacher_forced(model, ctx + cont, 1)
        want = token[len(ctx) - 1:]
        assert abs(total - sum(want)) < TOL * len(want)
        assert greedy == all(t == (ctx + cont)[len(ctx) + i] for i, t in enumerate(x[0] for x in top[len(ctx) - 1:]))


def test_lm_eval_sglang_generate_loglikelihood(http, model):
    ctx, cont = prompts_of_lengths([10, 4], seed=7)
    body = {"input_ids": [ctx + cont], "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "logprob_start_len": 0, "top_logprobs_num": 1, "return_logprob": True}  # SGLANGGENERATEAPI
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    (item,) = r.json()
    meta = item["meta_info"]
    assert len(meta["input_token_logprobs"]) == len(ctx + cont) and meta["input_token_logprobs"][0][0] is None
    assert [x[1] for x in meta["input_token_logprobs"]] == ctx + cont
    total = sum(x[0] for x in meta["input_token_logprobs"][len(ctx):])  # SGLANGGENERATEAPI.parse_logprobs
    token, top = teacher_forced(model, ctx + cont, 1)
    assert abs(total - sum(token[len(ctx) - 1:])) < TOL * len(cont)
    assert [y[0][1] for y in meta["input_top_logprobs"][1:]] == [t[0] for t in top]
