"""A batch reaches the scheduler as one message (``BatchGenerateReq``, as SGLang sends a batch): every sequence
of every request in it, in order, with the outputs of one-by-one submission; a bad batch sends nothing."""

from __future__ import annotations

import pytest

from rollout import SamplingParams
from rollout.io_struct import BatchGenerateReq, GenerateReq

PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]


@pytest.fixture
def sent(engine, monkeypatch):
    """The messages the engine's TokenizerManager sends to the scheduler during the test."""
    log = []
    sock = engine.tokenizer_manager.to_scheduler
    send = sock.send_pyobj

    def spy(msg, *args, **kwargs):
        log.append(msg)
        return send(msg, *args, **kwargs)

    monkeypatch.setattr(sock, "send_pyobj", spy)
    return log


def test_a_batch_is_one_message_with_the_same_outputs(engine, sent):
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True, n=2, logprobs=0)
    batch = engine.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    (msg,) = [m for m in sent if isinstance(m, (GenerateReq, BatchGenerateReq))]
    assert isinstance(msg, BatchGenerateReq) and len(msg.reqs) == 6  # 3 requests x n = 2, in order
    assert [r.input_ids for r in msg.reqs] == [p for p in PROMPTS for _ in range(2)]
    one_by_one = [engine.generate(prompt_token_ids=[p], sampling_params=params, use_tqdm=False)[0] for p in PROMPTS]
    for a, b in zip(batch, one_by_one):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_logprobs == pytest.approx(y.token_logprobs, abs=1e-5)


def test_a_lone_sequence_is_sent_as_itself(engine, sent):
    engine.generate(prompt_token_ids=PROMPTS[:1], sampling_params=SamplingParams(max_new_tokens=2), use_tqdm=False)
    assert [type(m) for m in sent if isinstance(m, (GenerateReq, BatchGenerateReq))] == [GenerateReq]


@pytest.mark.parametrize("prompts, kwargs, match", [
    (PROMPTS, dict(request_id=["same", "same", "other"]), "request_id must be distinct"),
    (PROMPTS[:2] + [[10 ** 9]], {}, "out of vocabulary"),
])
def test_a_bad_batch_sends_nothing_and_the_engine_keeps_serving(engine, sent, prompts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(prompt_token_ids=prompts, use_tqdm=False, **kwargs)
    assert not [m for m in sent if isinstance(m, (GenerateReq, BatchGenerateReq))]
    assert engine.get_num_unfinished_requests() == 0
    out = engine.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(max_new_tokens=2), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) <= 2 for o in out)


def test_a_batch_reusing_a_running_request_id_sends_nothing(engine, sent):
    tm = engine.tokenizer_manager
    long = SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)
    tm.submit_batch([(None, PROMPTS[0], long, lambda state: None, "busy")])  # a request still running
    try:
        with pytest.raises(ValueError, match="duplicate request id 'busy'"):
            tm.submit_batch([(None, p, long, lambda state: None, rid) for p, rid in zip(PROMPTS, ["a", "busy", "b"])])
        assert [m.rid for m in sent if isinstance(m, GenerateReq)] == ["busy"] and "a" not in tm.states
    finally:
        engine.abort("busy")
