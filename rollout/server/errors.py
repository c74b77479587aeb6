"""Structured JSON errors: every failure is answered with a status and a message, never a bare 500 page.

Serving endpoints answer OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; RL control
endpoints answer SGLang's ``{"success": false, "message"}``. A bad body is a 400 naming the field.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error", 503: "service_unavailable"}
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


class APIError(Exception):
    """Raised by handlers; answered as JSON with ``status`` (``param`` names the offending field)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def from_engine_error(exc: Exception) -> APIError:
    """The Engine's ValueError is the caller's fault (400); its RuntimeError means it cannot serve (503)."""
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    return APIError(503, str(exc))


def error_response(request: Request, status: int, message: str, param: str | None = None) -> JSONResponse:
    if request.url.path in getattr(request.app.state, "control_paths", ()):
        return JSONResponse({"success": False, "message": message}, status_code=status)
    body = {"error": {"message": message, "type": _TYPES.get(status, "server_error" if status >= 500
                                                            else "invalid_request_error"),
                      "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable sentence for pydantic's errors, and the first offending field."""
    for err in errors:
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
        if tuple(err.get("loc", ())) == ("body",):  # no body, or not a JSON object
            hint = " with the header Content-Type: application/json" if isinstance(err.get("input"), bytes) else ""
            return f"the request body must be a JSON object{hint} (got {_short(err.get('input'))})", None
    parts: dict[str, None] = {}
    unions: set[str] = set()
    first = None
    for err in errors:
        loc = err.get("loc", ())
        field = _field_path(loc)
        first = first or field
        if err.get("type") == "extra_forbidden":
            parts[f"unknown parameter {field!r}"] = None
        elif err.get("type") == "missing":
            parts[f"missing required parameter {field!r}"] = None
        elif _is_union(loc):  # a value that matched none of a union's types: say so once, with the value
            top = _field_path(loc[:2])
            if top not in unions:
                unions.add(top)
                parts[f"invalid value for {top!r}: it matches none of the accepted types "
                      f"(got {_short(err.get('input'))})"] = None
        else:
            parts[f"invalid value for {field!r}: {err.get('msg')} (got {_short(err.get('input'))})"] = None
    unique = list(parts)
    return "; ".join(unique[:3]) + (f" (and {len(unique) - 3} more)" if len(unique) > 3 else ""), first


def _field_path(loc: Any) -> str:
    """``("body", "messages", 0, "role")`` → ``messages.0.role``; drops union-member tags like ``list[int]``."""
    items = [x for x in loc if x != "body"]
    kept = [str(x) for x in items if isinstance(x, int) or ("[" not in x and x not in _TYPE_TAGS and
                                                            not x[:1].isupper() and not x.startswith("function-"))]
    return ".".join(kept) or "body"


def _is_union(loc: Any) -> bool:
    return any(isinstance(x, str) and ("[" in x or x in _TYPE_TAGS) for x in loc)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def install_error_handlers(app: FastAPI) -> None:
    """Answer validation errors with 400, APIError with its status, and anything unexpected with 500."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return error_response(request, 400, message, param)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request, exc.status, exc.message, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no endpoint {request.method} {request.url.path}"
        if exc.status_code == 405 and exc.headers and "Allow" in exc.headers:
            message = f"method {request.method} is not allowed on {request.url.path} (allowed: {exc.headers['Allow']})"
        response = error_response(request, exc.status_code, message)
        response.headers.update(exc.headers or {})  # e.g. a 405's Allow, which RFC 9110 requires
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error in %s %s", request.method, request.url.path)
        return error_response(request, 500, f"internal error: {type(exc).__name__}: {exc}")
