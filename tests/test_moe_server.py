"""Routing replay over HTTP: ``/generate`` (SGLang's request fields and ``meta_info``) and the OpenAI
completions endpoint carry the same routed experts as the Python API; bad requests are 400s."""

from __future__ import annotations

import numpy as np

from rollout import Engine, SamplingParams
from rollout.outputs import routed_experts_from_base64
from test_moe import moe_path
from server_harness import server_client


def test_routed_experts_over_generate_and_openai_equal_the_python_api(tiny_dir):
    path = moe_path(tiny_dir, "qwen3_moe_dense_layers")
    prompt = [5, 9, 33, 7, 81, 4]
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, return_routed_experts=True,
                            routed_experts_start_len=2)
    with Engine(path, dtype="float32", device="cpu", enable_return_routed_experts=True) as engine:
        (want,) = engine.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    want = want.outputs[0].routed_experts
    layers, top_k = want.shape[1:]
    with server_client(path, "--dtype", "float32", "--device", "cpu", "--enable-return-routed-experts") as http:
        body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
                "return_routed_experts": True, "routed_experts_start_len": 2}
        meta = http.post("/generate", json=body).json()["meta_info"]
        assert meta["routed_experts_start_len"] == 2
        np.testing.assert_array_equal(routed_experts_from_base64(meta["routed_experts"], layers, top_k), want)
        events = [line for line in http.post("/generate", json={**body, "stream": True}).text.splitlines()
                  if line.startswith("data: {")]
        import json

        last = json.loads(events[-1][len("data: "):])["meta_info"]
        np.testing.assert_array_equal(routed_experts_from_base64(last["routed_experts"], layers, top_k), want)
        choice = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                    "ignore_eos": True, "return_routed_experts": True,
                                                    "routed_experts_start_len": 2}).json()["choices"][0]
        np.testing.assert_array_equal(routed_experts_from_base64(choice["routed_experts"], layers, top_k), want)
        plain = http.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}).json()
        assert "routed_experts" not in plain["meta_info"]
        r = http.post("/generate", json={"input_ids": prompt, "routed_experts_start_len": 1})
        assert r.status_code == 400 and "needs return_routed_experts=true" in r.text
        r = http.post("/generate", json={"input_ids": prompt, "return_routed_experts": True,
                                         "routed_experts_start_len": 7})
        assert r.status_code == 400 and "must be at most the prompt length" in r.text


def test_routed_experts_refused_over_http_when_the_option_is_off(tiny_dir):
    path = moe_path(tiny_dir, "mixtral")
    with server_client(path, "--dtype", "float32", "--device", "cpu") as http:
        r = http.post("/generate", json={"input_ids": [5, 6], "return_routed_experts": True})
        assert r.status_code == 400 and "--enable-return-routed-experts" in r.text
        r = http.post("/v1/completions", json={"prompt": [5, 6], "return_routed_experts": True})
        assert r.status_code == 400 and "--enable-return-routed-experts" in r.text
