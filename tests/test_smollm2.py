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
    """Each answer is transformers' greedy one: at every position the engine's token is the argmax of
    transformers' logits given the prompt and the answer so far (one teacher-forced forward per answer, which
    is what ``generate(do_sample=False)`` picks step by step), and it ends at EOS or at max_new_tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    params = SamplingParams(temperature=0.0, max_new_tokens=48, logprobs=0)
    with Engine(model_path, dtype="float32", device="cpu") as engine:
        outs = engine.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    for q, out in zip(QUESTIONS, outs):
        got, prompt = out.outputs[0], out.prompt_token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + list(got.token_ids)])).logits[0, len(prompt) - 1:-1]
        assert logits.argmax(-1).tolist() == list(got.token_ids), q
        assert len(got.token_ids) == 48 or got.token_ids[-1] in eos, q
        assert got.text == tok.decode(got.token_ids, skip_special_tokens=True), q
    assert outs[0].outputs[0].text.strip() == "The capital of France is Paris."
