"""The TokenizerManager's request sinks when the caller has gone: an asyncio caller whose event loop closed
(its task cancelled, ``asyncio.run`` returned) before the abort's last output came back, and a sink that raises.
Neither may stop the other requests' updates, and ``close`` must still close the ZeroMQ context: one left open
hangs the garbage collector later (``zmq.Context.__del__`` waits in ``term`` for sockets it no longer sees).

A TokenizerManager over a fresh IPC directory with no engine behind it; its sinks are called the way the
receiver thread calls them.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest

from rollout.config import EngineConfig
from rollout.engine_outputs import _future_sink
from rollout.io_struct import BatchTokenOut, ControlReply, FinishReason, SchedulerError, TokenOut
from rollout.ipc import IPCPaths
from rollout.request_state import ReqState
from rollout.sampling_params import SamplingParams
from rollout.tokenizer_manager import TokenizerManager


@pytest.fixture
def tm(tmp_path):
    paths = IPCPaths.create()
    manager = TokenizerManager(EngineConfig(model_path=str(tmp_path)), paths, None, None, 64, lambda: True)
    yield manager
    manager.close()
    paths.remove()


def register(tm: TokenizerManager, state: ReqState) -> ReqState:
    tm.states[state.rid] = state
    for sub in state.sub_rids():
        tm.sub_to_state[sub] = (state, 0)
    return state


def closed_loop_sink() -> object:
    """The sink ``async_generate`` gives a request, after its event loop has closed."""
    loop = asyncio.new_event_loop()
    sink = _future_sink(loop, loop.create_future())
    loop.close()
    return sink


def test_a_closed_event_loop_takes_the_last_output_silently():
    state = ReqState("r", None, [1], SamplingParams(), closed_loop_sink())
    state.error = "aborted"  # finished: the sink wants to resolve the caller's future
    state.sink(state)  # raised "Event loop is closed" in the receiver thread (and in close(), below)


def test_close_fails_every_request_and_closes_the_context_whatever_a_sink_does(tm):
    def broken(state: ReqState) -> None:
        raise KeyError("a bug in the caller's sink")

    got: list[ReqState] = []
    register(tm, ReqState("gone", None, [1], SamplingParams(), closed_loop_sink()))
    register(tm, ReqState("broken", None, [1], SamplingParams(), broken))
    live = register(tm, ReqState("live", None, [1], SamplingParams(), got.append))
    tm.close()
    assert got == [live] and live.error == "the engine was shut down"
    assert tm.states == {} and tm.sub_to_state == {}
    assert tm.ctx.closed and all(s.closed for s in (tm.recv, tm.to_scheduler, tm.to_detokenizer))


def test_one_failing_sink_does_not_keep_the_others_of_a_message_from_theirs(tm):
    """Outputs of two requests in one message (``BatchTokenOut``), the first one's sink raising: the second still
    gets its tokens, and both finished requests are forgotten; the same for a ``SchedulerError``."""
    def broken(state: ReqState) -> None:
        raise RuntimeError("Event loop is closed")

    got: list[ReqState] = []
    register(tm, ReqState("a", None, [1], SamplingParams(), broken))
    live = register(tm, ReqState("b", None, [1], SamplingParams(), got.append))
    tm._dispatch(BatchTokenOut([TokenOut("a", [7], finished=FinishReason("abort")),
                                TokenOut("b", [8], finished=FinishReason("length"))]))
    assert got == [live] and live.seqs[0].token_ids == [8] and tm.states == {}
    register(tm, ReqState("c", None, [1], SamplingParams(), broken))
    later = register(tm, ReqState("d", None, [1], SamplingParams(), got.append))
    tm._dispatch(SchedulerError("test"))
    assert got == [live, later] and later.error == "the scheduler failed: test"


def test_a_cancelled_control_call_keeps_no_other_from_its_answer_or_failure(tm):
    """A caller may cancel the Future of a control call (``async_op=True``): its reply is dropped, and a
    failure of every call in flight still reaches the others."""
    cancelled, answered, failed = Future(), Future(), Future()
    tm.controls.update({1: cancelled, 2: answered, 3: failed})
    assert cancelled.cancel()
    tm._dispatch(ControlReply(cid=1, ok=True, result="late"))
    tm._dispatch(ControlReply(cid=2, ok=True, result="ok"))
    assert answered.result() == "ok"
    tm.controls[4] = cancelled
    tm._fail_all("the engine was shut down")
    with pytest.raises(RuntimeError, match="shut down"):
        failed.result()
    assert tm.controls == {}
