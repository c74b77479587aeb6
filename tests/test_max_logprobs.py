"""vLLM's ``max_logprobs`` engine argument: requests may ask for that many top logprobs (default 20, -1: the whole
vocabulary), equal to transformers' top-k; more is refused with vLLM's message and the engine keeps serving. It
was a fixed cap of 20 (``logprobs=21`` a ValueError from SamplingParams, the server a 400 from its schema) and the
Ray actor accepted vLLM's ``max_logprobs`` and ignored it, so distillation runs asking for top-64 could not."""

from __future__ import annotations

import pytest
import torch

from rollout import Engine, SamplingParams
from rollout.config import EngineConfig
from rollout.server.server_args import ServerArgs
from trainer_adapters.ray_actor import engine_options

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def hf_top(model, ids: list[int], k: int) -> list[list[int]]:
    """transformers: the top-k ids of the next-token distribution after each of ``ids``."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [row.topk(k).indices.tolist() for row in lp]


def ranked(entry: dict, k: int) -> list[int]:
    return [tid for tid, lp in sorted(entry.items(), key=lambda item: item[1].rank) if lp.rank <= k]


def test_more_than_20_top_logprobs_equal_transformers(path, hf_reference):
    model, k = hf_reference(path).model, 48
    with Engine(path, dtype="float32", device="cpu", max_logprobs=-1) as engine:
        vocab = engine.model_config.vocab_size
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=k, prompt_logprobs=k)
        out = engine.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0]
        gen = out.outputs[0].token_ids
        top = hf_top(model, PROMPT + gen, k)
        assert [ranked(out.prompt_logprobs[i], k) for i in range(1, len(PROMPT))] == top[:len(PROMPT) - 1]
        assert [ranked(e, k) for e in out.outputs[0].logprobs] == top[len(PROMPT) - 1:-1]
        whole = engine.generate(prompt_token_ids=[PROMPT], use_tqdm=False,  # -1: the whole vocabulary
                                sampling_params=SamplingParams(temperature=0, max_tokens=1, logprobs=vocab))[0]
        assert len(whole.outputs[0].logprobs[0]) == vocab
        with pytest.raises(ValueError, match=f"Requested sample logprobs of {vocab + 1}, which is greater than max "
                                             f"allowed: {vocab}"):
            engine.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(logprobs=vocab + 1))


def test_more_than_max_logprobs_is_refused_with_vllms_message(engine):
    with pytest.raises(ValueError, match="Requested sample logprobs of 21, which is greater than max allowed: 20"):
        engine.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=2, logprobs=21))
    with pytest.raises(ValueError, match="Requested prompt logprobs of 30, which is greater than max allowed: 20"):
        engine.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=2, prompt_logprobs=30))
    out = engine.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=2, logprobs=20),
                          use_tqdm=False)[0].outputs[0]
    assert [len(e) for e in out.logprobs] in ([20, 20], [20, 21], [21, 20], [21, 21])  # the sampled token beside


def test_max_logprobs_is_checked_and_reaches_the_engine_from_every_front(path):
    with pytest.raises(ValueError, match="greater than the vocabulary size"):
        Engine(path, dtype="float32", device="cpu", max_logprobs=10**6)
    with pytest.raises(ValueError, match="max_logprobs must be an int >= -1"):
        EngineConfig(path, max_logprobs=-2)
    assert ServerArgs.from_cli(["--model-path", "/m", "--max-logprobs", "64"]).engine_kwargs()["max_logprobs"] == 64
    assert "max_logprobs" not in ServerArgs.from_cli(["--model-path", "/m"]).engine_kwargs()
    assert engine_options("m", max_logprobs=128)["max_logprobs"] == 128  # vLLM's engine argument (Ray actor)
    assert "max_logprobs" not in engine_options("m", max_logprobs=None)
