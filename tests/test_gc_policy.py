"""``rollout.gc_policy``: the caller's process submits a batch with the cyclic collector paused (a full
collection in the middle of a submission once held the rest of a batch back 166 ms on an H100)."""

from __future__ import annotations

import gc

import pytest

from rollout import SamplingParams
from rollout.gc_policy import deferred_gc, freeze_heap
from rollout.io_struct import BatchGenerateReq, GenerateReq


def test_deferred_gc_restores_the_previous_state():
    assert gc.isenabled()
    with deferred_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with deferred_gc():
            raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()
    try:
        with deferred_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()


def test_freeze_heap_exempts_what_is_alive():
    before = gc.get_freeze_count()
    kept = [[i] for i in range(100)]
    freeze_heap()
    try:
        assert gc.get_freeze_count() >= before + len(kept)
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_is_submitted_at_once_with_the_collector_paused(engine, monkeypatch, stream):
    seen = []
    sock = engine.tokenizer_manager.to_scheduler
    send = sock.send_pyobj

    def spy(msg, *args, **kwargs):
        if isinstance(msg, (GenerateReq, BatchGenerateReq)):
            seen.append((len(msg.reqs) if isinstance(msg, BatchGenerateReq) else 1, gc.isenabled()))
        return send(msg, *args, **kwargs)

    monkeypatch.setattr(sock, "send_pyobj", spy)
    params = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    outs = engine.generate(prompt_token_ids=[[5, 6, 7]] * 4, sampling_params=params, use_tqdm=False, stream=stream)
    outs = list(outs)
    assert seen == [(4, False)] and gc.isenabled() and outs
