"""Bad input, through the Python API and over HTTP: every kind is refused with a clear error naming the
problem (ValueError / a 4xx), for that call only; afterwards the engine serves exactly as before, its
weights untouched and nothing left running, queued or holding KV."""

from __future__ import annotations

import glob
import math

import pytest
import torch

from rollout import Engine, SamplingParams
from server_harness import server_client

P = [[5, 6, 7]]  # a valid prompt
NAME = "model.layers.0.mlp.up_proj.weight"

# (what to call: a dict of Engine.generate kwargs, or a callable of the engine; words in the error)
PY_BAD = [
    (dict(), "no prompts"),
    (dict(prompts=[]), "no prompts"),
    (dict(prompts=["a"], prompt_token_ids=P), "not both"),
    (dict(prompt_token_ids=[[]]), "empty"),
    (dict(prompt_token_ids=[[5, 6, 10**6]]), "out of vocabulary"),
    (dict(prompt_token_ids=[[5, -1]]), "out of vocabulary"),
    (dict(prompt_token_ids=[[5.0, 6]]), "must be ints"),
    (dict(prompt_token_ids=[[True, 6]]), "must be ints"),
    (dict(prompt_token_ids=[[5] * 600]), "context length"),
    (dict(prompt_token_ids="5 6 7"), "prompt_token_ids must be"),
    (dict(prompt_token_ids=[[1, 2], 3]), "one list of token ids"),
    (dict(prompts=[1.5]), "unsupported prompt type float"),
    (dict(prompts=[{"foo": 1}]), "'prompt' or 'prompt_token_ids'"),
    (dict(prompt_token_ids=[[5, 6], [7, 8]], request_id=["a"]), "1 ids for 2 prompts"),
    (dict(prompt_token_ids=[[5, 6], [7, 8]], request_id="a"), "one id for 2 prompts"),
    (dict(prompt_token_ids=[[5, 6], [7, 8]], request_id=["a", "a"]), "distinct"),
    (dict(prompt_token_ids=[[5, 6], [7, 8]], request_id=[1, 2]), "distinct, non-empty strings"),
    (dict(prompt_token_ids=[[5, 6], [7, 8]], sampling_params=[{}]), "1 sampling_params for 2 prompts"),
    (dict(prompt_token_ids=P, sampling_params="greedy"), "SamplingParams or a dict"),
    (dict(prompt_token_ids=P, sampling_params={"temperature": math.inf}), "temperature must be a finite"),
    (dict(prompt_token_ids=P, sampling_params={"temperature": True}), "temperature must be a finite"),
    (dict(prompt_token_ids=P, sampling_params={"temperature": -1}), "temperature must be in"),
    (dict(prompt_token_ids=P, sampling_params={"top_p": 0}), "top_p must be in"),
    (dict(prompt_token_ids=P, sampling_params={"top_p": 1.5}), "top_p must be in"),
    (dict(prompt_token_ids=P, sampling_params={"top_k": -2}), "top_k must be in"),
    (dict(prompt_token_ids=P, sampling_params={"top_k": 2.5}), "top_k must be an int"),
    (dict(prompt_token_ids=P, sampling_params={"min_p": 2}), "min_p must be in"),
    (dict(prompt_token_ids=P, sampling_params={"max_tokens": -1}), "max_tokens must be in"),
    (dict(prompt_token_ids=P, sampling_params={"max_tokens": 1.5}), "max_tokens must be an int"),
    (dict(prompt_token_ids=P, sampling_params={"min_tokens": 5, "max_tokens": 2}), "min_tokens (5) must be <="),
    (dict(prompt_token_ids=P, sampling_params={"n": 0}), "n must be in"),
    # a huge n is refused up front (vLLM's bound); it built 10**7 sequences and the server died of it
    (dict(prompt_token_ids=P, sampling_params={"n": 10**7}), "n must be in [1, 16384], got 10000000"),
    (lambda e: SamplingParams(n=16385), "n must be in [1, 16384], got 16385"),
    (dict(prompt_token_ids=P, sampling_params={"stop": 123}), "stop must be a string or a list of strings"),
    (dict(prompt_token_ids=P, sampling_params={"stop": [""]}), "non-empty strings"),
    # every stop string is searched for after every token of every sample: 20,000 of them stalled the engine
    (lambda e: SamplingParams(stop=[f"s{i}" for i in range(65)]), "stop must hold at most 64 distinct strings, got 65"),
    (dict(prompt_token_ids=P, sampling_params={"stop_token_ids": 5}), "stop_token_ids must be a list"),
    (dict(prompt_token_ids=P, sampling_params={"stop_token_ids": [-1]}), "stop_token_ids must be non-negative"),
    (dict(prompt_token_ids=P, sampling_params={"stop_token_ids": [10**6]}), "stop_token_ids out of vocabulary"),
    (dict(prompt_token_ids=P, sampling_params={"logprobs": 50}), "Requested sample logprobs of 50"),
    (dict(prompt_token_ids=P, sampling_params={"logprobs": -1}), "logprobs must be in"),
    (dict(prompt_token_ids=P, sampling_params={"logprobs_mode": "weird"}), "logprobs_mode must be"),
    (dict(prompt_token_ids=P, sampling_params={"seed": "abc"}), "seed must be an int"),
    (dict(prompt_token_ids=P, sampling_params={"repetition_penalty": 0}), "repetition_penalty must be in"),
    (dict(prompt_token_ids=P, sampling_params={"frequency_penalty": 3}), "frequency_penalty must be in"),
    (dict(prompt_token_ids=P, sampling_params={"presence_penalty": math.nan}), "presence_penalty must be a finite"),
    (dict(prompt_token_ids=P, sampling_params={"ignore_eos": "yes"}), "ignore_eos must be a bool"),
    (dict(prompt_token_ids=P, sampling_params={"bogus": 1}), "unknown sampling parameter 'bogus'"),
    (dict(prompt_token_ids=P, sampling_params={"max_tokens": 3, "max_new_tokens": 4}), "name the same setting"),
    (dict(prompt_token_ids=P, sampling_params={"prompt_logprobs": 50}), "Requested prompt logprobs of 50"),
    (dict(prompt_token_ids=P, sampling_params={"prompt_logprobs": 1, "logprob_start_len": 10}),
     "must be less than the prompt length"),
    (dict(prompt_token_ids=P, sampling_params={"logprob_start_len": -1}), "logprob_start_len must be in"),
    (lambda e: e.pause_generation(mode="sometimes"), "pause mode must be one of"),
    (lambda e: e.update_weights_from_distributed([NAME], ["float32"], [[1]], group_name="nope"), "not initialized"),
    (lambda e: e.update_weights_from_distributed([NAME, NAME], ["float32"], [[1]]), "one length"),
    (lambda e: e.get_weights_by_name("model.nope.weight"), "unknown parameter name"),
    (lambda e: e.update_weights_from_disk("/no/such/checkpoint"), "/no/such/checkpoint"),
    (lambda e: e.update_weights_from_tensor({"model.nope.weight": torch.zeros(2)}), "unknown parameter name"),
    (lambda e: e.update_weights_from_tensor({NAME: torch.zeros(3, 3)}), "wrong shape"),
    (lambda e: e.update_weights_from_tensor({NAME: torch.zeros(128, 64, dtype=torch.int32)}), "floating-point"),
    (lambda e: e.update_weights_from_tensor({}), "no tensors"),
    (lambda e: e.update_weights_from_tensor({NAME: torch.empty(128, 64, device="meta")}), "meta tensor"),
    (lambda e: e.update_weights_from_tensor({NAME: torch.ones(128, 64).to_sparse()}), "sparse_coo tensor"),
    (lambda e: e.update_weights_from_tensor({NAME: torch.full((128, 64), math.nan)}, check_finite=True),
     "non-finite"),
    (lambda e: e.destroy_process_group("nope"), "no weight-update group named 'nope'"),
    (lambda e: e.init_process_group("127.0.0.1", 1, 1, 2, "g", backend="mpi"), "backend must be"),
    (lambda e: e.init_process_group("127.0.0.1", 1, 1, 2, "g", backend="nccl"), "needs a CUDA device"),
    (lambda e: e.rollback_weights(), "no kept copy"),
]

ENGINE_BAD = [  # engine options refused before any subprocess starts
    (dict(model_path="/no/such/model"), "no config.json"),
    (dict(tp_size=0), "tp_size must be an int >= 1"),
    (dict(bogus_option=1), "unknown engine options"),
    (dict(attention_backend="flashinfer"), "needs a CUDA device"),
    (dict(kv_cache_dtype="int4"), "kv_cache_dtype must be"),
    (dict(max_logprobs=-2), "max_logprobs must be an int >= -1"),
    (dict(page_size=0), "page_size must be >= 1"),
    (dict(max_running_requests=0), "max_running_requests must be >= 1"),
    (dict(context_length=10**6), "longer than the model's max_position_embeddings"),
]

# (method, path, JSON body or raw string, status, words in the message)
HTTP_BAD = [
    ("POST", "/v1/completions", '{"prompt": [5, 6, 7], "temperature": 1e309}', 400, "temperature must be a finite"),
    ("POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 10**9}, 400, "maximum context length is 512"),
    ("POST", "/v1/completions", {"prompt": [5] * 500, "max_tokens": 100}, 400, "500 in the prompt, 100 in the"),
    ("POST", "/v1/completions", {"prompt": []}, 400, "prompt is empty"),
    ("POST", "/v1/completions", {"prompt": [[5, 6], []]}, 400, "empty"),
    ("POST", "/v1/completions", {"prompt": [5, 6.5]}, 400, "'prompt'"),
    ("POST", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n must be in"),
    ("POST", "/v1/completions", {"prompt": "x", "n": 10**7}, 400, "n must be in [1, 16384], got 10000000"),
    ("POST", "/v1/completions", {"prompt": "x", "n": 10**7, "stream": True}, 400, "n must be in [1, 16384]"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 10**7, "stream": True},
     400, "n must be in [1, 16384]"),
    ("POST", "/generate", {"input_ids": [5, 6], "sampling_params": {"n": 10**7}}, 400, "n must be in [1, 16384]"),
    # n is bounded per prompt: prompts times n is bounded per request (64 x 16384 were a million sequences)
    ("POST", "/generate", {"input_ids": [[5, 6]] * 2, "sampling_params": {"n": 16384, "max_new_tokens": 1}}, 400,
     "at most 16384 sequences (prompts times n), got 32768 (2 prompts)"),
    ("POST", "/v1/completions", {"prompt": [[5]] * 8193, "n": 2, "max_tokens": 1, "stream": True}, 400,
     "at most 16384 sequences (prompts times n), got 16386"),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "Requested sample logprobs of 21"),
    ("POST", "/v1/completions", {"prompt": "x", "stop": 5}, 400, "'stop'"),
    ("POST", "/v1/completions", {"prompt": "x", "stop": [f"zq{i}" for i in range(20000)]}, 400,
     "stop must hold at most 64 distinct strings, got 20000"),
    ("POST", "/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of is not supported"),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 2}, 400, "top_p must be in"),
    ("POST", "/v1/completions", {"prompt": "x", "seed": "x"}, 400, "'seed'"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens must be in"),
    ("POST", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 1.0}}, 400, "logit_bias is not supported"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "invalid value for 'messages'"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, 400,
     "maximum context length"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, 400,
     '"auto" tool choice requires'),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                      "top_logprobs": 30}, 400, "Requested sample logprobs of 30"),
    ("POST", "/generate", {"input_ids": [5, 6], "sampling_params": {"temperature": -1}}, 400,
     "temperature must be in"),
    ("POST", "/generate", {"input_ids": [[5, 6], [7]], "rid": ["a"]}, 400, "1 request ids for 2 prompts"),
    ("POST", "/generate", {"input_ids": [5, 6], "logprob_start_len": -5}, 400, "'logprob_start_len'"),
    ("POST", "/generate", {"input_ids": [[5, 6], [7]], "return_logprob": [True]}, 400,
     "1 return_logprob values for 2 prompts"),
    ("POST", "/generate", {"input_ids": [5, 6, 7], "return_logprob": True, "logprob_start_len": 100}, 400,
     "must be less than the prompt length"),
    ("POST", "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 10**9}}, 400,
     "maximum context length"),
    ("POST", "/generate", {"text": []}, 400, "no prompts"),
    ("POST", "/generate", {"input_ids": [[5], [6]], "sampling_params": [{}]}, 400, "1 sampling_params for 2"),
    ("POST", "/generate", {"input_ids": [5, 6], "sampling_params": {"stop": 9}}, 400, "stop must be"),
    ("POST", "/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400, "exactly one"),
    ("POST", "/detokenize", {"tokens": [10**6]}, 400, "out of vocabulary"),
    ("POST", "/tokenize", {"model": "no-such-model", "prompt": "x"}, 404, "does not exist"),  # as vLLM's
    ("POST", "/detokenize", {"model": "no-such-model", "tokens": [5]}, 404, "does not exist"),
    ("POST", "/abort_request", {"rid": 5}, 400, "'rid'"),
    ("POST", "/update_weights_from_distributed", {"names": [NAME], "dtypes": ["float32"], "shapes": [[-1]]}, 400,
     "non-negative ints"),
    ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 70000, "rank_offset": 1,
                                            "world_size": 2}, 400, "'master_port'"),
    ("POST", "/get_weights_by_name", {"name": "model.nope.weight"}, 400, "unknown parameter name"),
    ("POST", "/no_such_endpoint", {}, 404, "no endpoint"),
    ("GET", "/v1/completions", None, 405, "method GET is not allowed on /v1/completions (allowed: POST)"),
]


@pytest.fixture(scope="module")
def http(path):
    with server_client(path) as client:
        yield client


def test_the_suite_covers_at_least_fifty_kinds():
    assert len(PY_BAD) + len(ENGINE_BAD) + len(HTTP_BAD) >= 50


@pytest.mark.parametrize("call, words", PY_BAD, ids=[f"py{i}" for i in range(len(PY_BAD))])
def test_python_api_refuses_bad_input(engine, call, words):
    segments = set(glob.glob("/dev/shm/psm_*"))
    with pytest.raises(ValueError) as info:
        if callable(call):
            call(engine)
        else:
            engine.generate(**call, use_tqdm=False)
    assert words in str(info.value), str(info.value)
    assert set(glob.glob("/dev/shm/psm_*")) <= segments, "a refused push left its shared-memory segment behind"


@pytest.mark.parametrize("options, words", ENGINE_BAD, ids=[f"engine{i}" for i in range(len(ENGINE_BAD))])
def test_bad_engine_options_are_refused_before_start(path, options, words):
    kwargs = {"model_path": path, "device": "cpu", **options}
    with pytest.raises(ValueError) as info:
        Engine(**kwargs)
    assert words in str(info.value), str(info.value)


@pytest.mark.parametrize("method, url, body, status, words", HTTP_BAD,
                         ids=[f"http{i}" for i in range(len(HTTP_BAD))])
def test_http_refuses_bad_input(http, method, url, body, status, words):
    if isinstance(body, str):
        r = http.request(method, url, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.request(method, url, json=body)
    assert r.status_code == status, r.text
    answer = r.json()
    message = answer.get("message") if "success" in answer else answer["error"]["message"]
    assert words in message, message


def test_after_all_that_the_engine_serves_as_before(engine, http, path, hf_reference):
    """Runs after the bad calls above (pytest keeps file order): same weights, same greedy tokens, nothing
    left running, queued or holding KV."""
    hf = hf_reference(path)
    ref = [hf.greedy(p, 6) for p in ([5, 6, 7], [9, 10, 11, 12])]
    outs = engine.generate(prompt_token_ids=[[5, 6, 7], [9, 10, 11, 12]], use_tqdm=False,
                           sampling_params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert engine.get_weight_state()["state"] == "consistent" and engine.get_weight_version() == "0"
    load = engine.get_load()
    assert (load["running"], load["waiting"], load["kv_used"]) == (0, 0, 0), load
    got = http.post("/generate", json={"input_ids": [[5, 6, 7], [9, 10, 11, 12]], "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}).json()
    assert [g["output_ids"] for g in got] == ref
    info = http.get("/get_server_info").json()
    assert (info["running"], info["waiting"], info["kv_used"]) == (0, 0, 0), info
