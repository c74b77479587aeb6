"""The FastAPI app: routes, the API-key check, per-request metrics, JSON errors, the Engine's lifetime.

``create_app(args)`` builds it; the Engine starts when the app starts (``/health`` answers 503 until it
is ready) and stops when the app stops. Besides the routers it serves ``GET /health``,
``GET /health_generate``, ``GET /metrics``, ``GET /get_server_info`` and ``GET /get_model_info``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout.sampling_params import SamplingParams
from rollout.server import control_api, generate_api, memory_api, openai_api
from rollout.server.errors import APIError, error_response, install_error_handlers
from rollout.server.metrics import CONTENT_TYPE
from rollout.server.server_args import ServerArgs
from rollout.server.state import ServerState

_LOAD_TIMEOUT_S = 2.0
_HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT


def create_app(args: ServerArgs, state: ServerState | None = None,
               on_engine_failure: Callable[[str], None] | None = None) -> FastAPI:
    """The server's app; ``state`` defaults to a fresh ServerState that starts an Engine from ``args``."""
    state = state or ServerState(args)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start(on_engine_failure)
        yield
        await asyncio.to_thread(state.shutdown)

    app = FastAPI(title="rollout-engine", lifespan=lifespan)
    app.state.server = state
    routers = (openai_api.router, generate_api.router, control_api.router, memory_api.router)
    for router in routers:
        app.include_router(router)
    app.state.control_paths = _paths(control_api.router.routes) | _paths(memory_api.router.routes)
    _add_basic_routes(app)
    install_error_handlers(app)
    known = _paths(app.routes).union(*(_paths(r.routes) for r in routers))
    app.add_middleware(GuardMiddleware, api_key=args.api_key, state=state, known_paths=known)
    return app


def _paths(routes: Any) -> frozenset[str]:
    return frozenset(r.path for r in routes if isinstance(r, Route))


def _add_basic_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        request.app.state.server.require_engine()
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        """SGLang's deeper check, which clients poll to wait for a server: 200 (empty) once the engine generated
        one token (greedy, from prompt [0], as SGLang's); 503 while it is not ready, or when that token did not
        come within 20 s (the request is then aborted)."""
        engine = request.app.state.server.require_engine()
        prompt = [{"prompt": None, "prompt_token_ids": [0]}]
        work = engine.async_generate(prompt, [SamplingParams(max_tokens=1, temperature=0.0)],
                                     request_id=[f"health-generate-{uuid.uuid4().hex}"])
        try:
            (out,) = await asyncio.wait_for(work, _HEALTH_GENERATE_TIMEOUT_S)  # cancelled on timeout: aborted
        except asyncio.TimeoutError:
            raise APIError(503, f"the engine generated no token within {_HEALTH_GENERATE_TIMEOUT_S:g} s") from None
        except (ValueError, RuntimeError) as e:
            raise APIError(503, f"the engine could not generate: {e}") from None
        if out.outputs[0].finish_reason == "abort":  # aborted by /abort_request abort_all or a pause
            raise APIError(503, "the health check's request was aborted")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state: ServerState = request.app.state.server
        return Response(state.metrics.render(await _engine_load(state)), media_type=CONTENT_TYPE)

    @app.get("/get_server_info")
    async def get_server_info(request: Request) -> dict[str, Any]:
        state: ServerState = request.app.state.server
        engine = state.require_engine()
        args = {k: v for k, v in dataclasses.asdict(state.args).items() if k != "api_key"}
        return {**args, **await state.call(engine.get_server_info), "version": _version()}

    @app.get("/get_model_info")
    async def get_model_info(request: Request) -> dict[str, Any]:
        state: ServerState = request.app.state.server
        return {"model_path": state.args.model_path, "tokenizer_path": state.args.tokenizer_path or
                state.args.model_path, "served_model_name": state.args.model_name, "is_generation": True}


async def _engine_load(state: ServerState) -> dict[str, Any] | None:
    """The scheduler's load, or None when there is no engine or it does not answer in time."""
    if state.not_ready_reason() is not None:
        return None
    fut = asyncio.wrap_future(state.engine.get_load(async_op=True))
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # a late failure is not an error here
    done, _ = await asyncio.wait({fut}, timeout=_LOAD_TIMEOUT_S)
    return fut.result() if done and fut.exception() is None else None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rollout-engine")
    except PackageNotFoundError:
        return "unknown"


class GuardMiddleware:
    """Checks ``Authorization: Bearer KEY`` (when a key is set) and counts every HTTP request by endpoint
    and status for /metrics. A plain ASGI middleware, so streamed responses pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str | None, state: ServerState, known_paths: frozenset[str]) -> None:
        self.app = app
        self.api_key = api_key
        self.state = state
        self.known_paths = known_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in self.known_paths else "other"
        status = {"code": 500}

        async def send_counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if self.api_key is not None and not self._authorized(scope):
                request = Request(scope, receive)
                response = error_response(request, 401, "missing or invalid API key: send the header "
                                          "'Authorization: Bearer <key>'")
                await response(scope, receive, send_counting)
                return
            await self.app(scope, receive, send_counting)
        finally:
            self.state.metrics.request_done(endpoint, status["code"])

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or [])
        value = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = value.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

