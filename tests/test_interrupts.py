"""Interrupting generation in RL loops: ``pause_generation`` in its three modes, ``abort``, and what a caller
sees of the requests it interrupted (SGLang's and vLLM's semantics)."""

from __future__ import annotations

import threading
import time

import pytest

from rollout import Engine, SamplingParams
from rollout.io_struct import BatchTokenOut

LONG = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True, logprobs=0)


def _wait_for_tokens(engine, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.get_server_info()["gen_tokens"] < n:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def _slow_outputs(engine, delay_s: float) -> None:
    """Hold every token message ``delay_s`` in the receiver before it applies: the aborted requests' last outputs
    (which go through the detokenizer) then surely come after the pause call's reply (which does not)."""
    tm = engine.tokenizer_manager
    dispatch = tm._dispatch

    def slow(msg):
        if isinstance(msg, BatchTokenOut) and any(out.finished is not None for out in msg.outs):
            time.sleep(delay_s)
        dispatch(msg)

    tm._dispatch = slow


def test_pause_abort_returns_once_the_aborted_requests_have_returned(path, hf_reference):
    """SGLang's ``pause_generation(mode="abort")`` returns once no request is in flight (it waits for the
    tokenizer manager's requests to end), vLLM's ``pause_generation`` once its requests have drained: a trainer
    that pauses, then reads the partial rollouts and pushes weights, must find every request finished. Here the
    call returned when the scheduler had aborted them, before their last outputs reached the caller."""
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    with Engine(path, dtype="float32", device="cpu") as engine:
        _slow_outputs(engine, 0.3)
        for _ in range(2):
            box: dict = {}
            worker = threading.Thread(target=lambda: box.setdefault("out", engine.generate(
                prompt_token_ids=prompts, sampling_params=LONG, use_tqdm=False)))
            worker.start()
            _wait_for_tokens(engine, engine.get_server_info()["gen_tokens"] + 8)
            assert engine.pause_generation(mode="abort")
            assert engine.get_num_unfinished_requests() == 0
            worker.join(5)
            assert not worker.is_alive(), "generate still waits after pause_generation(mode='abort') returned"
            engine.continue_generation()
            hf = hf_reference(path)
            for prompt, out in zip(prompts, box["out"]):
                c = out.outputs[0]
                assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 400
                assert len(c.token_logprobs) == len(c.token_weight_versions) == len(c.token_ids)
                assert c.token_ids == hf.greedy(prompt, len(c.token_ids))
        assert engine.get_load()["kv_used"] == 0


def _scheduler(path: str, **options):
    """A scheduler driven in this process (float32, CPU, no tokenizer)."""
    import torch

    from rollout.config import EngineConfig, ModelConfig
    from rollout.distributed import TPGroup
    from rollout.scheduler.scheduler import Scheduler

    config = EngineConfig(path, dtype="float32", device="cpu", skip_tokenizer_init=True, **options)
    return Scheduler(config, ModelConfig.from_path(path), TPGroup(), torch.device("cpu"))


def test_requests_aborted_for_a_waiting_update_return_before_it_runs(path):
    """An update queued behind running requests (no ``update_weights_in_flight``) runs once they are aborted; their
    final outputs must leave before it starts, since the update may wait on the trainer (a broadcast it sends only
    after ``pause_generation`` returned, and that call waits for those outputs). They were sent after it."""
    from rollout.io_struct import GenerateReq, PauseGenerationReq, UpdateWeightsFromDiskReq

    sched = _scheduler(path)
    events: list[tuple[str, object]] = []
    sched.reply = lambda reply: events.append(("reply", reply.cid))
    sched.outputs.send = lambda batch: events.extend(("out", o.rid) for o in batch.outs if o.finished is not None)
    sched.handle(GenerateReq("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True), 0))
    for _ in range(4):
        sched.step()
    sched.handle(UpdateWeightsFromDiskReq(model_path=path, cid=1))  # waits for "r"
    sched.handle(PauseGenerationReq(mode="abort", cid=2))
    while sched.busy:
        sched.step()
    sched.emit()
    assert events == [("reply", 2), ("out", "r"), ("reply", 1)], events


def test_a_retracted_stream_gets_the_tokens_it_has_before_it_runs_again(path, hf_reference):
    """A streaming request retracted (by ``pause_generation(mode="retract")``, or for want of KV slots) had its last
    sampled tokens held back until it was re-admitted: for the whole pause (a weight update), or as long as the
    pool stays full. SGLang streams every token once its step is read."""
    from rollout.io_struct import ContinueGenerationReq, GenerateReq, PauseGenerationReq

    sched = _scheduler(path)
    sent: dict[str, list[int]] = {}
    sched.outputs.send = lambda batch: [sent.setdefault(o.rid, []).extend(o.token_ids) for o in batch.outs]
    sched.reply = lambda reply: None
    prompt = [5, 6, 7]
    sched.handle(GenerateReq("s", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), 0,
                             stream=True))
    for _ in range(6):
        sched.step()
    sched.handle(PauseGenerationReq(mode="retract", cid=1))
    sched.emit()  # the scheduler loop's idle pass
    req = sched.waiting[0]
    assert len(req.output_ids) >= 5 and sent["s"] == req.output_ids
    sched.handle(ContinueGenerationReq(cid=2))
    while sched.busy:
        sched.step()
    sched.emit()
    assert sent["s"] == hf_reference(path).greedy(prompt, 40)


def test_abort_takes_several_ids_as_vllm_does(path):
    """vLLM's ``abort_request`` takes one id or an iterable of them; a list raised "unhashable type" here."""
    with Engine(path, dtype="float32", device="cpu") as engine:
        box: dict = {}
        worker = threading.Thread(target=lambda: box.setdefault("out", engine.generate(
            prompt_token_ids=[[5, 6, 7], [8, 9, 10], [11, 12]], sampling_params=LONG, request_id=["a", "b", "c"],
            use_tqdm=False)))
        worker.start()
        _wait_for_tokens(engine, 8)
        assert engine.abort(["a", "c", "unknown"])
        worker.join(60)
        assert [o.outputs[0].finish_reason for o in box["out"]] == ["abort", "length", "abort"]
        assert not engine.abort(["a", "unknown"])
        with pytest.raises(ValueError, match="request ids"):
            engine.abort(["a", 3])
