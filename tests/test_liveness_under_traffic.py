"""A dead engine subprocess is seen while messages keep arriving: a caller polling ``get_load()`` (a metrics
exporter, the HTTP server's /metrics) keeps control replies coming every few hundred milliseconds, and the
receiver only checked its children when half a second passed with no message, so a request waiting on a
killed detokenizer hung for as long as the poller ran."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from rollout.config import EngineConfig
from rollout.io_struct import ControlReply, GetLoadReq
from rollout.ipc import IPCPaths, socket
from rollout.request_state import ReqState
from rollout.sampling_params import SamplingParams
from rollout.tokenizer_manager import TokenizerManager


@pytest.fixture
def paths():
    p = IPCPaths.create()
    yield p
    p.remove()


def test_a_child_dying_under_a_stream_of_control_replies_fails_the_waiting_requests(tmp_path, paths):
    alive = threading.Event()
    alive.set()
    tm = TokenizerManager(EngineConfig(model_path=str(tmp_path)), paths, None, None, 64, alive.is_set)
    ctx = zmq.Context()
    replies = socket(ctx, zmq.PUSH, paths.tokenizer, bind=False)  # the scheduler's control replies
    stop = threading.Event()

    def poller() -> None:  # a reply every 0.1 s: the receiver's poll never times out
        while not stop.is_set():
            replies.send_pyobj(ControlReply(cid=-1, ok=True, result={}))
            stop.wait(0.1)

    failed = threading.Event()
    state = ReqState("r", None, [1, 2], SamplingParams(), lambda s: failed.set() if s.error else None)
    tm.states["r"], tm.sub_to_state["r"] = state, (state, 0)
    thread = threading.Thread(target=poller)
    thread.start()
    try:
        time.sleep(0.6)
        alive.clear()  # the detokenizer was killed
        assert failed.wait(5), "the request still waits on a dead engine while control replies keep coming"
        assert state.error == "an engine subprocess died unexpectedly"
        with pytest.raises(RuntimeError, match="died unexpectedly"):
            tm.control_async(GetLoadReq())  # any call now fails at once
    finally:
        stop.set()
        thread.join()
        replies.close(linger=0)
        ctx.term()
        tm.close()
