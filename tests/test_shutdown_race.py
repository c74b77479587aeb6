"""A shutdown that lands between a caller's liveness check and its send (another thread calls ``shutdown`` while
this one submits or makes a control call): the caller gets the engine's RuntimeError, never a raw ZeroMQ error
from a closed socket, and never a request or call registered after ``close`` failed the others (it waited
forever)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollout.config import EngineConfig
from rollout.io_struct import GetLoadReq
from rollout.ipc import IPCPaths
from rollout.sampling_params import SamplingParams
from rollout.tokenizer_manager import TokenizerManager


@pytest.fixture
def tm(tmp_path):
    paths = IPCPaths.create()
    manager = TokenizerManager(EngineConfig(model_path=str(tmp_path)), paths, SimpleNamespace(vocab_size=512), None, 64,
                               lambda: True)
    yield manager
    manager.close()
    paths.remove()


def _shutdown_after_the_check(tm: TokenizerManager) -> None:
    """Make the next liveness check pass, then let another thread's ``close`` run before the caller sends."""
    check = tm._check_alive

    def check_then_close() -> None:
        check()
        tm._check_alive = check
        tm.close()

    tm._check_alive = check_then_close


def test_a_control_call_racing_shutdown_fails_cleanly(tm):
    _shutdown_after_the_check(tm)
    with pytest.raises(RuntimeError, match="shut down"):
        tm.control_async(GetLoadReq())
    assert tm.controls == {}


def test_a_request_racing_shutdown_fails_cleanly(tm):
    _shutdown_after_the_check(tm)
    with pytest.raises(RuntimeError, match="shut down"):
        tm.submit_batch([(None, [1, 2, 3], SamplingParams(), lambda state: None, "r")])
    assert tm.states == {} and tm.sub_to_state == {}
    assert tm.abort("r") is False
