"""The model's generation_config.json sampling values as defaults (vLLM's ``generation_config="auto"``, SGLang's
``--sampling-defaults model``): the Python API without sampling params, the OpenAI endpoints' unset fields, the
Ray actor; explicit params and ``/generate`` stay as given; ``sampling_defaults="openai"`` turns them off.

The tiny model's file sets top-k 1 (so the defaults sample greedily: checked against transformers' greedy),
temperature 0.8 and max_new_tokens 5."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest

from rollout import Engine, SamplingParams
from rollout.config import EngineConfig
from rollout.engine import _model_sampling_defaults
from trainer_adapters.ray_actor import EngineActor, engine_options

GENERATION_DEFAULTS = {"temperature": 0.8, "top_k": 1, "max_new_tokens": 5}
PROMPTS = [[5, 17, 23, 42], [9, 8, 7]]


def _with_generation_config(src: str, dst: str, values: dict) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "generation_config.json")
    config = json.load(open(path)) if os.path.isfile(path) else {}
    with open(path, "w") as f:
        json.dump({**config, **values}, f)
    return dst


@pytest.fixture(scope="module")
def model_dir(tiny_dir, tmp_path_factory):
    return _with_generation_config(tiny_dir("llama"), str(tmp_path_factory.mktemp("gen") / "m"), GENERATION_DEFAULTS)


@pytest.fixture(scope="module")
def expected(model_dir, hf_reference):
    """transformers' greedy continuation of each prompt, 5 tokens (the file's max_new_tokens) or to EOS."""
    ref = hf_reference(model_dir)
    return [ref.greedy(p, 5, stop_at_eos=True) for p in PROMPTS]


@pytest.fixture(scope="module")
def defaults_engine(model_dir):
    with Engine(model_dir, dtype="float32", device="cpu") as e:
        yield e


def test_python_api_without_params_takes_the_models_values(defaults_engine, expected):
    p = defaults_engine.get_default_sampling_params()
    assert (p.temperature, p.top_k, p.max_tokens, p.top_p) == (0.8, 1, 5, 1.0)
    assert defaults_engine.get_default_sampling_params() is not p  # a new object each call
    outs = defaults_engine.generate(PROMPTS, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    per_prompt = defaults_engine.generate(PROMPTS, [None, SamplingParams(max_tokens=7, temperature=0.0,
                                                                          ignore_eos=True)], use_tqdm=False)
    assert list(per_prompt[0].outputs[0].token_ids) == expected[0]
    assert len(per_prompt[1].outputs[0].token_ids) == 7  # given params are used as given: no cap, no top-k


def test_ray_actor_without_params_takes_the_models_values(defaults_engine, expected):
    actor = EngineActor.__new__(EngineActor)  # the actor's own sampling path, on the module's engine
    actor.engine, actor.logprobs_mode = defaults_engine, "processed"
    p = actor._one_sampling(None)
    assert (p.temperature, p.top_k, p.max_tokens, p.logprobs_mode) == (0.8, 1, 5, "processed")
    assert engine_options("m", generation_config="vllm")["sampling_defaults"] == "openai"
    assert engine_options("m", generation_config="auto")["sampling_defaults"] == "model"
    with pytest.raises(ValueError, match="generation_config"):
        engine_options("m", generation_config="/some/dir")


def test_openai_defaults_ignore_the_file(model_dir):
    """What ``Engine`` holds before it starts its processes (``Engine.sampling_defaults``)."""
    assert dict(_model_sampling_defaults(EngineConfig(model_path=model_dir))) == {
        "temperature": 0.8, "top_k": 1, "max_tokens": 5}
    assert dict(_model_sampling_defaults(EngineConfig(model_path=model_dir, sampling_defaults="openai"))) == {}
    with pytest.raises(ValueError, match="sampling_defaults"):
        EngineConfig(model_path=model_dir, sampling_defaults="vllm")


def test_a_bad_value_in_the_file_is_refused_at_start(tiny_dir, tmp_path):
    bad = _with_generation_config(tiny_dir("llama"), str(tmp_path / "bad"), {"top_p": 1.5})
    with pytest.raises(ValueError, match="generation_config.json.*top_p"):
        Engine(bad, dtype="float32", device="cpu")


def test_openai_endpoints_fill_unset_fields_and_generate_takes_its_params(model_dir, expected):
    from server_harness import running_server

    with running_server(model_dir) as srv, httpx.Client(base_url=srv.url, headers=srv.headers, timeout=60) as http:
        for i, prompt in enumerate(PROMPTS):
            # no temperature / top_k: the model's top-k 1 samples greedily; max_tokens 16 is capped at 5
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == expected[i]
        chat = {"messages": [{"role": "user", "content": "hi"}], "return_token_ids": True}
        r = http.post("/v1/chat/completions", json=chat)  # null max_tokens: to the context's end, capped at 5
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["token_ids"]) <= 5
        r = http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 9, "top_k": -1, "temperature": 0,
                                                "ignore_eos": True, "return_token_ids": True})
        assert len(r.json()["choices"][0]["token_ids"]) == 5  # the cap holds whatever else the request sets
        r = http.post("/generate", json={"input_ids": PROMPTS[1], "sampling_params": {
            "max_new_tokens": 9, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == 9  # SGLang's native endpoint: as given
