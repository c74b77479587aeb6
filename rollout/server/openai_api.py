"""OpenAI-compatible serving: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``.

Both generation endpoints take ``n``, ``stop``, ``seed``, ``logprobs`` and ``stream`` (server-sent events ending
in ``data: [DONE]``; ``stream_options.include_usage`` adds a last chunk with usage). Responses carry ``usage``
(with ``prompt_tokens_details.cached_tokens``) and ``weight_version``; with ``return_token_ids`` each choice also
has ``token_ids`` and ``prompt_token_ids``. Logprobs are raw (the model's own distribution) unless
``logprobs_mode="processed"``. A null ``max_tokens`` (and a chat request without one) generates until EOS or the
context is full; a prompt plus ``max_tokens`` longer than the context is a 400. A request's id is its
``X-Request-Id`` header, else its ``request_id`` (vLLM's order), else a fresh one; the response returns it as
``id`` and in its ``X-Request-Id`` header. ``/v1/completions`` takes ``echo``: each choice's text (and, with
``logprobs``, its logprobs object) starts with the prompt's, the first prompt token's logprob null; ``max_tokens``
may be 0 to score a prompt (lm-evaluation-harness's loglikelihood requests). Sampling fields a request leaves
unset take the model's ``generation_config.json`` values (``--sampling-defaults model``, the default; vLLM and
SGLang do the same), whose ``max_new_tokens`` also caps ``max_tokens``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from rollout.sampling_params import SamplingParams
from rollout.server.errors import APIError
from rollout.server.protocol import ChatCompletionRequest, CompletionRequest, OpenAICommon
from rollout.server.serving import (GenJob, StreamJob, check_model, event_error, open_stream, request_ids, run_job,
                                    sampling_params)
from rollout.server.openai_view import OpenAIView
from rollout.server.state import ServerState
from rollout.server.streaming import DONE, ClientGone, sse

router = APIRouter()

_SAMPLING_FIELDS = ("temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k",
                    "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                    "logprobs_mode", "return_routed_experts", "routed_experts_start_len")


def _state(request: Request) -> ServerState:
    return request.app.state.server


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = _state(request)
    card = {"id": state.args.model_name, "object": "model", "created": state.created, "owned_by": "rollout",
            "root": state.args.model_path}
    if state.engine is not None:
        card["max_model_len"] = state.engine.context_len
    return {"object": "list", "data": [card]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = _state(request)
    _check_common(state, body)
    for name, bad in (("suffix", body.suffix is not None), ("best_of", body.best_of not in (None, body.n))):
        if bad:
            raise APIError(400, f"{name} is not supported", name)
    texts, ids = _completion_prompts(body.prompt)
    params = _params(state, body, body.max_tokens, body.logprobs,
                     prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None)
    count = len(texts or ids)
    # null max_tokens: until the context is full
    rids = _rids(body, request, "cmpl-", count)
    job = GenJob(texts, ids, [params] * count, rids, to_context=body.max_tokens is None,
                 max_tokens_cap=_max_tokens_cap(state), group_id=rids[0].rsplit("-", 1)[0] if count > 1 else None)
    view = OpenAIView(state, body, job, "text_completion", chat=False)
    return await _respond(state, request, body, job, view)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
    _check_common(state, body)
    options = replace(body.template_options(), tools=_template_tools(body))
    if body.response_format not in (None, {"type": "text"}):
        raise APIError(400, "response_format is not supported", "response_format")
    if body.top_logprobs and not body.logprobs:  # vLLM's check and message
        raise APIError(400, "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    engine = state.require_engine()
    try:
        prompt = await state.tokenize(engine.apply_chat_template, [m.template_input() for m in body.messages], options)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    k = (body.top_logprobs or 0) if body.logprobs else None
    params = _params(state, body, max_tokens, k)
    job = GenJob(None, [prompt], [params], _rids(body, request, "chatcmpl-", 1), to_context=max_tokens is None,
                 length_param="max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
                 max_tokens_cap=_max_tokens_cap(state))
    view = OpenAIView(state, body, job, "chat.completion", chat=True)
    return await _respond(state, request, body, job, view)


async def _respond(state: ServerState, request: Request, body: OpenAICommon, job: GenJob, view: OpenAIView
                   ) -> Response:
    if body.stream:
        sj = StreamJob(state, job, await open_stream(state, job))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        resp = sj.response(_events(sj, view, include_usage))
        resp.headers["X-Request-Id"] = view.id  # the response's id, as vLLM (not one prompt's)
        return resp
    try:
        outs = await run_job(state, request, job)
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse(view.full(outs), headers={"X-Request-Id": view.id})


async def _events(sj: StreamJob, view: OpenAIView, include_usage: bool) -> AsyncIterator[str]:
    for event in view.opening():
        yield sse(event)
    try:
        async for chunk in sj.chunks():
            for event in view.delta(chunk):
                yield sse(event)
    except (ValueError, RuntimeError) as e:
        sj.done = True
        yield sse(event_error(e))
        yield DONE
        return
    if include_usage:
        yield sse(view.usage_chunk())
    yield DONE


# ---- requests → engine input ----------------------------------------------------------------------


def _check_common(state: ServerState, body: OpenAICommon) -> None:
    check_model(state, body.model)
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", "logit_bias")
    if body.stream_options is not None and not body.stream:  # vLLM's check and message
        raise APIError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
    if body.routed_experts_start_len and not body.return_routed_experts:  # as /generate answers it
        raise APIError(400, "routed_experts_start_len needs return_routed_experts=true", "routed_experts_start_len")


def _template_tools(body: ChatCompletionRequest) -> list[Any] | None:
    """The ``tools`` the chat template renders, checked as vLLM checks them on a server without a tool-call parser:
    an empty list is a 400 (vLLM's message); ``tool_choice: "none"`` renders the tools and calls none; tools without
    a ``tool_choice`` ask for "auto", a 400 with vLLM's message (clients that fall back to plain text on it do);
    "required", a named tool and ``parallel_tool_calls`` are a 400 "not supported" (vLLM forces them with
    structured outputs, which this engine lacks)."""
    if body.tools == []:
        raise APIError(400, "`tools` must not be an empty array. Either provide at least one tool or omit the field "
                       "entirely.", "tools")
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
    if choice == "auto":
        raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                       "(this server has no tool-call parser)", "tool_choice")
    if choice != "none" or body.parallel_tool_calls:
        raise APIError(400, "tool_choice other than \"none\" and parallel_tool_calls are not supported", "tool_choice")
    return body.tools


def _completion_prompts(prompt: Any) -> tuple[list[str] | None, list[list[int]] | None]:
    if isinstance(prompt, str):
        return [prompt], None
    if not prompt:
        raise APIError(400, "prompt is empty", "prompt")
    if isinstance(prompt[0], str):
        return list(prompt), None
    if isinstance(prompt[0], int):
        return None, [list(prompt)]
    return None, [list(p) for p in prompt]


def _params(state: ServerState, body: OpenAICommon, max_tokens: int | None, logprobs: int | None,
            prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's sampling fields over the model's defaults (``rollout.sampling_defaults``); the model's
    ``max_new_tokens`` caps a given ``max_tokens`` (a null one: ``GenJob.max_tokens_cap``)."""
    defaults = state.require_engine().sampling_defaults
    values = {name: value for name, value in defaults.items() if name != "max_tokens"}
    values.update({name: getattr(body, name) for name in _SAMPLING_FIELDS if getattr(body, name) is not None})
    cap = defaults.get("max_tokens")
    if max_tokens is not None:
        values["max_tokens"] = max_tokens if cap is None else min(max_tokens, cap)
    values["logprobs"] = logprobs
    values["prompt_logprobs"] = prompt_logprobs
    return sampling_params(values, param="request")


def _max_tokens_cap(state: ServerState) -> int | None:
    return state.require_engine().sampling_defaults.get("max_tokens")


def _rids(body: OpenAICommon, request: Request, prefix: str, count: int) -> list[str]:
    """One id per prompt: the ``X-Request-Id`` header's, else the body's ``request_id`` (vLLM's order,
    ``_base_request_id``), with ``-<i>`` per prompt of several; fresh ``<prefix><hex>`` ones without either."""
    given = request.headers.get("X-Request-Id") or body.request_id
    if given is not None and count > 1:
        return [f"{given}-{i}" for i in range(count)]
    return request_ids(prefix, count, given)
