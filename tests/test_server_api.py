"""The HTTP server against the Python API: the real server (a subprocess on 127.0.0.1) answered through the
official ``openai`` client, httpx and ``rollout.client``, compared with an in-process Engine on the same
checkpoint and settings. One server (with an API key) for the whole module."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from conftest import prompts_of_lengths
from rollout import SamplingParams
from rollout.client import EngineClient
from server_harness import API_KEY as KEY, metrics

GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
TEXTS = ["the sky is", "hello world", "one two three four"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what color is the sea"}]


@pytest.fixture(scope="module")
def oai(server):
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        yield c


def sse_events(lines) -> list:
    """The data of each server-sent event; the last must be [DONE]."""
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


# ---- readiness and listing ------------------------------------------------------------------------


def test_health_was_503_until_ready_and_models_lists_the_model(server, oai, path):
    seen = [s for s in server.statuses if s is not None]
    assert seen[-1] == 200 and 503 in seen, seen
    models = oai.models.list().data
    assert [m.id for m in models] == [path]


# ---- OpenAI completions and chat vs the Python API --------------------------------------------------


def test_completions_equal_the_python_api(oai, engine, path):
    resp = oai.completions.create(model=path, prompt=TEXTS, max_tokens=12, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    ref = engine.generate(TEXTS, SamplingParams(**GREEDY, logprobs=2), use_tqdm=False)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for choice, out in zip(resp.choices, ref):
        c = out.outputs[0]
        assert choice.text == c.text and choice.model_extra["token_ids"] == c.token_ids
        assert choice.model_extra["prompt_token_ids"] == out.prompt_token_ids
        assert choice.finish_reason == "length"
        assert choice.logprobs.token_logprobs == pytest.approx(c.token_logprobs, abs=1e-4)
        assert choice.logprobs.tokens == [engine.tokenizer.decode([t]) for t in c.token_ids]
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert resp.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in ref)
    assert resp.usage.completion_tokens == 36 and resp.usage.total_tokens == resp.usage.prompt_tokens + 36
    assert resp.model_extra["weight_version"] == "0"


@pytest.mark.parametrize("stream", [False, True])
def test_the_request_id_header_is_the_responses_id(http, stream):
    """vLLM's X-Request-Id: the response's id, also for several prompts (it was the first prompt's sub-id)."""
    r = http.post("/v1/completions", json={"prompt": ["a b", "c d"], "max_tokens": 2, "stream": stream})
    assert r.status_code == 200, r.text
    first = json.loads(r.text.split("data: ", 2)[1].split("\n")[0]) if stream else r.json()
    assert r.headers["X-Request-Id"] == first["id"] and first["id"].startswith("cmpl-")


@pytest.mark.parametrize("k", [0, 2])
def test_completion_top_logprobs_hold_the_chosen_token(oai, path, k):
    """OpenAI's legacy logprobs (and vLLM's): the chosen token always comes first in its top_logprobs entry,
    so an entry has up to k + 1 tokens, and logprobs=0 gives one-entry dicts; the echoed prompt too."""
    resp = oai.completions.create(model=path, prompt=TEXTS[0], max_tokens=24, temperature=1.5, seed=3, logprobs=k,
                                  echo=True, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert lp.top_logprobs[0] is None and len(lp.top_logprobs) == len(lp.tokens) > 24
    for tok, chosen, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert next(iter(top)) == tok and 1 <= len(top) <= k + 1
        if k == 0:
            assert top == {tok: chosen}


def test_completions_stream_equals_the_python_api(oai, engine):
    stream = oai.completions.create(model=oai.models.list().data[0].id, prompt=TEXTS, max_tokens=12,
                                    temperature=0, stream=True, stream_options={"include_usage": True},
                                    extra_body={"ignore_eos": True})
    texts, finish, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    ref = engine.generate(TEXTS, SamplingParams(**GREEDY), use_tqdm=False)
    assert texts == {i: o.outputs[0].text for i, o in enumerate(ref)}
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 36 and usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in ref)


def test_chat_equals_the_python_api_stream_and_not(oai, engine, path):
    ref = engine.chat(CHAT, SamplingParams(**GREEDY, logprobs=1), use_tqdm=False)[0].outputs[0]
    resp = oai.chat.completions.create(model=path, messages=CHAT, max_tokens=12, temperature=0, logprobs=True,
                                       top_logprobs=1, extra_body={"ignore_eos": True})
    msg = resp.choices[0]
    assert msg.message.role == "assistant" and msg.message.content == ref.text
    assert [t.logprob for t in msg.logprobs.content] == pytest.approx(ref.token_logprobs, abs=1e-4)
    assert resp.usage.prompt_tokens == len(engine.apply_chat_template(CHAT)) and resp.usage.completion_tokens == 12

    stream = oai.chat.completions.create(model=path, messages=CHAT, max_tokens=12, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    roles, text, finish = [], "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        roles += [delta.role] if delta.role else []
        text += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert roles == ["assistant"] and text == ref.text and finish == "length"


def test_chat_template_options_over_http_equal_the_python_api(oai, engine, path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!!{% endif %}"
    options = {"chat_template": template, "chat_template_kwargs": {"shout": True}, "add_generation_prompt": False}
    ref = engine.chat(CHAT, SamplingParams(**GREEDY), use_tqdm=False, **options)[0]
    resp = oai.chat.completions.create(model=path, messages=CHAT, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True, **options})
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert engine.tokenizer.decode(ref.prompt_token_ids).endswith("!!")


def test_n_seed_and_stop_equal_the_python_api(oai, engine, path):
    params = dict(temperature=1.0, top_k=50, max_tokens=10, seed=1234, n=3, ignore_eos=True)
    resp = oai.completions.create(model=path, prompt="the red car", max_tokens=10, temperature=1.0, seed=1234, n=3,
                                  extra_body={"top_k": 50, "ignore_eos": True})
    ref = engine.generate(["the red car"], SamplingParams(**params), use_tqdm=False)[0]
    assert [c.text for c in resp.choices] == [c.text for c in ref.outputs]
    assert len({c.text for c in resp.choices}) > 1, "n samples with a seed should differ from each other"

    greedy = engine.generate(["hello world"], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].text
    stop = greedy.strip()[2:5] if len(greedy.strip()) >= 5 else greedy.strip()
    want = engine.generate(["hello world"], SamplingParams(**GREEDY, stop=[stop]), use_tqdm=False)[0].outputs[0]
    got = oai.completions.create(model=path, prompt="hello world", max_tokens=12, temperature=0, stop=[stop],
                                 extra_body={"ignore_eos": True}).choices[0]
    assert want.finish_reason == "stop" and (got.text, got.finish_reason) == (want.text, "stop")


# ---- SGLang /generate, tokenize ---------------------------------------------------------------------


def test_generate_sglang_shape_equals_the_python_api(http, engine):
    prompts = prompts_of_lengths([5, 9, 3], seed=3)
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 2}
    items = http.post("/generate", json=body).json()
    ref = engine.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=2), use_tqdm=False)
    assert len(items) == 3
    for item, out in zip(items, ref):
        c, meta = out.outputs[0], item["meta_info"]
        assert item["output_ids"] == c.token_ids and item["text"] == c.text
        assert meta["finish_reason"] == {"type": "length", "length": 8}
        assert meta["prompt_tokens"] == len(out.prompt_token_ids) and meta["completion_tokens"] == 8
        assert meta["weight_version"] == "0" and isinstance(meta["cached_tokens"], int)
        assert [x[1] for x in meta["output_token_logprobs"]] == c.token_ids
        assert [x[0] for x in meta["output_token_logprobs"]] == pytest.approx(c.token_logprobs, abs=1e-4)
        assert all(len(top) == 2 for top in meta["output_top_logprobs"])

    single = http.post("/generate", json={"text": "the sky is", "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}).json()
    want = engine.generate(["the sky is"], SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert isinstance(single, dict) and single["output_ids"] == want.token_ids and single["text"] == want.text

    with http.stream("POST", "/generate", json={"text": "the sky is", "stream": True, "sampling_params": {
            "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}) as r:
        events = sse_events(r.iter_lines())
    assert events[-1]["output_ids"] == want.token_ids and events[-1]["text"] == want.text  # cumulative
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


def test_tokenize_and_detokenize_use_the_engines_tokenizer(http, engine):
    ids = http.post("/tokenize", json={"prompt": "the blue sea"}).json()
    assert ids["tokens"] == engine.tokenizer.encode("the blue sea") and ids["count"] == len(ids["tokens"])
    assert ids["max_model_len"] == engine.context_len
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == engine.apply_chat_template(CHAT)
    decoded = http.post("/detokenize", json={"tokens": ids["tokens"]}).json()
    assert decoded["text"] == engine.tokenizer.decode(ids["tokens"], skip_special_tokens=True)
    assert decoded["prompt"] == decoded["text"]  # vLLM's clients read "prompt"


# ---- load and disconnects ---------------------------------------------------------------------------


def test_200_concurrent_streams_complete_correctly(server, engine, http):
    prompts = prompts_of_lengths([3 + i % 13 for i in range(200)], seed=7)
    before = metrics(http)

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, list[int], str, str | None]:
        body = {"prompt": prompts[i], "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True,
                "return_token_ids": True}
        ids, text, finish = [], "", None
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines()]
        for event in sse_events(lines):
            choice = event["choices"][0]
            ids += choice.get("token_ids", [])
            text += choice["text"]
            finish = choice["finish_reason"] or finish
        return i, ids, text, finish

    async def run_all():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, limits=limits,
                                     timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(200))), 150)

    results = asyncio.run(run_all())
    ref = engine.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        temperature=0, max_new_tokens=8, ignore_eos=True), use_tqdm=False)
    for (i, ids, text, finish), out in zip(results, ref):
        assert (ids, text, finish) == (out.outputs[0].token_ids, out.outputs[0].text, "length"), i
    after = metrics(http)
    key = 'rollout_http_requests_total{endpoint=/v1/completions,status=200}'
    assert after[key] - before.get(key, 0) == 200
    assert after["rollout_generation_tokens_total"] - before["rollout_generation_tokens_total"] >= 1600


def _wait_idle(http: httpx.Client, disconnects: float = 0, timeout: float = 20.0) -> dict[str, float]:
    """/metrics once nothing runs or waits and at least ``disconnects`` disconnects were counted."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        if m["rollout_num_running_reqs"] == 0 and m["rollout_num_queue_reqs"] == 0 \
                and m["rollout_client_disconnects_total"] >= disconnects:
            return m
        assert time.monotonic() < deadline, f"requests still running: the disconnected ones were not aborted {m}"
        time.sleep(0.1)


def test_clients_that_disconnect_get_their_requests_aborted(server, http, engine):
    before = _wait_idle(http)
    long = {"max_tokens": 480, "temperature": 0, "ignore_eos": True}

    async def leave_a_stream(client: httpx.AsyncClient, i: int) -> None:
        async with client.stream("POST", "/v1/completions", json={"prompt": [5 + i, 6, 7], "stream": True,
                                                                  **long}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # one event, then hang up

    async def leave_a_request(client: httpx.AsyncClient, i: int) -> None:
        with pytest.raises(httpx.ReadTimeout):  # gives up waiting for the answer, closes the connection
            await client.post("/generate", json={"input_ids": [9 + i, 8, 7], "sampling_params": {
                "max_new_tokens": 480, "temperature": 0, "ignore_eos": True}},
                timeout=httpx.Timeout(30, read=0.3))

    async def run_all():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60) as client:
            await asyncio.gather(*(leave_a_stream(client, i) for i in range(6)),
                                 *(leave_a_request(client, i) for i in range(4)))

    asyncio.run(run_all())
    after = _wait_idle(http, disconnects=before["rollout_client_disconnects_total"] + 10)
    assert after["rollout_client_disconnects_total"] - before["rollout_client_disconnects_total"] == 10
    generated = after["rollout_generation_tokens_total"] - before["rollout_generation_tokens_total"]
    assert generated < 10 * 480 / 2, f"{generated} tokens generated: the requests ran on after the clients left"
    # the server keeps serving, correctly
    got = http.post("/generate", json={"text": "hello world", "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}).json()
    want = engine.generate(["hello world"], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    assert got["output_ids"] == want.token_ids


def test_abort_request_by_id(server, http):
    client = EngineClient(server.url, api_key=KEY)
    stream = client.generate_stream(input_ids=[4, 5, 6], rid="rid-to-abort",
                                    sampling_params={"max_new_tokens": 480, "temperature": 0, "ignore_eos": True})
    first = next(stream)
    assert first["meta_info"]["id"] == "rid-to-abort"
    r = http.post("/flush_cache")  # SGLang's status: 400 while a running request holds cache entries
    assert r.status_code == 400 and r.json()["success"] is False and "not flushed" in r.json()["message"]
    assert client.flush_cache() is False
    assert client.abort("rid-to-abort") is True
    last = [e for e in stream][-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort" and last["meta_info"]["completion_tokens"] < 480
    assert client.abort("rid-to-abort") is False  # no longer running


def test_abort_request_takes_a_multi_prompt_response_id_and_a_sample_id(server, http, path):
    """A multi-prompt OpenAI request runs one engine request per prompt (``<id>-<i>``): aborting the id the
    client sees (the response's ``id``, ``X-Request-Id``) aborts them all. A sample of an n > 1 request is
    aborted alone by its id ``<rid>#<i>`` (the ids ``/generate`` reports)."""
    long = {"max_tokens": 480, "temperature": 0, "ignore_eos": True}
    body = {"model": path, "prompt": [[4, 5, 6], [7, 8, 9]], "stream": True, **long}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[len("data: "):])
        assert r.headers["X-Request-Id"] == first["id"]
        got = http.post("/abort_request", json={"rid": first["id"]}).json()
        assert got["success"] is True, got
        events = sse_events(lines)
    reasons = {e["choices"][0]["index"]: e["choices"][0]["finish_reason"] for e in events
               if e["choices"] and e["choices"][0]["finish_reason"]}
    assert reasons == {0: "abort", 1: "abort"}, reasons
    assert http.post("/abort_request", json={"rid": first["id"]}).json()["success"] is False  # gone

    client = EngineClient(server.url, api_key=KEY)
    stream = client.generate_stream(input_ids=[4, 5, 6], rid="two-samples",
                                    sampling_params={"n": 2, "max_new_tokens": 480, "temperature": 1.0,
                                                     "ignore_eos": True})
    ids = next(stream)["meta_info"]["id"]
    assert client.abort("two-samples#1") is True
    finals = {}
    for event in stream:
        for e in event if isinstance(event, list) else [event]:
            if e["meta_info"]["finish_reason"] is not None:
                finals[e["meta_info"]["id"]] = e["meta_info"]
    assert finals["two-samples#1"]["finish_reason"]["type"] == "abort", (ids, finals)
    assert finals["two-samples#0"]["finish_reason"]["type"] == "length"
    assert finals["two-samples#0"]["completion_tokens"] == 480


# ---- bad requests -----------------------------------------------------------------------------------


BAD = [  # (path, body (str = raw), headers, status, words in the message)
    ("/v1/completions", '{"prompt": "x", "max_tokens": ', None, 400, "malformed JSON"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, None, 400, "'max_tokens'"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, None, 400, "'temperature'"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, None, 400, "unknown parameter 'frobnicate'"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, None, 400, "temperature must be"),
    ("/v1/completions", "", None, 400, "must be a JSON object"),
    ("/v1/completions", "[1, 2]", None, 400, "must be a JSON object"),
    ("/v1/completions", {"prompt": [5] * 600}, None, 400, "context length is 512"),
    ("/v1/completions", {"prompt": [5] * 600, "stream": True}, None, 400, "context length is 512"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, None, 400, "suffix is not supported"),
    ("/v1/completions", {"prompt": [5, 6, 100000]}, None, 400, "out of vocabulary"),
    ("/v1/completions", '{"prompt": "a\\ud800b"}', None, 400, "lone surrogate"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, None, 400, "stream=True"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, None, 400,
     "`logprobs` must be set to true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     None, 400, "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    ("/generate", {"input_ids": [5, 6], "return_logprob": True, "top_logprobs_num": 25}, None, 400,
     "Requested sample logprobs of 25"),
    ("/generate", '{"text": ["ok", "a\\ud800"]}', None, 400, "lone surrogate"),
    ("/tokenize", '{"prompt": "a\\udfff"}', None, 400, "lone surrogate"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', None, 400, "lone surrogate"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-17"}, None, 404, "does not exist"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, None, 400, "'messages.0.role'"),
    ("/v1/chat/completions", {"messages": []}, None, 400, "'messages'"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2, "tempurature": 1}}, None, 400,
     "unknown sampling parameter 'tempurature'"),
    ("/generate", {"text": "x", "input_ids": [1, 2]}, None, 400, "exactly one of 'text' and 'input_ids'"),
    ("/update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1]]}, None, 400,
     "one length"),
    ("/update_weights_from_distributed", {"names": "lm_head.weight", "dtypes": ["float32"], "shapes": [[2]]},
     None, 400, "'names'"),
    ("/update_weights_from_distributed", {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[512, 64]],
                                          "group_name": "no-such-group"}, None, 400, "not initialized"),
    ("/update_weights_from_disk", {"model_path": "/no/such/checkpoint"}, None, 400, "/no/such/checkpoint"),
    ("/pause_generation", {"mode": "sometimes"}, None, 400, "'mode'"),
    ("/v1/completions", {"prompt": "x"}, {"Authorization": ""}, 401, "API key"),
    ("/v1/completions", {"prompt": "x"}, {"Authorization": "Bearer wrong-key"}, 401, "API key"),
    ("/update_weights_from_disk", {"model_path": "/x"}, {"Authorization": "Bearer wrong-key"}, 401, "API key"),
]


@pytest.mark.parametrize("path_, body, headers, status, words", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_get_a_clear_4xx_and_the_server_keeps_serving(http, engine, path_, body, headers, status, words):
    kwargs = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, str) \
        else {"json": body}
    if headers is not None:
        kwargs["headers"] = {**kwargs.get("headers", {}), **headers}
    r = http.post(path_, **kwargs)
    assert r.status_code == status, r.text
    answer = r.json()
    message = answer["message"] if "success" in answer else answer["error"]["message"]
    assert words in message, message
    if "success" in answer:
        assert answer["success"] is False
    got = http.post("/generate", json={"input_ids": [7, 8, 9], "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}).json()
    want = engine.generate(prompt_token_ids=[[7, 8, 9]], sampling_params=SamplingParams(
        temperature=0, max_new_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert got["output_ids"] == want.token_ids


def test_the_openai_client_sees_bad_requests_as_errors(oai, path):
    import openai

    with pytest.raises(openai.BadRequestError, match="unknown parameter 'frobnicate'"):
        oai.completions.create(model=path, prompt="x", extra_body={"frobnicate": 1})
    with openai.OpenAI(base_url=oai.base_url, api_key="nope", max_retries=0) as bad_key:
        with pytest.raises(openai.AuthenticationError):
            bad_key.completions.create(model=path, prompt="x", max_tokens=2)


# ---- control over HTTP and metrics ------------------------------------------------------------------


def test_control_calls_through_the_client(server, engine):
    client = EngineClient(server.url, api_key=KEY)
    assert client.get_weight_version() == "0"
    assert client.weights_fingerprint() == engine.weights_fingerprint()
    assert client.get_weights_by_name("lm_head.weight", 5) == engine.get_weights_by_name("lm_head.weight", 5)
    assert client.flush_cache() is True
    assert client.get_weight_state()["state"] == "consistent"
    assert client.update_weight_version("v-test") == "v-test"
    out = client.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 2})
    assert out["meta_info"]["weight_version"] == "v-test"
    assert client.update_weight_version("0") == "0"
    assert client.pause_generation("retract") and client.continue_generation()
    with pytest.raises(ValueError, match="one length"):
        client.update_weights_from_distributed(["a", "b"], ["float32"], [[1]])
    with pytest.raises(PermissionError, match="API key"):
        EngineClient(server.url, api_key="wrong").get_weight_version()


def test_the_client_names_a_weight_version_as_the_engine_does(server, engine, path):
    """A trainer's step number as ``weight_version`` (``WeightSender.send(..., weight_version=step)``): the Engine
    names the weights ``str(step)``; the client sent the int, which the server refused (a 400)."""
    client = EngineClient(server.url, api_key=KEY)
    try:
        for handle in (engine, client):
            assert handle.update_weights_from_disk(path, weight_version=7)["weight_version"] == "7"
            assert handle.get_weight_version() == "7"
    finally:
        for handle in (engine, client):
            handle.update_weight_version("0")
        client.close()


@pytest.mark.parametrize("name", [None, 3])
def test_a_name_that_is_no_string_is_a_value_error_on_both_handles(server, engine, name):
    """The client's 400 is a ValueError; the Engine sent the name to the scheduler, whose AttributeError came back
    as a RuntimeError (the error of an engine that failed, not of a bad call)."""
    client = EngineClient(server.url, api_key=KEY)
    for handle in (client, engine):
        with pytest.raises(ValueError, match="name"):
            handle.get_weights_by_name(name, 4)
    assert engine.get_weights_by_name("model.norm.weight", 4) == client.get_weights_by_name("model.norm.weight", 4)


def test_start_and_stop_profile_over_http(server, http, tmp_path):
    r = http.post("/start_profile", json={"output_dir": str(tmp_path), "profile_id": "http", "activities": ["CPU"]})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert r.json()["traces"] == [str(tmp_path / "http-TP-0.trace.json.gz")]
    body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    assert http.post("/generate", json=body).status_code == 200
    r = http.post("/stop_profile")
    assert r.status_code == 200 and r.json()["steps"] == 3 and (tmp_path / "http-TP-0.trace.json.gz").exists()
    r = http.post("/stop_profile")
    assert r.status_code == 400 and "no profile is running" in r.text
    r = http.post("/start_profile", json={"activities": ["GPU"]})
    assert r.status_code == 400 and "needs an engine on CUDA" in r.text
    client = EngineClient(server.url, api_key=KEY)  # the same through the Python client
    assert client.start_profile(str(tmp_path), profile_id="client")["traces"] == [
        str(tmp_path / "client-TP-0.trace.json.gz")]
    assert client.stop_profile() == {"trace": str(tmp_path / "client-TP-0.trace.json.gz"), "steps": 0}
    with pytest.raises(ValueError, match="no profile is running"):
        client.stop_profile()


def test_metrics_parse_and_move_with_traffic(http):
    before = metrics(http)
    for name in ("rollout_num_running_reqs", "rollout_num_queue_reqs", "rollout_kv_cache_usage",
                 "rollout_gen_throughput", "rollout_cache_hit_rate", "rollout_last_weight_sync_seconds",
                 "rollout_weight_version_info{version=0}", "rollout_prefill_computed_tokens_total"):
        assert name in before, name
    assert before["rollout_engine_load_stale"] == 0
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    for _ in range(2):  # the second one hits the prefix cache
        http.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 5,
                                                                            "ignore_eos": True}})
    after = metrics(http)
    key = "rollout_http_requests_total{endpoint=/generate,status=200}"
    assert after[key] - before.get(key, 0) == 2
    assert after["rollout_prompt_tokens_total"] - before["rollout_prompt_tokens_total"] == 16
    assert after["rollout_generation_tokens_total"] - before["rollout_generation_tokens_total"] == 10
    assert after["rollout_cached_prompt_tokens_total"] - before["rollout_cached_prompt_tokens_total"] >= 7
    assert after["rollout_request_finished_total{finish_reason=length}"] > before.get(
        "rollout_request_finished_total{finish_reason=length}", 0)
    assert 0 < after["rollout_cache_hit_rate"] <= 1
    assert after["rollout_gen_throughput"] > 0


def test_a_method_an_endpoint_does_not_take_is_a_405_naming_the_allowed_ones():
    """HEAD, OPTIONS or GET on an endpoint that takes other methods is a JSON 405 with the ``Allow`` header RFC 9110
    requires (the error handler dropped it) and a message naming the allowed methods. In process: no engine."""
    from rollout.server.app import create_app
    from rollout.server.server_args import ServerArgs

    async def call(method: str, path: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(ServerArgs("/m")))
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            return await client.request(method, path)

    for method, path, allowed in [("OPTIONS", "/v1/completions", {"POST"}), ("GET", "/generate", {"POST"}),
                                  ("HEAD", "/health", {"GET"}), ("PUT", "/flush_cache", {"GET", "POST"})]:
        r = asyncio.run(call(method, path))
        assert r.status_code == 405, (method, path, r.status_code)
        assert set(r.headers.get("allow", "").split(", ")) == allowed, (method, path, r.headers)
        if method != "HEAD":
            message = r.json()["message"] if "success" in r.json() else r.json()["error"]["message"]
            assert f"not allowed on {path} (allowed: {r.headers['allow']})" in message, message


def test_a_request_cancelled_by_the_servers_shutdown_gets_a_json_503_and_is_aborted():
    """uvicorn cancels the requests still running when its graceful shutdown times out (5 s): a non-streamed one
    answers a JSON 503 saying the server is shutting down, and its engine request is aborted; it was uvicorn's bare
    text/plain 500 "Internal Server Error". In process: the app called as uvicorn calls it, on a stub engine whose
    generation never ends."""
    from types import SimpleNamespace

    from rollout.server.app import create_app
    from rollout.server.server_args import ServerArgs
    from rollout.server.state import ServerState

    async def scenario() -> tuple[list[dict], bool]:
        entered, aborted = asyncio.Event(), []

        async def async_generate(prompts, params, request_id):
            entered.set()
            try:
                await asyncio.Event().wait()  # generation never ends
            except asyncio.CancelledError:
                aborted.append(request_id)
                raise

        state = ServerState(ServerArgs("/m"))
        state.engine = SimpleNamespace(tokenizer_manager=SimpleNamespace(dead=None), tokenizer=None, context_len=64,
                                       async_generate=async_generate)
        app = create_app(ServerArgs("/m"), state)
        body = json.dumps({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/generate", "raw_path": b"/generate", "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"server")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[dict] = []

        async def receive() -> dict:
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # the client stays connected

        async def send(message: dict) -> None:
            sent.append(message)

        task = asyncio.ensure_future(app(scope, receive, send))
        await asyncio.wait_for(entered.wait(), 10)
        task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")  # what uvicorn does
        await asyncio.wait_for(task, 10)
        await asyncio.sleep(0)  # the engine call's cancellation runs
        return sent, bool(aborted)

    sent, aborted = asyncio.run(scenario())
    assert sent and sent[0]["type"] == "http.response.start" and sent[0]["status"] == 503, sent
    answer = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert "shutting down" in answer["error"]["message"] and answer["error"]["code"] == 503, answer
    assert aborted, "the engine request was not aborted"


def test_tokenizing_a_huge_prompt_does_not_stall_the_server():
    """Tokenizing runs on the server's tokenizer thread: a 16 MB prompt to /tokenize took 35 s inside the event loop,
    and /health went unanswered meanwhile. In process, with a tokenizer whose encode waits until /health answered
    (at most 10 s): the health check must come back while the encode is still running."""
    import threading
    from types import SimpleNamespace

    from rollout.server.app import create_app
    from rollout.server.server_args import ServerArgs
    from rollout.server.state import ServerState

    started, health_answered = threading.Event(), threading.Event()

    class SlowTokenizer:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            started.set()
            return [1, 2, 3] if health_answered.wait(10) else []  # [] : /health waited for this encode

    async def scenario() -> tuple[int, dict]:
        state = ServerState(ServerArgs("/m"))
        state.engine = SimpleNamespace(tokenizer=SlowTokenizer(), context_len=64,
                                       tokenizer_manager=SimpleNamespace(dead=None))
        transport = httpx.ASGITransport(app=create_app(ServerArgs("/m"), state))
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            tokenized = asyncio.create_task(client.post("/tokenize", json={"prompt": "a huge prompt"}))
            await asyncio.to_thread(started.wait, 10)
            health = await client.get("/health")
            health_answered.set()
            return health.status_code, (await tokenized).json()

    status, tokenized = asyncio.run(scenario())
    assert status == 200 and tokenized["tokens"] == [1, 2, 3], tokenized
