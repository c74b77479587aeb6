"""HTTP server behaviour a third fault hunt found wrong (each test failed before its fix): logprobs JSON cannot
carry, request ids a refused duplicate shares, /generate stream indices with mixed n, vLLM's
``continuous_usage_stats``, and the seed's range."""

from __future__ import annotations

import json

import httpx
import pytest

from test_server_api import CHAT, sse_events


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        yield c


def _strict_json(text: str):
    """json.loads that refuses NaN / Infinity (which are not JSON)."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_processed_logprobs_of_ruled_out_tokens_are_valid_json(http, path):
    """With processed logprobs and top_k=1 every alternative's logprob is -inf: the OpenAI endpoints send
    vLLM's -9999.0 and /generate sends null (SGLang's orjson), streamed or not; it was a 500 (non-streamed)
    or '-Infinity' in the event (streamed)."""
    sampling = {"top_k": 1, "logprobs_mode": "processed", "temperature": 1.0}
    body = {"model": path, "prompt": [4, 5, 6], "max_tokens": 3, "logprobs": 2, **sampling}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    lps = _strict_json(r.text)["choices"][0]["logprobs"]
    assert all(v in (0.0, -9999.0) for top in lps["top_logprobs"] for v in top.values()), lps
    assert -9999.0 in lps["top_logprobs"][0].values()
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: {")]
    assert lines and all(_strict_json(line[len("data: "):]) for line in lines)
    chat = {"model": path, "messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, **sampling}
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    top = _strict_json(r.text)["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert [t["logprob"] for t in top] == [0.0, -9999.0], top
    gen = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 3, **sampling}, "return_logprob": True,
           "top_logprobs_num": 2}
    r = http.post("/generate", json=gen)
    assert r.status_code == 200, r.text
    meta = _strict_json(r.text)["meta_info"]
    assert [e[0] for e in meta["output_top_logprobs"][0]] == [0.0, None], meta["output_top_logprobs"]


def test_a_refused_duplicate_request_id_leaves_the_live_request_abortable(http, path):
    """A non-streamed request refused for reusing a live request's id untracked the live request's ids: its
    group id no longer aborted it and ``abort_all`` (also the weight updates' ``abort_all_requests``) missed it."""
    long = {"max_tokens": 480, "temperature": 0, "ignore_eos": True}
    body = {"model": path, "prompt": [[4, 5, 6], [7, 8, 9]], "request_id": "live-dup", "stream": True, **long}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        dup = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
        assert dup.status_code == 400 and "duplicate" in dup.json()["error"]["message"], dup.text
        got = http.post("/abort_request", json={"rid": "live-dup"}).json()
        assert got["success"] is True, got
        events = sse_events(lines)
    reasons = {e["choices"][0]["index"]: e["choices"][0]["finish_reason"] for e in events
               if e["choices"] and e["choices"][0]["finish_reason"]}
    assert reasons == {0: "abort", 1: "abort"}, reasons
    with http.stream("POST", "/v1/completions", json={**body, "request_id": "live-dup2"}) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        again = http.post("/v1/completions", json={**body, "request_id": "live-dup2", "stream": False})
        assert again.status_code == 400, again.text
        got = http.post("/abort_request", json={"abort_all": True}).json()
        assert got["message"] == "aborted 2 request(s)", got
        events = sse_events(lines)
    assert {e["choices"][0]["finish_reason"] for e in events if e["choices"]} >= {"abort"}


def test_generate_stream_indices_follow_the_list_order_when_prompts_ask_for_different_n(http):
    """Streamed /generate events carry ``index``, the (prompt, sample)'s place in the non-streamed list. With
    n = 3 then n = 1 the second prompt's sample was given index 1, the first prompt's second sample's."""
    body = {"input_ids": [[4, 5, 6], [7, 8, 9]], "sampling_params": [
        {"max_new_tokens": 2, "n": 3, "temperature": 1.0, "seed": 1},
        {"max_new_tokens": 2, "n": 1, "temperature": 1.0, "seed": 2}]}
    listed = [item["meta_info"]["id"] for item in http.post("/generate", json=body).json()]
    assert len(listed) == 4
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    by_index: dict[int, set] = {}
    for e in events:
        by_index.setdefault(e["index"], set()).add(e["meta_info"]["id"].split("-")[-1])
    assert {i: sorted(ids) for i, ids in by_index.items()} == \
        {i: [rid.split("-")[-1]] for i, rid in enumerate(listed)}, by_index


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_continuous_usage_stats(http, path, endpoint):
    """vLLM's and SGLang's ``stream_options.continuous_usage_stats`` (sent by benchmark clients with
    ``include_usage``): every chunk carries its choice's usage so far; it was refused as an unknown field."""
    body = {"model": path, "max_tokens": 5, "temperature": 1.0, "ignore_eos": True, "n": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"prompt": [[4, 5, 6], [7, 8]]} if endpoint == "/v1/completions" else {"messages": CHAT})
    with http.stream("POST", endpoint, json=body) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5 * 2 * (2 if "prompt" in body else 1)
    seen: dict[int, int] = {}
    for e in chunks:
        if not e["choices"] or e["choices"][0].get("delta", {}).get("role"):
            continue  # chat's opening role chunks
        index, usage = e["choices"][0]["index"], e["usage"]
        seen[index] = usage["completion_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        if "prompt" in body:
            assert usage["prompt_tokens"] == (3 if index < 2 else 2)
    assert seen == {i: 5 for i in range(len(seen))} and len(seen) == (4 if "prompt" in body else 2), seen


def test_a_seed_outside_64_bits_is_a_400(http, path):
    """vLLM takes seeds in [-2**63, 2**63 - 1] and answers 400 beyond; here 2**63 was accepted and sampled
    exactly as seed 0 (the seed is reduced to 63 bits)."""
    body = {"model": path, "prompt": [4, 5, 6], "max_tokens": 4, "temperature": 1.0}
    for seed in (2**63, -2**63 - 1, 2**64 + 5):
        r = http.post("/v1/completions", json={**body, "seed": seed})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
        gen = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 4, "seed": seed}}
        r = http.post("/generate", json=gen)
        assert r.status_code == 400, r.text
    for seed in (2**63 - 1, -2**63):
        assert http.post("/v1/completions", json={**body, "seed": seed}).status_code == 200


def test_openai_routed_experts_start_len_without_return_routed_experts_is_a_400(http):
    """docs/moe.md: "(HTTP) a start length without `return_routed_experts`" is a clear error. /generate said so;
    the OpenAI endpoints answered 200 and ignored it."""
    r = http.post("/generate", json={"input_ids": [5, 6, 7], "routed_experts_start_len": 1})
    assert r.status_code == 400 and "needs return_routed_experts=true" in r.text
    r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1, "routed_experts_start_len": 1})
    assert r.status_code == 400 and "needs return_routed_experts=true" in r.text, r.text
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                "routed_experts_start_len": 1})
    assert r.status_code == 400 and "needs return_routed_experts=true" in r.text, r.text
    r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1, "routed_experts_start_len": 0})
    assert r.status_code == 200


def test_top_logprobs_hold_k_entries_when_the_sampled_token_ties_the_kth():
    """A sampled token tied with the k-th alternative but not among them (bf16 logits tie often) also has a rank
    <= k (1 + the tokens strictly above it): chat's ``top_logprobs`` and /generate's ``output_top_logprobs``
    held k + 1 entries."""
    from types import SimpleNamespace

    import torch

    from rollout.layers.sampler import Sampler
    from rollout.layers.sampling_info import SamplingBatchInfo, SamplingRow
    from rollout.outputs import CompletionOutput
    from rollout.request_state import _logprob_entry
    from rollout.sampling_params import SamplingParams
    from rollout.server.generate_api import _GenerateView
    from rollout.server.openai_view import OpenAIView

    logits = torch.tensor([[2.0, 2.0, 0.5, 0.5, -1.0]])
    entries = set()
    for k in (1, 3):
        for seed in range(64):
            row = SamplingRow(SamplingParams(temperature=1.0, logprobs=k), seed, 0, [], [], [])
            out = Sampler()(logits, SamplingBatchInfo.build([row], 5, "cpu"))
            tok, top = out.next_token_ids[0].item(), out.top_logprob_ids[0, :k].tolist()
            if tok in top or out.ranks[0].item() > k:  # only a sampled token tied with the k-th alternative
                continue
            entries.add(k)
            entry = _logprob_entry(tok, out.logprobs[0].item(), out.ranks[0].item(),
                                   list(zip(top, out.top_logprobs[0, :k].tolist())), None)
            job = SimpleNamespace(group_id=None, rids=["r"], params=[SamplingParams()], size=1)
            body = SimpleNamespace(n=1, logprobs=True, top_logprobs=k, return_token_ids=False, echo=False,
                                   stream_options=None, add_generation_prompt=True)
            state = SimpleNamespace(engine=None, args=SimpleNamespace(model_name="m"))
            chat = OpenAIView(state, body, job, "chat.completion", chat=True)._chat_logprobs(
                CompletionOutput(index=0, token_ids=[tok], token_logprobs=[out.logprobs[0].item()], logprobs=[entry]))
            assert len(chat["content"][0]["top_logprobs"]) == k, chat
            gen = _GenerateView.__new__(_GenerateView)
            gen.body, gen.tokenizer = SimpleNamespace(return_text_in_logprobs=False), None
            assert len(gen._top(entry, k)) == k, gen._top(entry, k)
    assert entries == {1, 3}  # both cases came up: a tie at the top, and one further down


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_template_that_fails_on_the_messages_is_a_400(http, stream):
    """A template's own ``raise_exception`` (models' templates raise "Conversation roles must alternate ..." when an
    agent loop sends two user turns in a row), a syntax error or an undefined name in a given ``chat_template``
    is the request's fault, a 400 as vLLM answers it; jinja's errors reached the server as a 500, after which the
    connection was dropped."""
    cases = {"{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}":
             "Conversation roles must alternate", "{% for m in messages %}{{ m.content }": "TemplateSyntaxError",
             "{{ undefined_thing.attr }}": "undefined", "{{ messages[0].content | no_such_filter }}": "no_such_filter"}
    for template, words in cases.items():
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "chat_template": template,
                "stream": stream}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (template, r.text)
        assert r.json()["error"]["param"] == "messages"
    assert http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).status_code == 200


def test_tokenize_renders_messages_as_chat_completions_does(http):
    """An agent loop counts or prefixes a conversation with ``/tokenize`` (vLLM's ``TokenizeChatRequest``):
    the same messages and chat template options give the ids chat completions report using. /tokenize dropped
    messages' ``name`` and refused ``chat_template``, ``chat_template_kwargs``, ``add_generation_prompt`` and
    ``continue_final_message`` (400 unknown parameter)."""
    template = ("{% for m in messages %}<{{ m['role'] }}{% if m.name %}={{ m.name }}{% endif %}>{{ m['content'] }}"
                "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}{% if shout %}!!{% endif %}")
    messages = [{"role": "user", "content": "the sky", "name": "bird"}, {"role": "assistant", "content": "is"}]
    for options in ({"chat_template": template, "chat_template_kwargs": {"shout": True}},
                    {"chat_template": template, "add_generation_prompt": False, "continue_final_message": True},
                    {"add_generation_prompt": False}):
        chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                       "return_token_ids": True, **options})
        assert chat.status_code == 200, chat.text
        used = chat.json()["choices"][0]["prompt_token_ids"]
        tok = http.post("/tokenize", json={"messages": messages, **options})
        assert tok.status_code == 200 and tok.json()["tokens"] == used and tok.json()["count"] == len(used), tok.text
    r = http.post("/tokenize", json={"prompt": "the sky", "add_generation_prompt": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_generation_prompt", r.text
    r = http.post("/tokenize", json={"messages": messages, "chat_template": "{{ raise_exception('no') }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_health_generate_answers_200_after_generating_a_token(http, server):
    """SGLang's ``GET /health_generate`` (which clients poll to wait for a server, e.g. before a rollout) generates
    one token and answers 200 with an empty body; it was a 404, so such a client waited forever."""
    r = http.get("/health_generate")
    assert r.status_code == 200 and r.content == b"", r.text
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 401  # the key applies as to /health


def test_generate_takes_one_rid_for_a_batch_as_sglang_does(http):
    """SGLang names the prompts of a batch given one ``rid`` string ``<rid>_<i>`` (docs: "``rid`` (a string, or one
    per prompt)"); it was a 400 "got 1 request ids for 2 prompts". ``/abort_request`` takes the string for all."""
    body = {"input_ids": [[4, 5, 6], [7, 8]], "rid": "batch-rid", "sampling_params": {"max_new_tokens": 2}}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert [item["meta_info"]["id"] for item in r.json()] == ["batch-rid_0", "batch-rid_1"]
    r = http.post("/generate", json={**body, "input_ids": [[4, 5, 6]], "rid": "one"})
    assert [item["meta_info"]["id"] for item in r.json()] == ["one_0"]
    long = {**body, "rid": "live-batch", "stream": True,
            "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}}
    with http.stream("POST", "/generate", json=long) as s:
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        got = http.post("/abort_request", json={"rid": "live-batch"}).json()
        assert got["success"] is True, got
        events = sse_events(lines)
    last = {e["meta_info"]["id"]: e["meta_info"]["finish_reason"]["type"] for e in events
            if e["meta_info"]["finish_reason"]}
    assert last == {"live-batch_0": "abort", "live-batch_1": "abort"}, last


def test_streamed_echo_logprobs_of_every_sample_hold_the_prompt_logprobs(http, path):
    """With n > 1 only sample 0 computes the prompt logprobs, and with ``max_tokens: 0`` the other samples finish at
    once: a stream's first chunk came without the prompt logprobs (the docs: "a stream carries it in its first
    chunk"), so streamed ``echo`` + ``logprobs`` (an lm-eval scoring request) gave samples 1..n-1 null prompt
    logprobs."""
    body = {"model": path, "prompt": [[5, 6, 7, 8, 9], [10, 11, 12]], "max_tokens": 0, "echo": True, "logprobs": 1,
            "n": 3, "temperature": 1.0}
    whole = http.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    want = {c["index"]: c["logprobs"]["token_logprobs"] for c in whole.json()["choices"]}
    assert all(v is not None for lps in want.values() for v in lps[1:]) and len(want) == 6, want
    for _ in range(4):  # the prompts cached by the request before: samples 1..n-1 finished before sample 0 ran
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            events = sse_events(r.iter_lines())
        got: dict[int, list] = {}
        for e in events:
            for c in e["choices"]:
                got.setdefault(c["index"], []).extend(c["logprobs"]["token_logprobs"])
        assert got.keys() == want.keys() and all(got[i] == pytest.approx(want[i], abs=1e-5) for i in want), got


def test_chat_return_token_ids_names_the_prompt_ids_at_the_top_level_as_vllm(http, path):
    """vLLM's chat completions with ``return_token_ids`` give ``prompt_token_ids`` at the response's top level (a
    stream: its first chunk's) and ``token_ids`` per choice; agent loops read ``response.prompt_token_ids``. It was
    only inside each choice, so such a client found none."""
    body = {"model": path, "messages": CHAT, "max_tokens": 3, "n": 2, "return_token_ids": True, "temperature": 1.0}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    ids = http.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert r.json()["prompt_token_ids"] == ids and all(len(c["token_ids"]) == 3 for c in r.json()["choices"])
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        events = sse_events(s.iter_lines())
    assert events[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in e for e in events[1:]), events
    plain = http.post("/v1/chat/completions", json={**body, "return_token_ids": False}).json()
    assert "prompt_token_ids" not in plain


@pytest.mark.parametrize("stream", [False, True])
def test_generate_return_logprob_always_sends_input_token_logprobs(http, stream):
    """SGLang's ``meta_info`` with ``return_logprob`` always holds ``input_token_logprobs`` (and, with
    ``top_logprobs_num``, ``input_top_logprobs``): for the default ``logprob_start_len`` (-1) its scheduler starts
    the prompt logprobs at the prompt's end, so they are empty lists. Both keys were missing (a KeyError in a
    client that reads them)."""
    body = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
            "top_logprobs_num": 2, "stream": stream}
    if stream:
        with http.stream("POST", "/generate", json=body) as r:
            metas = [e["meta_info"] for e in sse_events(r.iter_lines())]
    else:
        metas = [http.post("/generate", json=body).json()["meta_info"]]
    assert metas and all(m["input_token_logprobs"] == [] and m["input_top_logprobs"] == [] for m in metas), metas
    assert len(metas[-1]["output_token_logprobs"]) == 2
    meta = http.post("/generate", json={**body, "stream": False, "top_logprobs_num": 0}).json()["meta_info"]
    assert meta["input_token_logprobs"] == [] and "input_top_logprobs" not in meta, meta
    meta = http.post("/generate", json={**body, "stream": False, "return_logprob": False}).json()["meta_info"]
    assert "input_token_logprobs" not in meta and "output_token_logprobs" not in meta, meta


def test_generate_takes_logprob_options_per_prompt_as_sglang_does(http):
    """SGLang's ``return_logprob``, ``top_logprobs_num`` and ``logprob_start_len`` may each be a list with one entry
    per prompt of a batch (``GenerateReqInput._normalize_logprob_params``); a prompt without ``return_logprob``
    ignores its ``logprob_start_len``, as SGLang's scheduler does. Lists were a 400 "matches none of the accepted
    types", and a ``logprob_start_len`` without ``return_logprob`` a 400."""
    body = {"input_ids": [[4, 5, 6, 7], [8, 9, 10]], "sampling_params": {"max_new_tokens": 2},
            "return_logprob": [True, False], "top_logprobs_num": [2, 3], "logprob_start_len": [1, 0]}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    first, second = (item["meta_info"] for item in r.json())
    assert [e[1] for e in first["input_token_logprobs"]] == [5, 6, 7] and first["input_token_logprobs"][0][0] is None
    assert all(len(top) == 2 for top in first["output_top_logprobs"]) and len(first["input_top_logprobs"]) == 3
    assert not {"input_token_logprobs", "output_token_logprobs", "output_top_logprobs"} & second.keys(), second
    r = http.post("/generate", json={**body, "return_logprob": [False, True], "logprob_start_len": 0})
    first, second = (item["meta_info"] for item in r.json())
    assert "output_token_logprobs" not in first and [e[1] for e in second["input_token_logprobs"]] == [8, 9, 10]
    assert len(second["output_top_logprobs"][0]) == 3
    r = http.post("/generate", json={"input_ids": [4, 5], "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200 and "input_token_logprobs" not in r.json()["meta_info"], r.text
    r = http.post("/generate", json={**body, "top_logprobs_num": [2]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs_num", r.text
    r = http.post("/generate", json={**body, "logprob_start_len": [1, -2]})
    assert r.status_code == 400 and "logprob_start_len" in r.json()["error"]["param"], r.text


@pytest.mark.parametrize("name, value", [("regex", "[ab]+"), ("json_schema", '{"type": "object"}'),
                                         ("ebnf", 'root ::= "a"'), ("stop_regex", "a+")])
def test_generate_names_an_sglang_sampling_parameter_it_does_not_support(http, name, value):
    """SGLang's constrained decoding (``regex``, ``json_schema``, ``ebnf``) and ``stop_regex`` are sampling parameters
    there: a 400 saying "not supported" and naming the parameter, where it said "unknown sampling parameter" as for a
    typo. A null value is SGLang's default and is accepted."""
    body = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 1, name: value}}
    r = http.post("/generate", json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and f"{name} is not supported" in error["message"], r.text
    assert "unknown" not in error["message"] and error["param"] == f"sampling_params.{name}", error
    assert http.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 1, name: None}}).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_the_x_request_id_header_names_the_request(http, path, stream):
    """vLLM takes a request's id from its ``X-Request-Id`` header before the body's ``request_id``
    (``OpenAIServing._base_request_id``) and, with ``--enable-request-id-headers``, answers the header's value in its
    own ``X-Request-Id``; a gateway's trace id thus names the request. The header was ignored: the response had a
    fresh id, which ``/abort_request`` and the logs knew the request by."""
    cases = [("/v1/completions", {"prompt": [4, 5, 6]}, "hdr-cmpl", "hdr-cmpl"),
             ("/v1/completions", {"prompt": [[4, 5], [6, 7]], "request_id": "body-id"}, "hdr-two", "hdr-two"),
             ("/v1/chat/completions", {"messages": CHAT, "request_id": "body-id"}, "hdr-chat", "hdr-chat"),
             ("/v1/chat/completions", {"messages": CHAT, "request_id": "body-only"}, None, "body-only")]
    for endpoint, body, header, want in cases:
        headers = {"X-Request-Id": f"{header}-{stream}"} if header else {}
        want = f"{want}-{stream}" if header else want
        body = {"model": path, "max_tokens": 2, "stream": stream, **body}
        if stream:
            with http.stream("POST", endpoint, json=body, headers=headers) as r:
                ids = {e["id"] for e in sse_events(r.iter_lines())}
        else:
            r = http.post(endpoint, json=body, headers=headers)
            ids = {r.json()["id"]}
        assert r.status_code == 200 and ids == {want} and r.headers["X-Request-Id"] == want, (endpoint, ids)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_without_generation_prompt_answers_in_the_last_messages_role(http, path, stream):
    """vLLM's chat role (``get_chat_request_role``): "assistant" after the generation prompt, else the last message's
    role: ``add_generation_prompt: false`` continues that message (``continue_final_message`` a partial assistant
    turn, or a user turn being completed). The role was always "assistant"."""
    cases = [({"add_generation_prompt": False}, CHAT, "user"),
             ({"add_generation_prompt": False, "continue_final_message": True},
              CHAT + [{"role": "assistant", "content": "The sea is"}], "assistant"),
             ({}, CHAT, "assistant")]
    for options, messages, role in cases:
        body = {"model": path, "messages": messages, "max_tokens": 2, "n": 2, "stream": stream, **options}
        if stream:
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                roles = [c["delta"]["role"] for e in sse_events(r.iter_lines()) for c in e["choices"]
                         if "role" in c["delta"]]
            assert roles == [role, role], (options, roles)
        else:
            r = http.post("/v1/chat/completions", json=body)
            assert [c["message"]["role"] for c in r.json()["choices"]] == [role, role], (options, r.text)


def test_chat_tools_are_checked_and_rendered_as_vllm_does_without_a_tool_parser(http, path):
    """vLLM (``ChatCompletionRequest.check_tool_usage``, no ``--tool-call-parser``): ``"tools": []`` is a 400 (OpenAI's
    check), tools without ``tool_choice`` ask for "auto", a 400 whose message clients recognise to retry without tools,
    and ``tool_choice: "none"`` renders the tools in the chat template and generates. ``[]`` was accepted, and tools
    with "none" refused."""
    template = "{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}" \
               "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tools = [{"type": "function", "function": {"name": "sky", "parameters": {"type": "object", "properties": {}}}}]
    body = {"model": path, "messages": CHAT, "max_tokens": 1, "chat_template": template, "return_token_ids": True}
    r = http.post("/v1/chat/completions", json={**body, "tools": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools" and "empty array" in r.text, r.text
    r = http.post("/v1/chat/completions", json={**body, "tools": tools})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'), r.text
    for choice in ("required", {"type": "function", "function": {"name": "sky"}}):
        r = http.post("/v1/chat/completions", json={**body, "tools": tools, "tool_choice": choice})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    r = http.post("/v1/chat/completions", json={**body, "tools": tools, "tool_choice": "none"})
    assert r.status_code == 200, r.text
    want = http.post("/tokenize", json={"prompt": "[sky]" + "".join(m["content"] for m in CHAT),
                                        "add_special_tokens": False}).json()["tokens"]
    assert r.json()["prompt_token_ids"] == want
    assert http.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).status_code == 200
    # /tokenize renders the same tools with the messages (vLLM's TokenizeChatRequest.tools); a prompt takes none
    tokenized = http.post("/tokenize", json={"messages": CHAT, "chat_template": template, "tools": tools})
    assert tokenized.status_code == 200 and tokenized.json()["tokens"] == want, tokenized.text
    r = http.post("/tokenize", json={"prompt": "x", "tools": tools})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
