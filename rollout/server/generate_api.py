"""SGLang's native endpoints: ``POST /generate``, ``POST /tokenize``, ``POST /detokenize``.

``/generate`` takes ``text`` or ``input_ids`` (one prompt or a batch) and ``sampling_params``; it answers
``{"text", "output_ids", "meta_info"}`` per (prompt, sample), a single object for one prompt with ``n == 1`` and a
list otherwise (prompt-major). ``meta_info`` holds ``id``, ``finish_reason`` (``{"type": "length", "length"}``,
``{"type": "stop", "matched"}`` or ``{"type": "abort", ...}``), ``prompt_tokens``, ``completion_tokens``,
``cached_tokens``, ``weight_version`` (the version that sampled the sample's last token),
``token_weight_versions`` (per output token: the weight version that sampled it), ``e2e_latency`` and, with
``return_logprob`` (it, ``top_logprobs_num`` and ``logprob_start_len`` may be lists, one entry per prompt, as
SGLang's), ``output_token_logprobs`` (``[logprob, token_id, text or null]`` per token), ``output_top_logprobs``,
``input_token_logprobs`` and ``input_top_logprobs``: empty for the default ``logprob_start_len`` (-1), as SGLang
sends them, and for ``logprob_start_len`` >= 0 the prompt tokens from that position on, the first entry's logprob
null (SGLang's shape); with ``return_routed_experts`` (MoE models, SGLang's field) the final ``meta_info`` has
``routed_experts`` (base64 int32, ``rollout.outputs.routed_experts_from_base64``) and
``routed_experts_start_len``. Streams send the cumulative state of one (prompt, sample) per event, as SGLang does.
A prompt plus ``max_new_tokens`` longer than the context is a 400.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from rollout.engine_inputs import check_unicode
from rollout.outputs import CompletionOutput, RequestOutput, routed_experts_to_base64
from rollout.server.errors import APIError
from rollout.server.protocol import ChatTemplateFields, DetokenizeRequest, GenerateRequest, TokenizeRequest
from rollout.server.serving import (GenJob, StreamJob, check_model, event_error, open_stream, request_ids, run_job,
                                    sampling_params)
from rollout.server.state import ServerState
from rollout.server.streaming import DONE, ClientGone, sse

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Response:
    state = _state(request)
    state.require_engine()
    job = _job(body)
    view = _GenerateView(state, body, job)
    if body.stream:
        sj = StreamJob(state, job, await open_stream(state, job))
        return sj.response(_events(sj, view))
    try:
        outs = await run_job(state, request, job)
    except ClientGone:
        return Response(status_code=499)
    items = [view.item(out, c) for out in outs for c in out.outputs]
    return JSONResponse(items[0] if view.single else items)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    tokenizer = state.require_tokenizer()
    check_model(state, body.model)
    engine = state.engine
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "pass exactly one of 'prompt' and 'messages'", "prompt")
    chat_only = sorted(body.model_fields_set & (set(ChatTemplateFields.model_fields) | {"tools"}))
    if body.prompt is not None and chat_only:
        raise APIError(400, f"{chat_only[0]} applies to 'messages' only", chat_only[0])
    if body.messages is not None:
        try:
            options = replace(body.template_options(), tools=body.tools)
            tokens: Any = await state.tokenize(engine.apply_chat_template,
                                               [m.template_input() for m in body.messages], options)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        count: Any = len(tokens)
        return {"tokens": tokens, "count": count, "max_model_len": engine.context_len}
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    try:
        for p in prompts:
            check_unicode(p, "the prompt")
    except ValueError as e:
        raise APIError(400, str(e), "prompt") from None
    tokens = await state.tokenize(lambda: [tokenizer.encode(p, add_special_tokens=body.add_special_tokens)
                                           for p in prompts])
    count = [len(t) for t in tokens]
    if isinstance(body.prompt, str):
        tokens, count = tokens[0], count[0]
    return {"tokens": tokens, "count": count, "max_model_len": engine.context_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    tokenizer = state.require_tokenizer()
    check_model(state, body.model)
    vocab = state.engine.model_config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token ids out of vocabulary [0, {vocab}): {bad[:5]}", "tokens")
    text = await state.tokenize(tokenizer.decode, body.tokens, skip_special_tokens=body.skip_special_tokens)
    return {"text": text, "prompt": text}  # SGLang's key and vLLM's (DetokenizeResponse.prompt)


# ---- request → engine input ----------------------------------------------------------------------


def _job(body: GenerateRequest) -> GenJob:
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "pass exactly one of 'text' and 'input_ids'", "text")
    if body.routed_experts_start_len and not body.return_routed_experts:
        raise APIError(400, "routed_experts_start_len needs return_routed_experts=true", "routed_experts_start_len")
    texts = ids = None
    batch = isinstance(body.text, list) or bool(body.input_ids and isinstance(body.input_ids[0], list))
    if body.text is not None:
        texts = list(body.text) if batch else [body.text]
    elif batch:
        ids = [list(p) for p in body.input_ids]
    else:
        ids = [list(body.input_ids or [])]
    count = len(texts or ids or [])
    if count == 0:
        raise APIError(400, "no prompts given", "text" if texts is not None else "input_ids")
    raw = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params or {}] * count
    if len(raw) != count:
        raise APIError(400, f"got {len(raw)} sampling_params for {count} prompts", "sampling_params")
    params = []
    for values, ask in zip(raw, _logprob_asks(body, count)):
        values = dict(values)
        if body.return_routed_experts:  # request-level in SGLang; a sampling parameter here
            values.update(return_routed_experts=True, routed_experts_start_len=body.routed_experts_start_len)
        if ask.want:
            values["logprobs"] = ask.top
            if ask.start >= 0:
                values.update(prompt_logprobs=ask.top, logprob_start_len=ask.start)
        params.append(sampling_params(values))
    rid, group_id = body.rid, None
    if isinstance(rid, str) and rid and batch:  # SGLang's: one id for a batch names its prompts "<rid>_<i>"
        rid, group_id = [f"{rid}_{i}" for i in range(count)], rid
    return GenJob(texts, ids, params, request_ids("", count, rid), length_param="sampling_params.max_new_tokens",
                  group_id=group_id)


@dataclass(frozen=True)
class _LogprobAsk:
    """One prompt's SGLang logprob options: ``want`` (``return_logprob``), ``top`` (``top_logprobs_num``) and
    ``start`` (``logprob_start_len``; -1: no prompt logprobs)."""

    want: bool
    top: int
    start: int


def _logprob_asks(body: GenerateRequest, count: int) -> list[_LogprobAsk]:
    """Each of ``count`` prompts' logprob options: ``return_logprob``, ``top_logprobs_num`` and ``logprob_start_len``
    are one value for every prompt or a list with one per prompt (SGLang's ``GenerateReqInput``); a prompt without
    ``return_logprob`` ignores its ``logprob_start_len``, as SGLang's scheduler does. A list of another length is a
    400 naming the field."""
    wants = _per_prompt(body.return_logprob, count, "return_logprob")
    tops = _per_prompt(body.top_logprobs_num, count, "top_logprobs_num")
    starts = _per_prompt(body.logprob_start_len, count, "logprob_start_len")
    return [_LogprobAsk(want, top, start if want else -1) for want, top, start in zip(wants, tops, starts)]


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise APIError(400, f"got {len(value)} {name} values for {count} prompts", name)
    return list(value)


# ---- engine output → SGLang JSON ------------------------------------------------------------------


class _GenerateView:
    """SGLang's output objects; for streams it keeps each (prompt, sample)'s text and ids so far."""

    def __init__(self, state: ServerState, body: GenerateRequest, job: GenJob) -> None:
        self.tokenizer = state.engine.tokenizer
        self.body = body
        self.job = job
        self.n = {rid: p.n for rid, p in zip(job.rids, job.params)}
        self.asks = dict(zip(job.rids, _logprob_asks(body, job.size)))
        # a (prompt, sample)'s place in the non-streamed list: the samples of the prompts before it, then its
        # own index (prompts may ask for different n: prompt * n collided with another prompt's samples)
        starts = [0]
        for p in job.params:
            starts.append(starts[-1] + p.n)
        self.start = dict(zip(job.rids, starts))
        self.single = job.size == 1 and job.params[0].n == 1 and not isinstance(body.text, list) \
            and not (body.input_ids and isinstance(body.input_ids[0], list))
        self.so_far: dict[tuple[str, int], CompletionOutput] = {}
        self.prompt_lps: dict[str, list[Any] | None] = {}  # request id → prompt logprobs (a stream's first chunk)

    def item(self, out: RequestOutput, c: CompletionOutput, index: int | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": out.request_id if self.n[out.request_id] == 1 else f"{out.request_id}#{c.index}",
            "finish_reason": _finish_reason(c, len(c.token_ids), out.error),
            "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(c.token_ids),
            "cached_tokens": out.num_cached_tokens, "weight_version": _sample_version(out, c),
            "e2e_latency": time.monotonic() - self.job.started}
        if c.routed_experts is not None:
            meta["routed_experts"] = routed_experts_to_base64(c.routed_experts)
            meta["routed_experts_start_len"] = self.body.routed_experts_start_len
        ask = self.asks[out.request_id]
        if ask.want:
            meta["output_token_logprobs"] = [[_finite(lp), t, self._text(t)]
                                             for lp, t in zip(c.token_logprobs or [], c.token_ids)]
            if ask.top:
                meta["output_top_logprobs"] = [self._top(entry, ask.top) for entry in c.logprobs or []]
            meta.update(self._input_logprobs(out, ask) if ask.start >= 0 else _no_input_logprobs(ask))
        meta["token_weight_versions"] = list(c.token_weight_versions)
        item = {"text": c.text, "output_ids": list(c.token_ids), "meta_info": meta}
        if index is not None:
            item["index"] = index
        return item

    def delta(self, chunk: RequestOutput) -> list[dict[str, Any]]:
        """Fold a delta chunk into the running state; one event per (prompt, sample) that changed."""
        events = []
        for c in chunk.outputs:
            key = (chunk.request_id, c.index)
            acc = self.so_far.setdefault(key, CompletionOutput(index=c.index, token_logprobs=[], logprobs=[]))
            if acc.finish_reason is not None or not (c.token_ids or c.text or c.finish_reason):
                continue
            acc.text += c.text
            acc.token_ids += c.token_ids
            acc.token_weight_versions += c.token_weight_versions
            acc.token_logprobs += c.token_logprobs or []
            acc.logprobs += c.logprobs or []
            acc.finish_reason, acc.stop_reason = c.finish_reason, c.stop_reason
            acc.routed_experts = c.routed_experts
            index = self.start[chunk.request_id] + c.index
            events.append(self.item(chunk, acc, index))
        return events

    def _input_logprobs(self, out: RequestOutput, ask: _LogprobAsk) -> dict[str, Any]:
        """SGLang's ``input_token_logprobs`` (and ``input_top_logprobs``): an entry per prompt token from
        ``logprob_start_len`` on, the first with a null logprob."""
        if out.prompt_logprobs is not None:
            self.prompt_lps[out.request_id] = out.prompt_logprobs
        entries = self.prompt_lps.get(out.request_id) or [None] * len(out.prompt_token_ids)
        start = ask.start
        ids, entries = out.prompt_token_ids[start:], [None] + entries[start + 1:]
        meta: dict[str, Any] = {"input_token_logprobs": [[_finite(e[t].logprob) if e else None, t, self._text(t)]
                                                         for t, e in zip(ids, entries)]}
        if ask.top:
            meta["input_top_logprobs"] = [self._top(e, ask.top) if e else None for e in entries]
        return meta

    def _text(self, token_id: int) -> str | None:
        if not self.body.return_text_in_logprobs or self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def _top(self, entry: dict[int, Any], k: int) -> list[list[Any]]:
        """SGLang's top-k list of ``entry``: the k (``top_logprobs_num``) best-ranked tokens, never more (a sampled
        token tied with the k-th alternative, and not among them, also has a rank <= k)."""
        ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k)
        return [[_finite(lp), tid, self._text(tid)] for _, tid, lp in ranked[:k]]


def _no_input_logprobs(ask: _LogprobAsk) -> dict[str, Any]:
    """SGLang's prompt logprob fields for the default ``logprob_start_len`` (-1): present and empty, as SGLang
    sends them with ``return_logprob`` (its scheduler starts the prompt logprobs past the prompt's end)."""
    return {"input_token_logprobs": [], **({"input_top_logprobs": []} if ask.top else {})}


def _sample_version(out: RequestOutput, c: CompletionOutput) -> str:
    """One sample's ``weight_version``: the version that sampled its last token (the request's, the last message's
    of any of its ``n`` samples, when it has none). With ``n > 1`` and an in-flight update a sample that ended
    before the update reported the update's version, which sampled none of its tokens."""
    return c.token_weight_versions[-1] if c.token_weight_versions else out.weight_version


def _finite(value: float | None) -> float | None:
    """A logprob JSON can carry: -inf / NaN (processed logprobs of tokens top-k, top-p or min-p rule out)
    become null, as SGLang's orjson responses send them (Starlette's JSON refused them: a 500)."""
    return value if value is not None and math.isfinite(value) else None


def _finish_reason(c: CompletionOutput, length: int, error: str | None) -> dict[str, Any] | None:
    if c.finish_reason is None:
        return None
    if c.finish_reason == "length":
        return {"type": "length", "length": length}
    if c.finish_reason == "stop":  # no stop_reason: EOS (vLLM's convention), the last token; SGLang names it
        matched = c.stop_reason if c.stop_reason is not None else (c.token_ids[-1] if c.token_ids else None)
        return {"type": "stop", "matched": matched}
    return {"type": "abort", "message": error or "aborted"}


async def _events(sj: StreamJob, view: _GenerateView) -> AsyncIterator[str]:
    try:
        async for chunk in sj.chunks():
            for event in view.delta(chunk):
                yield sse(event)
    except (ValueError, RuntimeError) as e:
        sj.done = True
        yield sse(event_error(e))
    yield DONE
