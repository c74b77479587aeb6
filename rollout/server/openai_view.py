"""Rendering engine outputs as OpenAI JSON: whole completion / chat completion objects, stream chunks, usage,
logprobs (with ``echo``, the prompt's tokens first)."""

from __future__ import annotations

import math
import time
from typing import Any

from rollout.outputs import CompletionOutput, RequestOutput, routed_experts_to_base64
from rollout.server.protocol import OpenAICommon
from rollout.server.serving import GenJob
from rollout.server.state import ServerState


def json_logprob(value: float | None) -> float | None:
    """A logprob JSON can carry: -inf (a token that processed logprobs rule out: top-k, top-p, min-p) becomes
    -9999.0 as vLLM sends it (``max(logprob, -9999.0)``), NaN becomes null. Starlette's JSON refuses both
    (the whole response became a 500) and ``json.dumps`` writes ``-Infinity``, which is not JSON."""
    if value is None or math.isnan(value):
        return None
    return max(value, -9999.0)


class OpenAIView:
    """Renders one request's outputs as OpenAI JSON (whole, or chunk by chunk) and sums its usage."""

    def __init__(self, state: ServerState, body: OpenAICommon, job: GenJob, obj: str, chat: bool) -> None:
        self.tokenizer = state.engine.tokenizer if state.engine is not None else None
        self.model = state.args.model_name
        self.id = job.group_id or job.rids[0]
        self.object = obj
        self.chat = chat
        self.role = _response_role(body) if chat else None
        self.n = body.n
        self.logprobs = body.logprobs if not chat else ((body.top_logprobs or 0) if body.logprobs else None)
        self.token_ids = body.return_token_ids
        self.prompt_ids = job.token_ids[0] if chat and self.token_ids else None  # chat's one prompt, templated
        self.echo = not chat and body.echo
        self.echoed: set[int] = set()
        self.prompt_lps: dict[str, list[Any] | None] = {}  # request id → prompt logprobs (a stream's first chunk)
        self.prompt_index = {rid: i for i, rid in enumerate(job.rids)}
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}
        self.finished: set[int] = set()
        self.prompt_sent: set[int] = set()
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        options = body.stream_options
        self.continuous_usage = bool(options and options.continuous_usage_stats)
        self.choice_tokens: dict[int, int] = {}  # a choice's completion tokens so far (continuous usage)
        self.weight_version = ""

    # -- whole responses --

    def full(self, outs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for out in outs:
            self._count(out, finished=True)
            for c in out.outputs:
                choices.append(self._choice(out, c, delta=False))
        response = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                    "choices": choices, "usage": self._usage(), "weight_version": self.weight_version}
        if self.chat and self.token_ids:  # vLLM's chat response names its prompt's ids once, at the top level
            response["prompt_token_ids"] = self.prompt_ids
        return response

    # -- streams --

    def opening(self) -> list[dict[str, Any]]:
        """Chat streams start with the response's role (``self.role``) for every choice."""
        if not self.chat:
            return []
        total = len(self.prompt_index) * self.n
        chunks = [self._chunk([{"index": i, "delta": {"role": self.role, "content": ""}, "logprobs": None,
                                "finish_reason": None}]) for i in range(total)]
        if self.token_ids and self.prompt_ids is not None:  # vLLM: the stream's first chunk, at the top level
            chunks[0]["prompt_token_ids"] = self.prompt_ids
        return chunks

    def delta(self, out: RequestOutput) -> list[dict[str, Any]]:
        self._count(out, finished=out.finished)
        events = []
        for c in out.outputs:
            index = self._index(out, c)
            if index in self.finished or not (c.token_ids or c.text or c.finish_reason):
                continue
            if c.finish_reason is not None:
                self.finished.add(index)
            chunk = self._chunk([self._choice(out, c, delta=True)])
            if self.continuous_usage:  # vLLM / SGLang: this choice's prompt and its completion tokens so far
                done = self.choice_tokens[index] = self.choice_tokens.get(index, 0) + len(c.token_ids)
                prompt = len(out.prompt_token_ids)
                chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
            events.append(chunk)
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
                {"role": self.role, "content": c.text}
            choice["logprobs"] = self._chat_logprobs(c) if self.logprobs is not None else None
        else:
            echo = self._echo(out, index)
            choice["text"] = (echo[0] if echo else "") + c.text
            choice["logprobs"] = self._completion_logprobs(index, c, echo) if self.logprobs is not None else None
        choice["finish_reason"] = c.finish_reason
        choice["stop_reason"] = c.stop_reason
        if c.routed_experts is not None:  # SGLang's encoding (rollout.outputs.routed_experts_from_base64)
            choice["routed_experts"] = routed_experts_to_base64(c.routed_experts)
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
        """The ``self.logprobs`` (k) best-ranked tokens of ``entry``: never more than k, though a sampled token
        tied with the k-th alternative, and not among them, also has a rank <= k (1 + the tokens above it)."""
        k = self.logprobs or 0
        ranked = sorted(((lp.rank or 0, tid, lp.logprob) for tid, lp in entry.items()
                         if lp.rank is not None and lp.rank <= k))
        return [(tid, json_logprob(lp)) for _, tid, lp in ranked[:k]]

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
        token_lps = [json_logprob(e[t].logprob) if e else None for t, e in zip(prompt_ids, prompt_entries)]
        token_lps += [json_logprob(lp) for lp in c.token_logprobs or []]
        top = None
        if self.logprobs is not None:  # the chosen token, then the top k: up to k + 1 entries (OpenAI, vLLM)
            top = [{self._text(t): json_logprob(lp.logprob) for t, lp in list(entry.items())[:self.logprobs + 1]}
                   if entry else None
                   for entry in list(prompt_entries) + list(c.logprobs or [])]
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": top, "text_offset": offsets}

    def _chat_logprobs(self, c: CompletionOutput) -> dict[str, Any]:
        content = []
        for tok, lp, entry in zip(c.token_ids, c.token_logprobs or [], c.logprobs or []):
            text = self._text(tok)
            top = [{"token": self._text(t), "logprob": v, "bytes": list(self._text(t).encode())}
                   for t, v in self._top(entry)]
            content.append({"token": text, "logprob": json_logprob(lp), "bytes": list(text.encode()),
                            "top_logprobs": top})
        return {"content": content}


def _response_role(body: Any) -> str:
    """A chat response's role, vLLM's ``get_chat_request_role``: "assistant" after the generation prompt, else the
    last message's role (``add_generation_prompt: false`` continues that message's turn)."""
    return "assistant" if body.add_generation_prompt else body.messages[-1].role
