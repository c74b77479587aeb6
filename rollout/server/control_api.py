"""RL control endpoints with SGLang's names and JSON fields; each answers ``{"success", "message", ...}``.

Weight updates map onto the Engine's calls (docs/weight_sync.md): ``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/update_weights_from_disk``, ``/destroy_weights_update_group``;
control: ``/flush_cache``, ``/pause_generation``, ``/continue_generation``, ``/get_weight_version``,
``/update_weight_version``, ``/abort_request``, ``/start_profile``, ``/stop_profile``; verification:
``/get_weights_by_name``, ``/weights_fingerprint``, ``/get_weight_state``, ``/rollback_weights``. A bad call is a
400 (nothing is loaded), a failed transfer a 500; both carry the engine's message. On a non-loopback bind without an
API key every one of them answers 403.
"""

from __future__ import annotations

from typing import Any, Awaitable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from rollout.server.errors import APIError
from rollout.server.protocol import (AbortRequest, DestroyWeightsUpdateGroupRequest, EmptyRequest,
                                     GetWeightsByNameRequest, InitWeightsUpdateGroupRequest, PauseGenerationRequest,
                                     StartProfileRequest, UpdateWeightsFromDiskRequest,
                                     UpdateWeightsFromDistributedRequest, UpdateWeightVersionRequest)
from rollout.server.state import ServerState

_NOT_FLUSHED = "Cache not flushed: running requests still hold cache entries."


def _state(request: Request) -> ServerState:
    return request.app.state.server


def require_control(request: Request) -> ServerState:
    """The state, if control calls may run here: 403 on a non-loopback bind without a key, 503 if not ready."""
    state = _state(request)
    refusal = state.args.control_refusal
    if refusal is not None:
        raise APIError(403, refusal)
    state.require_engine()
    return state


router = APIRouter(dependencies=[Depends(require_control)])


async def _run(call: Awaitable[Any]) -> Any:
    """Await an engine call; its ValueError is a 400 and anything else a 500, with the engine's message."""
    try:
        return await call
    except ValueError as e:
        raise APIError(400, str(e)) from None
    except Exception as e:  # noqa: BLE001 - e.g. a transfer that failed mid-update
        raise APIError(500, f"{type(e).__name__}: {e}") from None


def _ok(message: str, **fields: Any) -> dict[str, Any]:
    return {"success": True, "message": message, **fields}


# ---- weight updates -------------------------------------------------------------------------------


@router.post("/init_weights_update_group")
async def init_weights_update_group(body: InitWeightsUpdateGroupRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    engine = state.engine
    await _run(state.wait(engine.init_process_group(
        body.master_address, body.master_port, body.rank_offset, body.world_size, body.group_name, body.backend,
        timeout=body.timeout, async_op=True)))
    last = body.rank_offset + engine.config.tp_size - 1
    return _ok(f"joined weight-update group {body.group_name!r} as ranks {body.rank_offset}..{last} "
               f"of {body.world_size}")


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(body: UpdateWeightsFromDistributedRequest, request: Request
                                          ) -> dict[str, Any]:
    state = _state(request)
    if body.abort_all_requests:
        _abort_all(state)
    return await _update(state, state.wait(state.engine.update_weights_from_distributed(
        body.names, body.dtypes, body.shapes, group_name=body.group_name, flush_cache=body.flush_cache,
        weight_version=body.weight_version, load_format=body.load_format, check_finite=body.check_finite,
        async_op=True)))


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    if body.load_format not in (None, "auto", "safetensors"):
        raise APIError(400, f"unsupported load_format {body.load_format!r} (use 'auto' or 'safetensors')")
    if body.abort_all_requests:
        _abort_all(state)
    return await _update(state, state.call(state.engine.update_weights_from_disk, body.model_path,
                                           weight_version=body.weight_version, load_format=body.load_format))


async def _update(state: ServerState, call: Awaitable[Any]) -> dict[str, Any]:
    state.sync_call_started()
    try:
        result = await _run(call)
    except APIError:
        state.sync_call_ended(None, ok=False)
        raise
    state.sync_call_ended(result, ok=True)
    done = "update complete" if result.get("complete") else "update session still open"
    return _ok(f"loaded {result.get('loaded')} tensors ({result.get('bytes')} bytes); {done}; weight version "
               f"{result.get('weight_version')}", **result)


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    await _run(state.wait(state.engine.destroy_process_group(body.group_name, async_op=True)))
    return _ok(f"left weight-update group {body.group_name!r}")


@router.post("/rollback_weights")
async def rollback_weights(request: Request) -> dict[str, Any]:
    state = _state(request)
    result = await _run(state.call(state.engine.rollback_weights))
    return _ok(f"weights rolled back to version {result.get('weight_version')}", **result)


# ---- control --------------------------------------------------------------------------------------


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> JSONResponse:
    """200 when flushed; 400 while running requests still hold cache entries (SGLang's status codes)."""
    state = _state(request)
    flushed = bool(await _run(state.call(state.engine.flush_cache)))
    return JSONResponse({"success": flushed, "message": "Cache flushed." if flushed else _NOT_FLUSHED},
                        status_code=200 if flushed else 400)


@router.post("/pause_generation")
async def pause_generation(request: Request, body: PauseGenerationRequest | None = None) -> dict[str, Any]:
    state = _state(request)
    mode = (body or PauseGenerationRequest()).mode
    await _run(state.call(state.engine.pause_generation, mode))
    return _ok(f"generation paused (mode {mode!r})")


@router.post("/continue_generation")
async def continue_generation(request: Request, body: EmptyRequest | None = None) -> dict[str, Any]:
    state = _state(request)
    await _run(state.call(state.engine.continue_generation))
    return _ok("generation continued")


@router.api_route("/get_weight_version", methods=["GET", "POST"])
async def get_weight_version(request: Request) -> dict[str, Any]:
    state = _state(request)
    return {"weight_version": await _run(state.call(state.engine.get_weight_version))}


@router.post("/update_weight_version")
async def update_weight_version(body: UpdateWeightVersionRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    if body.abort_all_requests:
        _abort_all(state)
    version = await _run(state.call(state.engine.update_weight_version, body.new_version))
    return _ok(f"weight version updated to {version}", new_version=version)


@router.post("/abort_request")
async def abort_request(body: AbortRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    if body.abort_all:
        return _ok(f"aborted {_abort_all(state)} request(s)")
    if not body.rid:
        raise APIError(400, "pass a request id ('rid') or abort_all=true")
    engine = state.require_engine()
    known = any([engine.abort(rid) for rid in state.request_ids(body.rid)])  # a list: abort every one
    return {"success": known, "message": f"aborted request {body.rid!r}" if known
            else f"no running request {body.rid!r}"}


def _abort_all(state: ServerState) -> int:
    rids = list(state.inflight)
    for rid in rids:
        state.engine.abort(rid)
    return len(rids)


@router.api_route("/start_profile", methods=["GET", "POST"])
async def start_profile(request: Request, body: StartProfileRequest | None = None) -> dict[str, Any]:
    state = _state(request)
    out = await _run(state.call(state.engine.start_profile, **(body or StartProfileRequest()).model_dump()))
    return _ok("Start profiling.", **out)


@router.api_route("/stop_profile", methods=["GET", "POST"])
async def stop_profile(request: Request) -> dict[str, Any]:
    state = _state(request)
    out = await _run(state.call(state.engine.stop_profile))
    return _ok("Stopped profiling; the traces are written.", **out)


# ---- verification ---------------------------------------------------------------------------------


@router.api_route("/get_weights_by_name", methods=["GET", "POST"])
async def get_weights_by_name(body: GetWeightsByNameRequest, request: Request) -> list[Any]:
    state = _state(request)
    return await _run(state.call(state.engine.get_weights_by_name, body.name, body.truncate_size))


@router.get("/weights_fingerprint")
async def weights_fingerprint(request: Request) -> dict[str, Any]:
    state = _state(request)
    return {"fingerprint": await _run(state.call(state.engine.weights_fingerprint))}


@router.get("/get_weight_state")
async def get_weight_state(request: Request) -> dict[str, Any]:
    state = _state(request)
    return await _run(state.call(state.engine.get_weight_state))
