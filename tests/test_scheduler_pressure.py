"""The scheduler with its knobs set tight: the context a small ``max_running_requests`` leaves, and every
request served exactly, its KV and prefix-cache locks given back, in a pool barely larger than one request."""

from __future__ import annotations

import pytest
import torch

from conftest import prompts_of_lengths
from rollout.config import EngineConfig, ModelConfig
from rollout.distributed import TPGroup
from rollout.io_struct import GenerateReq
from rollout.sampling_params import SamplingParams
from rollout.scheduler.scheduler import Scheduler


def _scheduler(path: str, **options) -> Scheduler:
    config = EngineConfig(path, dtype="float32", device="cpu", skip_tokenizer_init=True, **options)
    sched = Scheduler(config, ModelConfig.from_path(path), TPGroup(), torch.device("cpu"))
    sched.reply = lambda reply: None
    return sched


def _serve(sched: Scheduler, prompts: list[list[int]], max_tokens: int | None) -> list:
    """Run ``prompts`` greedily to their end; the scheduler's requests, in order."""
    for i, prompt in enumerate(prompts):
        sched.handle(GenerateReq(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                 ignore_eos=True), 0))
    reqs = [sched.outputs.live[f"r{i}"] for i in range(len(prompts))]
    for _ in range(10_000):
        if not sched.busy:
            break
        sched.step()
    assert not sched.busy
    return reqs


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("pool", [None, 1024], ids=["memory", "max_total_tokens"])
def test_one_running_request_keeps_the_whole_context(tiny_dir, hf_reference, page, pool):
    """``max_running_requests=1`` capped the pool at exactly the context, and the context is clipped to the pool
    less one slot: the engine served a context of 39 for context_length=40, refused a 39-token prompt (vLLM
    serves it, one token) and ended a max_tokens=None output a token before the context's end."""
    path = tiny_dir("llama")
    sched = _scheduler(path, context_length=40, max_running_requests=1, page_size=page, max_total_tokens=pool)
    assert sched.context_len == 40
    prompts = prompts_of_lengths([39, 10], seed=7)
    reqs = _serve(sched, prompts, None)
    hf = hf_reference(path)
    for prompt, req in zip(prompts, reqs):
        assert req.finished.type == "length", req.finished
        assert req.output_ids == hf.greedy(prompt, 40 - len(prompt))
    assert sched.cache.used == 0


@pytest.mark.parametrize("length, options", [(60, dict(disable_radix_cache=True)), (4, dict(page_size=4)),
                                             (12, dict(page_size=16))], ids=["no-cache", "page4", "page16"])
def test_samples_of_one_prompt_prefill_together_when_the_cache_cannot_share_it(tiny_dir, hf_reference, length,
                                                                              options):
    """Requests sharing a prompt the batch computes wait for its prefix-cache entry; with the cache disabled
    there is none, and a prompt of at most a page leaves no whole page to share: GRPO's n samples of one
    prompt were prefilled one per step (8 steps for n=8)."""
    path = tiny_dir("llama")
    sched = _scheduler(path, **options)
    prompt = prompts_of_lengths([length], seed=1)[0]
    reqs = _serve(sched, [prompt] * 8, 3)
    assert sched.stats.prefill_steps[0] == 1
    expected = hf_reference(path).greedy(prompt, 3)
    assert all(r.output_ids == expected and r.finished.type == "length" for r in reqs)
    assert sched.cache.used == 0
    assert sched.cache.allocator.available + sched.cache.tree.evictable_size == sched.cache.num_slots


def test_samples_of_a_chunked_prompt_reuse_it_from_its_last_chunk(tiny_dir, hf_reference):
    """A prompt longer than ``chunked_prefill_size`` completes in its last chunk's step; the samples sharing it
    that were admitted beside that chunk did not wait for its cache entry, and one of them computed the whole
    prompt again (122 prompt tokens for 4 samples of 60)."""
    path = tiny_dir("llama")
    sched = _scheduler(path, chunked_prefill_size=16, max_prefill_tokens=16)
    prompt = prompts_of_lengths([60], seed=1)[0]
    reqs = _serve(sched, [prompt] * 4, 3)
    assert sched.stats.prefill_tokens == 60 + 3  # the prompt once, then each sample's last prompt token
    expected = hf_reference(path).greedy(prompt, 3)
    assert all(r.output_ids == expected and r.finished.type == "length" for r in reqs)
    assert sched.cache.used == 0
