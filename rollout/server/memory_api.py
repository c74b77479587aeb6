"""Colocation endpoints: SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation`` (body
``{"tags": [...]}``) and vLLM's ``/sleep?level=1``, ``/wake_up?tags=weights`` and ``GET /is_sleeping``.
Each answers ``{"success", "message", ...}`` with the engine's memory state; the rules of the control
endpoints apply (a 400 for a bad call, 403 on a non-loopback bind without an API key)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from rollout.server.control_api import _ok, _run, _state, require_control
from rollout.server.protocol import MemoryOccupationRequest

router = APIRouter(dependencies=[Depends(require_control)])


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request, body: MemoryOccupationRequest | None = None) -> dict[str, Any]:
    state = _state(request)
    result = await _run(state.call(state.engine.release_memory_occupation, (body or MemoryOccupationRequest()).tags))
    return _ok(f"released {result['released']}", **result)


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request, body: MemoryOccupationRequest | None = None) -> dict[str, Any]:
    state = _state(request)
    result = await _run(state.call(state.engine.resume_memory_occupation, (body or MemoryOccupationRequest()).tags))
    return _ok(f"resumed; still released: {result['released']}", **result)


@router.post("/sleep")
async def sleep(request: Request, level: int = Query(1)) -> dict[str, Any]:
    state = _state(request)
    result = await _run(state.call(state.engine.sleep, level))
    return _ok(f"asleep (level {level})", **result)


@router.post("/wake_up")
async def wake_up(request: Request, tags: list[str] | None = Query(None)) -> dict[str, Any]:
    state = _state(request)
    result = await _run(state.call(state.engine.wake_up, tags))
    return _ok(f"awake; still released: {result['released']}", **result)


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, Any]:
    state = _state(request)
    return {"is_sleeping": await _run(state.call(state.engine.is_sleeping))}
