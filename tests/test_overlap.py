"""Overlap scheduling: decode step N+1 is launched before step N's tokens reach the host, and the outputs
are exactly those of the engine without overlap and of transformers."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import prompts_of_lengths
from rollout import Engine, SamplingParams
from rollout.config import EngineConfig, ModelConfig
from rollout.distributed import TPGroup
from rollout.io_struct import GenerateReq
from rollout.scheduler.scheduler import Scheduler


def _mixed_params(stop_token: int) -> list[SamplingParams]:
    """Requests that end at different steps and for different reasons, some sampling, some penalized."""
    return [
        SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_new_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=[stop_token], logprobs=2),
        SamplingParams(temperature=0.9, seed=5, max_new_tokens=13, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.7, seed=6, max_new_tokens=16, min_new_tokens=10, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.0, max_new_tokens=12, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_new_tokens=9, frequency_penalty=0.5, presence_penalty=0.3,
                       ignore_eos=True, logprobs=0, logprobs_mode="processed"),
        SamplingParams(temperature=0.0, max_new_tokens=25),
    ]


def _run(path: str, overlap: bool, prompts, params, **options):
    """(token ids, finish reason, sampled-token logprobs, {token: logprob} per position) per request."""
    with Engine(path, dtype="float32", device="cpu", disable_overlap_schedule=not overlap, **options) as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        stats = engine.get_step_stats()
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].token_logprobs,
             [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs or []]) for o in outs], stats


def _assert_same(a, b) -> None:
    """Same tokens, finish reasons and logprob keys; logprob values within float noise (the rows a CPU
    matmul computes can differ in the last bits with the batch's size, which the request timing sets)."""
    for (ids_a, why_a, lp_a, top_a), (ids_b, why_b, lp_b, top_b) in zip(a, b, strict=True):
        assert (ids_a, why_a) == (ids_b, why_b)
        assert (lp_a is None) == (lp_b is None) and (lp_a or []) == pytest.approx(lp_b or [], abs=1e-5)
        assert [list(d) for d in top_a] == [list(d) for d in top_b]
        assert [v for d in top_a for v in d.values()] == pytest.approx([v for d in top_b for v in d.values()],
                                                                       abs=1e-5)


def test_overlap_equals_no_overlap_and_transformers(path, hf_reference):
    prompts = prompts_of_lengths([5, 9, 3, 12, 7, 4, 8, 6], seed=41)
    hf = hf_reference(path)
    stop_token = hf.greedy(prompts[2], 20)[4]  # request 2 stops on its fifth token
    params = _mixed_params(stop_token)
    with_overlap, stats = _run(path, True, prompts, params)
    without, _ = _run(path, False, prompts, params)
    _assert_same(with_overlap, without)
    assert with_overlap[2][1] == "stop" and len(with_overlap[2][0]) <= 5
    for i in (0, 1, 2, 7):
        expected = hf.greedy(prompts[i], params[i].max_new_tokens)
        n = len(with_overlap[i][0])
        assert with_overlap[i][0] == expected[:n]
    assert [len(o[0]) for o in with_overlap][:2] == [1, 7]
    assert sum(v["steps"] for v in stats["decode"].values()) >= 20


def test_overlap_under_kv_pressure_retracts_and_stays_exact(path, hf_reference):
    prompts = prompts_of_lengths([20, 24, 18, 22, 19, 21], seed=43)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    # no reserve for the running requests' next tokens: all are admitted and some must be retracted
    outs, stats = _run(path, True, prompts, params, max_total_tokens=96, schedule_conservativeness=0.0)
    assert stats["retractions"] > 0
    hf = hf_reference(path)
    for prompt, (ids, reason, _, _) in zip(prompts, outs):
        assert ids == hf.greedy(prompt, 24) and reason == "length"


def _scheduler(path: str, overlap: bool, **options) -> Scheduler:
    config = EngineConfig(path, dtype="float32", device="cpu", skip_tokenizer_init=True,
                          disable_overlap_schedule=not overlap, **options)
    return Scheduler(config, ModelConfig.from_path(path), TPGroup(), torch.device("cpu"))


def _launch_order(path: str, overlap: bool, prompts: list[list[int]], max_new: int,
                  **options) -> tuple[list[str], Scheduler]:
    """Drive a scheduler in this process; log every launch and every result read, in order."""
    sched = _scheduler(path, overlap, **options)
    events: list[str] = []
    launch, process = sched.launch, sched.process_results

    def logged_launch(reqs, inputs, sampled):
        events.append(f"launch {inputs.mode.value}")
        return launch(reqs, inputs, sampled)

    def logged_process(step):
        events.append(f"read {step.inputs.mode.value}")
        return process(step)

    sched.launch, sched.process_results = logged_launch, logged_process
    ids = itertools.count()
    for p in prompts:
        sched.handle(GenerateReq(f"r{next(ids)}", p, SamplingParams(temperature=0.0, max_new_tokens=max_new,
                                                                  ignore_eos=True), seed=0))
    while sched.busy:
        sched.step()
    return events, sched


def test_decode_step_is_launched_before_the_previous_one_is_read(path):
    prompts = prompts_of_lengths([6, 9], seed=44)
    events, sched = _launch_order(path, True, prompts, 5)
    # one prefill (read at once), then each decode is read only after the next one was launched;
    # the last decode step is launched without the requests the previous step ends by length
    assert events[:2] == ["launch extend", "read extend"]
    decode = events[2:]
    assert decode[:3] == ["launch decode", "launch decode", "read decode"]
    assert decode.count("launch decode") == decode.count("read decode") == 4
    assert sched.in_flight is None and not sched.running and sched.cache.allocator.available + \
        sched.cache.tree.total_size == sched.cache.allocator.num_slots
    plain, _ = _launch_order(path, False, prompts, 5)  # without overlap: launch, read, launch, read, ...
    assert all(e.startswith("launch") for e in plain[::2]) and all(e.startswith("read") for e in plain[1::2])


def test_prefill_batches_overlap_and_stay_exact(path, hf_reference):
    # 24-token prefill batches: five prompts need four batches (one prompt is chunked across two)
    prompts = prompts_of_lengths([10, 12, 9, 30, 11], seed=45)
    events, sched = _launch_order(path, True, prompts, 4, max_prefill_tokens=24, chunked_prefill_size=16)
    prefill = events[:events.index("launch decode")]
    assert prefill[:3] == ["launch extend", "launch extend", "read extend"]  # batch 2 launched before 1 is read
    assert prefill.count("launch extend") == prefill.count("read extend") >= 4
    assert sched.in_flight is None and not sched.running and sched.cache.allocator.available + \
        sched.cache.tree.total_size == sched.cache.allocator.num_slots
    hf = hf_reference(path)
    options = dict(max_prefill_tokens=24, chunked_prefill_size=16)
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    outs, _ = _run(path, True, prompts, params, **options)
    without, _ = _run(path, False, prompts, params, **options)
    _assert_same(outs, without)
    for prompt, (ids, reason, _, _) in zip(prompts, outs):
        assert ids == hf.greedy(prompt, 6) and reason == "length"


def test_prompt_shared_with_the_prefill_in_flight_waits_and_reuses_its_cache(path, hf_reference):
    # GRPO-style: four samples of one 40-token prompt, two per 80-token prefill batch
    prompt = prompts_of_lengths([40], seed=46)[0]
    params = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    with Engine(path, dtype="float32", device="cpu", max_prefill_tokens=80) as engine:
        outs = engine.generate(prompt_token_ids=[prompt] * 4, sampling_params=params, use_tqdm=False)
    expected = hf_reference(path).greedy(prompt, 3)
    assert [o.outputs[0].token_ids for o in outs] == [expected] * 4
    assert [o.num_cached_tokens for o in outs].count(0) == 1  # only the first computes the prompt


def test_a_prompt_that_fits_a_batch_is_not_split_across_two(path, hf_reference):
    # budget 24: 10 + 10 fit, the third 10-token prompt waits for the next batch whole (not 4 + 6); the
    # 30-token prompt, longer than any batch, is still chunked to fill the budget (14 + 16)
    prompts = prompts_of_lengths([10, 10, 10, 30], seed=47)
    sched = _scheduler(path, True, max_prefill_tokens=24, chunked_prefill_size=24)
    batches: list[list[int]] = []
    launch = sched.launch

    def logged_launch(reqs, inputs, sampled):
        if inputs.mode.value == "extend":
            batches.append(list(inputs.extend_lens))
        return launch(reqs, inputs, sampled)

    sched.launch = logged_launch
    for i, p in enumerate(prompts):
        sched.handle(GenerateReq(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True),
                                 seed=0))
    while sched.busy:
        sched.step()
    assert batches == [[10, 10], [10, 14], [16]]
    outs, _ = _run(path, True, prompts, SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True),
                   max_prefill_tokens=24, chunked_prefill_size=24)
    hf = hf_reference(path)
    assert [o[0] for o in outs] == [hf.greedy(p, 3) for p in prompts]


def test_load_counts_the_requests_whose_prefill_is_in_flight(path):
    """``get_load``'s running + waiting counts every unfinished request, also while the extend step that
    admits some of them is in flight (they are then neither waiting nor yet running); the GRPO bench's
    in-flight loop reads it to find a batch's tail."""
    prompts = prompts_of_lengths([10, 12, 9, 30, 11], seed=45)
    sched = _scheduler(path, True, max_prefill_tokens=24, chunked_prefill_size=16)
    for i, p in enumerate(prompts):
        sched.handle(GenerateReq(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True),
                                 seed=0))
    seen = []
    while sched.busy:
        sched.step()
        if sched.in_flight is not None and sched.in_flight.inputs.mode.value == "extend":
            load = sched.get_load()
            seen.append(load["running"] + load["waiting"])
    assert len(seen) >= 3 and set(seen) == {len(prompts)}  # no request finishes within 4 tokens of prefill
