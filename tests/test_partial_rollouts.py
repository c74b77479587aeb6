"""Partial rollouts across weight updates (``update_weights_in_flight``): a request keeps running while new
weights land at a step boundary, and ``token_weight_versions`` says which weights sampled each token.

The reference is transformers on both weight sets: the tokens before the update are the old model's greedy
tokens; after it, the new model continues from a KV cache that the old model computed for every position
before the update (what the engine keeps), so each later token is checked teacher-forced against exactly
that mix (greedy ids equal, logprobs within 5e-5: float32 noise over ~500 positions)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from reference import hf_greedy, hf_logprobs
from rollout import Engine, SamplingParams

PROMPT = [5, 17, 99, 3, 42, 7]
# long enough that an update sent after the first tokens lands before the request ends, even on a loaded machine
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=480, ignore_eos=True, logprobs=0)


def perturbed(path: str, seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def mixed_logprobs(old, new, prompt: list[int], out: list[int], k: int) -> torch.Tensor:
    """log_softmax rows for ``out[k:]`` when the KV of ``prompt + out[:k-1]`` comes from ``old`` and the rest
    (from ``out[k-1]`` on) from ``new``: the engine's state after an update between tokens k-1 and k."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        old(torch.tensor([prompt + out[:k - 1]]), past_key_values=cache, use_cache=True)
        logits = new(torch.tensor([out[k - 1:-1]]), past_key_values=cache, use_cache=True).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check_against_both_weight_sets(path: str, new_model, out: list[int], versions: list[str],
                                   logprobs: list[float], hf_reference) -> None:
    """Assert the split of one finished sequence (its tokens, versions, logprobs) into old and new tokens."""
    old = hf_reference(path).model
    assert len(versions) == len(out) == len(logprobs) == PARAMS.max_new_tokens
    k = versions.count("0")
    assert versions == ["0"] * k + ["1"] * (len(versions) - k), versions
    assert 1 < k < len(versions), f"the update did not land while the request ran (k={k})"
    assert out[:k] == hf_reference(path).greedy(PROMPT, k)
    lp = mixed_logprobs(old, new_model, PROMPT, out, k)
    assert lp.argmax(-1).tolist() == out[k:], "tokens after the update are not the new weights' greedy ones"
    chosen = lp[torch.arange(len(out) - k), torch.tensor(out[k:])]
    # float32 sums in another order than transformers', over up to 486 positions
    assert (chosen - torch.tensor(logprobs[k:])).abs().max() < 5e-5


def test_an_update_lands_in_flight_and_stream_chunks_carry_their_versions(path, hf_reference):
    new = perturbed(path, seed=1)
    with Engine(path, dtype="float32", device="cpu", update_weights_in_flight=True) as engine:
        stream = engine.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS, stream=True)
        chunks = [next(stream)]
        result = engine.update_weights_from_tensor(list(new.named_parameters()))
        chunks += list(stream)
    assert result["weight_version"] == "1" and chunks[-1].weight_version == "1"
    seqs = [c.outputs[0] for c in chunks]
    assert all(len(s.token_weight_versions) == len(s.token_ids) for s in seqs)
    check_against_both_weight_sets(path, new, [t for s in seqs for t in s.token_ids],
                                   [v for s in seqs for v in s.token_weight_versions],
                                   [lp for s in seqs for lp in s.token_logprobs], hf_reference)


def update_during_a_request(path: str, update) -> tuple[list[int], list[str], list[float]]:
    """Submit ``PROMPT`` (non-streaming) to an ``update_weights_in_flight`` engine, call ``update(engine)`` once
    it has sampled a few tokens, and return the request's (tokens, versions, logprobs) when it ends."""
    import threading

    with Engine(path, dtype="float32", device="cpu", update_weights_in_flight=True) as engine:
        box = {}
        worker = threading.Thread(target=lambda: box.setdefault("out", engine.generate(
            prompt_token_ids=[PROMPT], sampling_params=PARAMS, use_tqdm=False)))
        worker.start()
        _wait_for_tokens(engine, 1)
        update(engine)
        worker.join(120)
    c = box["out"][0].outputs[0]
    return c.token_ids, c.token_weight_versions, c.token_logprobs


def test_in_flight_update_then_whole_output_matches_both_weight_sets(path, hf_reference):
    """Non-streaming: the request is submitted, the update lands while it runs, the output splits exactly."""
    new = perturbed(path, seed=2)
    out = update_during_a_request(path, lambda engine: engine.update_weights_from_tensor(list(new.named_parameters())))
    check_against_both_weight_sets(path, new, *out, hf_reference)


def test_a_multi_call_update_session_freezes_running_requests_until_complete(path, hf_reference):
    """Half the tensors, a pause, then the rest: no token may be sampled from half-updated weights."""
    new = perturbed(path, seed=3)
    named = list(new.named_parameters())
    half = len(named) // 2

    def in_two_calls(engine) -> None:
        engine.update_weights_from_tensor(named[:half], flush_cache=False)
        assert engine.get_weight_state()["state"] == "updating"
        time.sleep(0.5)  # unfrozen, the request would step many times on the half-updated weights here
        engine.update_weights_from_tensor(named[half:])

    check_against_both_weight_sets(path, new, *update_during_a_request(path, in_two_calls), hf_reference)


def test_without_the_option_an_update_waits_for_the_request(path):
    new = perturbed(path, seed=4)
    with Engine(path, dtype="float32", device="cpu") as engine:
        stream = engine.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS, stream=True)
        next(stream)
        engine.update_weights_from_tensor(list(new.named_parameters()))
        versions = [v for c in stream for v in c.outputs[0].token_weight_versions]
    assert set(versions) == {"0"}


def _wait_for_tokens(engine, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.get_server_info()["gen_tokens"] < n:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_an_output_reports_the_version_that_sampled_its_last_token(path):
    """A request whose last step is read just before an in-flight update (the step in flight is read, then the
    update runs, then outputs are sent) reported the update's version, although no token of it was sampled by
    those weights. One request ends at every step here, for 300 steps, so every update lands right after one
    ends, however fast or slow the machine runs the steps against the updates."""
    new = perturbed(path, seed=5)
    named = list(new.named_parameters())
    prompts = [[5 + i % 400, 6, 7] for i in range(300)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=2 + i, ignore_eos=True) for i in range(300)]
    import threading

    with Engine(path, dtype="float32", device="cpu", update_weights_in_flight=True) as engine:
        box = {}
        worker = threading.Thread(target=lambda: box.setdefault("out", engine.generate(
            prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)))
        worker.start()
        _wait_for_tokens(engine, 1)
        for k in range(3):
            engine.update_weights_from_tensor(named, weight_version=f"v{k}")
        worker.join(120)
    outs = box["out"]
    assert any(len(set(o.outputs[0].token_weight_versions)) > 1 for o in outs), "no update landed mid-request"
    wrong = [(o.outputs[0].token_weight_versions[-1], o.weight_version) for o in outs
             if o.weight_version != o.outputs[0].token_weight_versions[-1]]
    assert not wrong, wrong


def test_a_prompt_part_way_through_its_chunked_prefill_is_prefilled_again_on_the_new_weights(tiny_dir):
    """An update landing between two chunks of a prompt: the request has sampled nothing yet, so all its tokens are
    the new weights' and say so. It kept the chunks the old weights computed, so those tokens were neither model's
    while every version named the new one (a trainer dropping the samples that span two versions kept it). It now
    starts its prefill again: its output is the new weights' greedy output exactly."""
    path = tiny_dir("llama", max_position_embeddings=4096)
    new = perturbed(path, seed=6)
    prompt = torch.randint(3, 500, (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, logprobs=0)
    import threading

    with Engine(path, dtype="float32", device="cpu", update_weights_in_flight=True, chunked_prefill_size=8,
                max_prefill_tokens=8) as engine:
        box = {}
        worker = threading.Thread(target=lambda: box.setdefault("out", engine.generate(
            prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)))
        worker.start()
        deadline = time.monotonic() + 60
        while engine.get_server_info()["prefill_tokens"] < 8:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        engine.pause_generation(mode="in_place")  # holds the prompt between two chunks while the update lands
        assert engine.get_server_info()["prefill_tokens"] < len(prompt), "the prefill ended before the update"
        engine.update_weights_from_tensor(list(new.named_parameters()))
        engine.continue_generation()
        worker.join(120)
    c = box["out"][0].outputs[0]
    assert c.token_weight_versions == ["1"] * 8
    assert c.token_ids == hf_greedy(new, prompt, 8, None)
    # a mixed KV may still give the greedy ids; its logprobs are off (by 0.28 here)
    assert max(abs(a - b) for a, b in zip(c.token_logprobs, hf_logprobs(new, prompt, c.token_ids))) < 5e-5


@pytest.mark.parametrize("how", ["in_flight", "retracted"])
def test_a_restarted_chunked_prefill_computes_its_prompt_logprobs_again_on_the_new_weights(tiny_dir, hf_reference, how):
    """A prompt part-way through its chunked prefill when an update lands: restarted by an update in flight (above), or
    retracted by ``pause_generation(mode="retract")`` before the update (the RL loop's pause, update, continue). It
    kept the prompt logprobs of the chunks the old weights computed: its output named only the new version, while its
    first 16 prompt logprobs were the old model's (off by up to 4.6). They are now computed again, all the new
    model's."""
    from rollout.config import EngineConfig, ModelConfig
    from rollout.distributed import TPGroup
    from rollout.io_struct import ContinueGenerationReq, GenerateReq, PauseGenerationReq, UpdateWeightsFromDiskReq
    from rollout.scheduler.scheduler import Scheduler

    path, new_path = tiny_dir("llama"), tiny_dir("llama", seed=1)
    config = EngineConfig(path, dtype="float32", device="cpu", skip_tokenizer_init=True,
                          update_weights_in_flight=how == "in_flight", chunked_prefill_size=8, max_prefill_tokens=8)
    sched = Scheduler(config, ModelConfig.from_path(path), TPGroup(), torch.device("cpu"))
    replies = []
    sched.reply = replies.append
    prompt = torch.randint(3, 500, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    sched.handle(GenerateReq("p", prompt, params, 0, return_prompt_logprobs=True))
    req = sched.outputs.live["p"]
    sched.step()
    sched.step()
    assert sched.prefill.chunked is req and req.prompt_lps, "the update must land between two chunks"
    if how == "retracted":
        sched.handle(PauseGenerationReq(mode="retract", cid=0))
        assert req in sched.waiting and req.prompt_lps
    sched.handle(UpdateWeightsFromDiskReq(model_path=new_path, cid=1))
    sched.step()
    sched.handle(ContinueGenerationReq(cid=2))
    while sched.busy:
        sched.step()
    assert all(r.ok for r in replies) and req.finished.type == "length" and req.token_versions == ["1", "1"]
    expected = hf_logprobs(hf_reference(new_path).model, prompt[:1], prompt[1:])
    assert len(req.prompt_lps) == len(expected) == len(prompt) - 1
    assert max(abs(a - b) for a, b in zip(req.prompt_lps, expected)) < 1e-4


def test_generate_gives_each_of_n_samples_the_version_of_its_last_token(path, tmp_path):
    """``/generate`` with ``n > 1`` across an in-flight update: each sample's ``meta_info.weight_version`` was the
    request's (the last message's, of whichever sample), so a sample that ended before the update reported the
    update's version although none of its tokens was sampled by those weights. The seed makes one of 8 samples
    end after 7 tokens (a stop token) while the others run on; the update is sent once it ended."""
    import shutil
    import threading

    import httpx

    from server_harness import running_server

    perturbed(path, seed=7).save_pretrained(tmp_path)
    for name in os.listdir(path):
        if "token" in name:
            shutil.copy(os.path.join(path, name), tmp_path)
    body = {"input_ids": PROMPT, "sampling_params": {"n": 8, "temperature": 1.0, "max_new_tokens": 400,
                                                      "stop_token_ids": [3, 4, 5, 6, 7], "seed": 3}}
    with running_server(path, "--update-weights-in-flight") as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as http:
        box = {}
        worker = threading.Thread(target=lambda: box.setdefault("answer", http.post("/generate", json=body)))
        worker.start()
        deadline = time.monotonic() + 60
        while (info := http.get("/get_server_info").json())["gen_tokens"] == 0 or info["running"] == 8:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert http.post("/update_weights_from_disk", json={"model_path": str(tmp_path)}).json()["success"]
        worker.join(120)
    metas = [item["meta_info"] for item in box["answer"].json()]
    last = [m["token_weight_versions"][-1] for m in metas]
    assert set(last) == {"0", "1"}, last  # some samples ended before the update, some after
    assert [m["weight_version"] for m in metas] == last


def test_a_version_named_during_a_session_that_fails_names_nothing(path):
    """A request runs while a push opens a session; the trainer names it (``update_weight_version``, SGLang's way),
    then a call of the push is refused: the weights are a mix and the request fails. The name stayed the served
    version, and the reload from disk that made the weights whole again (the original checkpoint) took it too,
    though the named weights never loaded. The name now goes with the failed session."""
    import pytest

    named = list(perturbed(path, seed=8).named_parameters())
    with Engine(path, dtype="float32", device="cpu", update_weights_in_flight=True) as engine:
        stream = engine.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS, stream=True)
        next(stream)
        engine.update_weights_from_tensor(named[:5], flush_cache=False)
        engine.update_weight_version("step-7")
        with pytest.raises(ValueError, match="wrong shape"):
            engine.update_weights_from_tensor([(named[5][0], torch.zeros(3))])
        with pytest.raises(RuntimeError, match="refuses to generate"):
            list(stream)
        assert engine.get_weight_state()["state"] == "inconsistent"
        assert engine.get_weight_version() == "0"
        assert engine.update_weights_from_disk(path)["weight_version"] == "1"
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        out = engine.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)
    assert out[0].weight_version == "1" and out[0].outputs[0].token_weight_versions == ["1"] * 4
