"""An Engine held in a reference cycle is freed by the cyclic garbage collector, whose finalizer runs on
whatever thread triggered the collection, the TokenizerManager's receiver thread included (it allocates for
every output it unpickles). There ``close`` joined its own thread ("cannot join current thread"): the engine's
requests were never failed (a stream waited forever), the children were never stopped nor reaped (zombies)
and the IPC directory stayed. A finalizer that runs while the receiver holds the send lock (sending an abort)
must not deadlock either."""

from __future__ import annotations

import os
import threading

import zmq

from rollout.config import EngineConfig
from rollout.engine import _shutdown
from rollout.io_struct import BatchTokenOut, TokenOut
from rollout.ipc import IPCPaths, socket
from rollout.request_state import ReqState
from rollout.sampling_params import SamplingParams
from rollout.tokenizer_manager import TokenizerManager


class FakeProcs:
    def __init__(self, paths: IPCPaths) -> None:
        self.paths = paths
        self.stopped = threading.Event()

    def stop(self) -> None:
        self.paths.remove()
        self.stopped.set()


def _register(tm: TokenizerManager, state: ReqState) -> ReqState:
    tm.states[state.rid] = state
    tm.sub_to_state[state.rid] = (state, 0)
    return state


def test_the_engine_finalizer_run_by_the_receiver_thread_shuts_everything_down(tmp_path):
    paths = IPCPaths.create()
    procs = FakeProcs(paths)
    tm = TokenizerManager(EngineConfig(model_path=str(tmp_path)), paths, None, None, 64, lambda: True)
    errors: list[BaseException] = []

    def collect_here(state: ReqState) -> None:  # the collector fires in the receiver thread and frees the engine
        with tm.send_lock:  # ... while the receiver holds the send lock (as in ``abort``)
            try:
                _shutdown(tm, procs)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

    failed = threading.Event()
    _register(tm, ReqState("trigger", None, [1], SamplingParams(), collect_here))
    waiting = _register(tm, ReqState("stream", None, [1], SamplingParams(),
                                     lambda s: failed.set() if s.error else None))
    ctx = zmq.Context()
    out = socket(ctx, zmq.PUSH, paths.tokenizer, bind=False)  # the detokenizer's outputs
    out.send_pyobj(BatchTokenOut([TokenOut("trigger", [7])]))
    try:
        assert procs.stopped.wait(10), "the children were never stopped"
        assert not errors, errors
        assert failed.wait(5) and waiting.error == "the engine was shut down"
        tm.thread.join(5)
        assert not tm.thread.is_alive() and tm.ctx.closed and not os.path.exists(paths.root)
    finally:
        out.close(linger=0)
        ctx.term()
