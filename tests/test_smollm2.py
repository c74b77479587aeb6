"""The default real model (SmolLM2-135M-Instruct, converted offline from PyPI): greedy answers equal transformers'."""

from __future__ import annotations

import pytest
import torch

from rollout import Engine, SamplingParams
from rollout.default_model import ensure_default_model

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 7 times 8?",
    "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?",
    "Give me a synonym for 'happy'.",
    "Explain photosynthesis in one sentence.",
    "List the first five prime numbers.",
    "What color is the sky on a clear day?",
    "How many legs does a spider have?",
    "Complete the sentence: The quick brown fox",
    "What is the largest planet in our solar system?",
    "Say hello in French.",
    "Why do we need sleep?",
]


@pytest.fixture(scope="module")
def model_path():
    return ensure_default_model()


def test_greedy_answers_equal_transformers(model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    params = SamplingParams(temperature=0.0, max_new_tokens=48, logprobs=0)
    with Engine(model_path, dtype="float32", device="cpu") as engine:
        outs = engine.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    for q, out in zip(QUESTIONS, outs):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1]:].tolist()
        got = out.outputs[0]
        assert got.token_ids == ref, q
        assert got.text == tok.decode(ref, skip_special_tokens=True), q
    assert outs[0].outputs[0].text.strip() == "The capital of France is Paris."
