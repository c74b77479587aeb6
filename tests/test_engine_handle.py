"""One engine-handle protocol: ``Engine``, ``EngineClient``, ``RemoteEngine`` and ``ActorEngine`` have every
``EngineHandle`` call with the same parameters and defaults; and every control call of ``Engine`` reaches
its scheduler-side handler by the name of its typed request."""

from __future__ import annotations

import inspect
import os
import re

import pytest

from rollout import Engine
from rollout.client import EngineClient
from rollout.engine_handle import EngineHandle
from trainer_adapters.handles import ActorEngine
from weight_sync.remote import RemoteEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTOCOL = sorted(n for n, v in vars(EngineHandle).items() if inspect.isfunction(v) and not n.startswith("_"))


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("impl", [Engine, EngineClient, RemoteEngine, ActorEngine], ids=lambda c: c.__name__)
def test_every_handle_has_the_protocol_calls_with_the_same_signatures(impl):
    assert len(PROTOCOL) >= 14
    for name in PROTOCOL:
        method = getattr(impl, name, None)
        assert callable(method), f"{impl.__name__} lacks {name}"
        assert _params(method) == _params(getattr(EngineHandle, name)), f"{impl.__name__}.{name}"


@pytest.mark.parametrize("impl", [Engine, EngineClient], ids=lambda c: c.__name__)
def test_sglangs_group_names_take_its_positional_arguments(impl):
    """SGLang's ``init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name,
    backend)`` and ``destroy_weights_update_group(group_name)`` are the OpenRLHF-named calls."""
    init = [n for n, _ in _params(impl.init_weights_update_group)]
    assert init[:6] == ["master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"]
    assert impl.init_weights_update_group is impl.init_process_group
    assert [n for n, _ in _params(impl.destroy_weights_update_group)][0] == "group_name"
    assert impl.destroy_weights_update_group is impl.destroy_process_group


def test_every_engine_control_call_reaches_its_scheduler_handler_by_name():
    """grep from an Engine method: its typed request → a handler table (``Scheduler.control_handlers``, with
    ``WeightSync.handlers``, ``MemoryOccupation.handlers`` and ``StepProfiler.handlers``) → the handler's
    definition in the same file."""
    engine_src = inspect.getsource(Engine)
    sources = [open(os.path.join(ROOT, *path.split("/"))).read()
               for path in ("rollout/scheduler/scheduler.py", "rollout/weights/sync.py", "rollout/scheduler/memory.py",
                            "rollout/scheduler/profiler.py")]
    requests = sorted(set(re.findall(r"\b([A-Z]\w+Req)\(", engine_src)))
    assert {"UpdateWeightsFromDistributedReq", "PauseGenerationReq", "UpdateWeightReq"} <= set(requests)
    for req in requests:
        found = [(src, m.group(1)) for src in sources
                 for m in [re.search(rf"\b{req}: (?:lambda req: )?self\.(?:stats\.)?(\w+)", src)] if m]
        assert len(found) == 1, f"{req}: {len(found)} handler table entries"
        src, handler = found[0]
        assert re.search(rf"def {handler}\(", src) or handler == "snapshot", f"{req} → {handler}: no such method"


def test_generate_reaches_the_scheduler_by_its_request_type():
    sched = open(os.path.join(ROOT, "rollout", "scheduler", "scheduler.py")).read()
    tm = open(os.path.join(ROOT, "rollout", "tokenizer_manager.py")).read()
    assert "GenerateReq(" in tm and "isinstance(msg, GenerateReq):\n            self.add_request(msg)" in sched


@pytest.mark.parametrize("level", [1.5, "2", 0, None])
def test_the_client_refuses_a_sleep_level_the_engine_refuses(level):
    """``Engine.sleep`` takes level 1 or 2 and refuses anything else; the client sent ``int(level)``, so 1.5 slept
    at level 1 and "2" at level 2 (no server is reached here: the refusal comes first, as the Engine's does)."""
    with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
        EngineClient("http://127.0.0.1:1").sleep(level)
