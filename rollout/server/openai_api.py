"""OpenAI-compatible serving: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``.

Both generation endpoints take ``n``, ``stop``, ``seed``, ``logprobs`` and ``stream`` (server-sent
events ending in ``data: [DONE]``; ``stream_options.include_usage`` adds a last chunk with usage).
Responses carry ``usage`` (with ``prompt_tokens_details.cached_tokens``) and ``weight_version``; with
``return_token_ids`` each choice also has ``token_ids`` and ``prompt_token_ids``. Logprobs are raw (the
model's own distribution) unless ``logprobs_mode="processed"``. A null ``max_tokens`` (and a chat request
without one) generates until EOS or the context is full; a prompt plus ``max_tokens`` longer than the
context is a 400. ``/v1/completions`` takes ``echo``: each choice's text (and, with ``logprobs``, its
logprobs object) starts with the prompt's, the first prompt token's logprob null; ``max_tokens`` may be 0
to score a prompt (lm-evaluation-harness's loglikelihood requests).
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from rollout.outputs import CompletionOutput, RequestOutput
from rollout.sampling_params import SamplingParams
from rollout.server.errors import APIError
from rollout.server.protocol import ChatCompletionRequest, CompletionRequest, OpenAICommon
from rollout.server.serving import GenJob, StreamJob, event_error, open_stream, request_ids, run_job, sampling_params
from rollout.server.state import ServerState
from rollout.server.streaming import DONE, ClientGone, sse

router = APIRouter()

_SAMPLING_FIELDS = ("temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k",
                    "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                    "logprobs_mode")


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
    params = _params(body, body.max_tokens, body.logprobs,
                     prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None)
    count = len(texts or ids)
    # null max_tokens: until the context is full
    job = GenJob(texts, ids, [params] * count, _rids(body, "cmpl-", count), to_context=body.max_tokens is None)
    view = _View(state, body, job, "text_completion", chat=False)
    return await _respond(state, request, body, job, view)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
    _check_common(state, body)
    if body.tools or body.tool_choice not in (None, "none") or body.parallel_tool_calls:
        raise APIError(400, "tools and tool_choice are not supported", "tools")
    if body.response_format not in (None, {"type": "text"}):
        raise APIError(400, "response_format is not supported", "response_format")
    engine = state.require_engine()
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                for m in body.messages]
    try:
        prompt = engine.apply_chat_template(messages)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    k = (body.top_logprobs or 0) if body.logprobs else None
    params = _params(body, max_tokens, k)
    job = GenJob(None, [prompt], [params], _rids(body, "chatcmpl-", 1), to_context=max_tokens is None,
                 length_param="max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
    view = _View(state, body, job, "chat.completion", chat=True)
    return await _respond(state, request, body, job, view)


async def _respond(state: ServerState, request: Request, body: OpenAICommon, job: GenJob, view: "_View") -> Response:
    if body.stream:
        sj = StreamJob(state, job, await open_stream(state, job))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        resp = sj.response(_events(sj, view, include_usage))
        resp.headers["X-Request-Id"] = job.rids[0]
        return resp
    try:
        outs = await run_job(state, request, job)
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse(view.full(outs), headers={"X-Request-Id": job.rids[0]})


async def _events(sj: StreamJob, view: "_View", include_usage: bool) -> AsyncIterator[str]:
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
    if body.model not in (None, state.args.model_name, state.args.model_path):
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves {state.args.model_name!r}",
                       "model")
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", "logit_bias")


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


def _params(body: OpenAICommon, max_tokens: int | None, logprobs: int | None,
            prompt_logprobs: int | None = None) -> SamplingParams:
    values = {name: getattr(body, name) for name in _SAMPLING_FIELDS if getattr(body, name) is not None}
    if max_tokens is not None:
        values["max_tokens"] = max_tokens
    values["logprobs"] = logprobs
    values["prompt_logprobs"] = prompt_logprobs
    return sampling_params(values, param="request")


def _rids(body: OpenAICommon, prefix: str, count: int) -> list[str]:
    if body.request_id is not None and count > 1:
        return [f"{body.request_id}-{i}" for i in range(count)]
    return request_ids(prefix, count, body.request_id)


# ---- engine output → OpenAI JSON --------------------------------------------------------------------


class _View:
    """Renders one request's outputs as OpenAI JSON (whole, or chunk by chunk) and sums its usage."""

    def __init__(self, state: ServerState, body: OpenAICommon, job: GenJob, obj: str, chat: bool) -> None:
        self.tokenizer = state.engine.tokenizer if state.engine is not None else None
        self.model = state.args.model_name
        self.id = job.rids[0] if job.size == 1 else job.rids[0].rsplit("-", 1)[0]
        self.object = obj
        self.chat = chat
        self.n = body.n
        self.logprobs = body.logprobs if not chat else ((body.top_logprobs or 0) if body.logprobs else None)
        self.token_ids = body.return_token_ids
        self.echo = not chat and body.echo
        self.echoed: set[int] = set()
        self.prompt_lps: dict[str, list[Any] | None] = {}  # request id → prompt logprobs (a stream's first chunk)
        self.prompt_index = {rid: i for i, rid in enumerate(job.rids)}
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}
        self.finished: set[int] = set()
        self.prompt_sent: set[int] = set()
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        self.weight_version = ""

    # -- whole responses --

    def full(self, outs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for out in outs:
            self._count(out, finished=True)
            for c in out.outputs:
                choices.append(self._choice(out, c, delta=False))
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self._usage(), "weight_version": self.weight_version}

    # -- streams --

    def opening(self) -> list[dict[str, Any]]:
        """Chat streams start with the assistant role for every choice."""
        if not self.chat:
            return []
        total = len(self.prompt_index) * self.n
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(total)]

    def delta(self, out: RequestOutput) -> list[dict[str, Any]]:
        self._count(out, finished=out.finished)
        events = []
        for c in out.outputs:
            index = self._index(out, c)
            if index in self.finished or not (c.token_ids or c.text or c.finish_reason):
                continue
            if c.finish_reason is not None:
                self.finished.add(index)
            events.append(self._chunk([self._choice(out, c, delta=True)]))
        return events

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._chunk([]), "usage": self._usage()}

    # -- pieces --

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if self.weight_version:
            chunk["weight_version"] = self.weight_version
        return chunk

    def _index(self, out: RequestOutput, c: CompletionOutput) -> int:
        return self.prompt_index.get(out.request_id, 0) * self.n + c.index

    def _choice(self, out: RequestOutput, c: CompletionOutput, delta: bool) -> dict[str, Any]:
        index = self._index(out, c)
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta" if delta else "message"] = {"content": c.text} if delta else \
                {"role": "assistant", "content": c.text}
            choice["logprobs"] = self._chat_logprobs(c) if self.logprobs is not None else None
        else:
            echo = self._echo(out, index)
            choice["text"] = (echo[0] if echo else "") + c.text
            choice["logprobs"] = self._completion_logprobs(index, c, echo) if self.logprobs is not None else None
        choice["finish_reason"] = c.finish_reason
        choice["stop_reason"] = c.stop_reason
        if self.token_ids:
            choice["token_ids"] = c.token_ids
            if index not in self.prompt_sent:
                self.prompt_sent.add(index)
                choice["prompt_token_ids"] = out.prompt_token_ids
        return choice

    def _count(self, out: RequestOutput, finished: bool) -> None:
        self.usage["completion_tokens"] += sum(len(c.token_ids) for c in out.outputs)
        self.weight_version = out.weight_version or self.weight_version
        if finished:
            self.usage["prompt_tokens"] += len(out.prompt_token_ids)
            self.usage["cached_tokens"] += out.num_cached_tokens

    def _usage(self) -> dict[str, Any]:
        u = self.usage
        return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"

    def _top(self, entry: dict[int, Any]) -> list[tuple[int, float]]:
        ranked = sorted(((lp.rank or 0, tid, lp.logprob) for tid, lp in entry.items()
                         if lp.rank is not None and lp.rank <= (self.logprobs or 0)))
        return [(tid, lp) for _, tid, lp in ranked]

    def _echo(self, out: RequestOutput, index: int) -> tuple[str, list[int], list[Any]] | None:
        """With ``echo``, for a choice's first chunk: the prompt's text, token ids and logprob entries (None
        for the first token; entries of None when logprobs were not asked for)."""
        if out.prompt_logprobs is not None:
            self.prompt_lps[out.request_id] = out.prompt_logprobs
        if not self.echo or index in self.echoed:
            return None
        self.echoed.add(index)
        ids = out.prompt_token_ids
        text = out.prompt if out.prompt is not None else self.tokenizer.decode(ids) if self.tokenizer else ""
        return text, ids, self.prompt_lps.get(out.request_id) or [None] * len(ids)

    def _completion_logprobs(self, index: int, c: CompletionOutput,
                             echo: tuple[str, list[int], list[Any]] | None) -> dict[str, Any]:
        """OpenAI's legacy logprobs object; with ``echo``, the prompt's tokens come first (the first one
        with null logprobs)."""
        prompt_ids, prompt_entries = (echo[1], echo[2]) if echo else ([], [])
        ids = list(prompt_ids) + list(c.token_ids)
        tokens = [self._text(t) for t in ids]
        offsets, pos = [], self.offsets.get(index, 0)
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        self.offsets[index] = pos
        token_lps = [e[t].logprob if e else None for t, e in zip(prompt_ids, prompt_entries)]
        token_lps += list(c.token_logprobs or [])
        top = None
        if self.logprobs:
            top = [{self._text(t): lp for t, lp in self._top(entry)} if entry else None
                   for entry in list(prompt_entries) + list(c.logprobs or [])]
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": top, "text_offset": offsets}

    def _chat_logprobs(self, c: CompletionOutput) -> dict[str, Any]:
        content = []
        for tok, lp, entry in zip(c.token_ids, c.token_logprobs or [], c.logprobs or []):
            text = self._text(tok)
            top = [{"token": self._text(t), "logprob": v, "bytes": list(self._text(t).encode())}
                   for t, v in self._top(entry)]
            content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": top})
        return {"content": content}
