"""Running one HTTP generation request on the Engine: submit, await or stream, abort, count.

Every endpoint that generates (``/v1/completions``, ``/v1/chat/completions``, ``/generate``) turns its
body into a ``GenJob`` and uses ``run_job`` (all outputs at once) or ``open_stream`` + ``StreamJob``
(delta chunks, as server-sent events).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.requests import Request

from rollout.outputs import RequestOutput
from rollout.sampling_params import MAX_N, SamplingParams
from rollout.server.errors import APIError, from_engine_error
from rollout.server.state import ServerState
from rollout.server.streaming import AbortingStreamResponse, ClientGone, cancel_on_disconnect


@dataclass
class GenJob:
    """One HTTP request as Engine input: text prompts or token-id prompts, with one SamplingParams and
    one request id per prompt. ``to_context``: the client left the output length open (null
    ``max_tokens``), so each prompt generates until the context is full, or for ``max_tokens_cap`` tokens where
    that is fewer (the model's ``max_new_tokens``, ``rollout.sampling_defaults``). ``group_id``: the id the client sees
    for a request of several prompts (an OpenAI response's ``id``), which ``/abort_request`` also takes."""

    texts: list[str] | None
    token_ids: list[list[int]] | None
    params: list[SamplingParams]
    rids: list[str]
    to_context: bool = False
    length_param: str = "max_tokens"
    max_tokens_cap: int | None = None
    group_id: str | None = None
    started: float = field(default_factory=time.monotonic)

    @property
    def size(self) -> int:
        return len(self.rids)

    def engine_inputs(self, engine: Any) -> tuple[list[dict[str, Any]], list[SamplingParams]]:
        """Each prompt as the Engine takes it (``{"prompt", "prompt_token_ids"}``, text prompts tokenized here)
        and its SamplingParams. A prompt plus ``max_tokens`` longer than the context is a 400, as vLLM and
        SGLang answer (the Python API instead ends such a request at the context's end). More than ``MAX_N``
        sequences in all (prompts times n) is a 400 too (``check_sequences``)."""
        self.check_sequences()
        try:
            ids = self.token_ids or [engine.tokenizer_manager.tokenize(t) for t in self.texts]
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None
        texts = self.texts or [None] * len(ids)
        context, params = engine.context_len, []
        for prompt, p in zip(ids, self.params):
            if self.to_context or p.max_new_tokens is None:
                try:
                    left = max(context - len(prompt), 0)
                    p = p.clone(max_new_tokens=left if self.max_tokens_cap is None else min(left, self.max_tokens_cap))
                except ValueError as e:
                    raise APIError(400, str(e), self.length_param) from None
            elif len(prompt) + p.max_new_tokens > context:
                raise APIError(400, f"This model's maximum context length is {context} tokens. However, you "
                               f"requested {len(prompt) + p.max_new_tokens} tokens ({len(prompt)} in the prompt, "
                               f"{p.max_new_tokens} in the completion). Please reduce the length of the prompt "
                               f"or of {self.length_param}.", self.length_param)
            params.append(p)
        return [{"prompt": t, "prompt_token_ids": list(i)} for t, i in zip(texts, ids)], params

    def check_sequences(self) -> None:
        """400 unless the request's prompts ask for at most ``MAX_N`` sequences in all (n per prompt, summed): n is
        bounded per prompt, and 64 prompts of n=16384 in a 1 KB body were a million sequences, built in the event
        loop before the first token (as n=10**7 was: gigabytes, /health unanswered)."""
        total = sum(p.n for p in self.params)
        if total > MAX_N:
            raise APIError(400, f"a request may ask for at most {MAX_N} sequences (prompts times n), got {total} "
                           f"({self.size} prompts); send fewer prompts per request", "n")


def request_ids(prefix: str, count: int, given: str | list[str] | None = None) -> list[str]:
    """One id per prompt: the client's (a string for one prompt, a list for a batch) or fresh ones."""
    if given is None:
        base = f"{prefix}{uuid.uuid4().hex}"
        return [base] if count == 1 else [f"{base}-{i}" for i in range(count)]
    ids = [given] if isinstance(given, str) else list(given)
    if len(ids) != count:
        raise APIError(400, f"got {len(ids)} request ids for {count} prompts", "rid")
    if len(set(ids)) != len(ids) or not all(ids):
        raise APIError(400, "request ids must be distinct, non-empty strings", "rid")
    return ids


def check_model(state: ServerState, model: str | None) -> None:
    """404 for a ``model`` this server does not serve (None, the served name and the path are served), as vLLM
    answers its OpenAI and tokenizer endpoints."""
    if model not in (None, state.args.model_name, state.args.model_path):
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.args.model_name!r}",
                       "model")


def sampling_params(values: dict[str, Any], param: str = "sampling_params") -> SamplingParams:
    """SamplingParams from a dict of vLLM/SGLang names; a bad one is a 400 naming the field."""
    try:
        return SamplingParams.from_any(values)
    except (ValueError, TypeError) as e:
        name = str(e).split(" ", 1)[0]  # SamplingParams' messages start with the field's name
        where = param if name not in values else name if param == "request" else f"{param}.{name}"
        raise APIError(400, f"invalid {param}: {e}", where) from None


async def run_job(state: ServerState, request: Request, job: GenJob) -> list[RequestOutput]:
    """Generate everything; abort if the client disconnects first (then ClientGone). Cancelled (uvicorn cancels
    the requests still running when its graceful shutdown times out) it aborts and answers a 503 saying so: the
    client got uvicorn's bare text/plain 500 "Internal Server Error"."""
    engine = state.require_engine()
    prompts, params = await state.tokenize(job.engine_inputs, engine)
    state.track(job)
    try:
        outs = await cancel_on_disconnect(request, engine.async_generate(prompts, params, request_id=job.rids))
    except ClientGone:
        state.metrics.disconnects.inc()
        raise
    except asyncio.CancelledError:
        _uncancel()
        raise APIError(503, "the server is shutting down: the request was aborted before it finished") from None
    except (ValueError, RuntimeError) as e:
        raise from_engine_error(e) from None
    finally:
        state.untrack(job)
    for out in outs:
        state.metrics.completion_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        _record_finished(state, out, job)
    return outs


async def open_stream(state: ServerState, job: GenJob) -> AsyncIterator[RequestOutput]:
    """Validate and submit now (a bad request is an APIError before any event is sent); iterate later."""
    engine = state.require_engine()
    prompts, params = await state.tokenize(job.engine_inputs, engine)
    try:
        stream = await engine.async_generate(prompts, params, request_id=job.rids, stream=True)
    except (ValueError, RuntimeError) as e:
        raise from_engine_error(e) from None
    state.track(job)
    return stream


class StreamJob:
    """The engine side of one streamed response: counts tokens, and when the response closes aborts
    whatever is still running (the client left) and forgets the request ids."""

    def __init__(self, state: ServerState, job: GenJob, stream: AsyncIterator[RequestOutput]) -> None:
        self.state = state
        self.job = job
        self.stream = stream
        self.done = False

    async def chunks(self) -> AsyncIterator[RequestOutput]:
        """The engine's delta chunks; raises the engine's ValueError/RuntimeError for a failed request."""
        metrics = self.state.metrics
        async for chunk in self.stream:
            metrics.completion_tokens.inc(sum(len(c.token_ids) for c in chunk.outputs))
            if chunk.finished:
                _record_finished(self.state, chunk, self.job)
            yield chunk
        self.done = True

    def response(self, events: AsyncIterator[str]) -> AbortingStreamResponse:
        return AbortingStreamResponse(events, on_close=self.close)

    def close(self) -> None:
        engine = self.state.engine
        if not self.done:
            self.state.metrics.disconnects.inc()
            if engine is not None:
                for rid in self.job.rids:
                    engine.abort(rid)
        self.state.untrack(self.job)


def _uncancel() -> None:
    """This task handles its cancellation itself (it answers instead): undo the request, as asyncio asks."""
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):  # Python 3.11+
        task.uncancel()


def _record_finished(state: ServerState, out: RequestOutput, job: GenJob) -> None:
    state.metrics.output_finished(len(out.prompt_token_ids), out.num_cached_tokens,
                                  [c.finish_reason for c in out.outputs], time.monotonic() - job.started)


def event_error(exc: Exception) -> dict[str, Any]:
    """The body of the SSE event sent when a streamed request fails after it started."""
    err = from_engine_error(exc) if isinstance(exc, (ValueError, RuntimeError)) else APIError(500, str(exc))
    return {"error": {"message": err.message, "type": "invalid_request_error" if err.status == 400
                      else "server_error", "param": None, "code": err.status}}

