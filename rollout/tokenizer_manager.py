"""TokenizerManager: lives in the caller's process; tokenizes, validates, tracks requests, gathers outputs.

A background thread receives the detokenizer's outputs and the scheduler's control replies and hands
each update to the request's sink (a thread-safe callback), so sync callers, asyncio callers in any
loop, streaming and the HTTP server all share one path.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from rollout.config import EngineConfig, ModelConfig
from rollout.io_struct import (AbortReq, BatchTokenOut, ControlReply, ControlReq, GenerateReq, PromptLogprobsOut,
                               SchedulerError, ShutdownReq, TokenOut)
from rollout.ipc import IPCPaths, socket
from rollout.outputs import CompletionOutput, Logprob, RequestOutput
from rollout.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_GOLDEN = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1


@dataclass
class SeqState:
    """Everything received so far for one of a request's ``n`` sequences."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_text: int = 0


class ReqState:
    """One user request (``n`` sequences) and where its updates go."""

    def __init__(self, rid: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 sink: Callable[["ReqState"], None]) -> None:
        self.rid = rid
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.sink = sink
        self.seqs = [SeqState() for _ in range(params.n)]
        self.cached_tokens = 0
        self.prompt_logprobs: PromptLogprobsOut | None = None
        self.prompt_logprobs_sent = False  # a stream delivered them (with its first chunk)
        self.weight_version = ""
        self.error: str | None = None
        self.error_type = "RuntimeError"
        self.closed = False  # a stream already delivered its final chunk
        self.lock = threading.Lock()

    @property
    def finished(self) -> bool:
        return self.error is not None or all(s.finish_reason is not None for s in self.seqs)

    def sub_rids(self) -> list[str]:
        return [f"{self.rid}#{i}" for i in range(len(self.seqs))] if len(self.seqs) > 1 else [self.rid]


class TokenizerManager:
    """Front end of one engine: submit/abort requests, run control calls, build vLLM-shaped outputs."""

    def __init__(self, config: EngineConfig, paths: IPCPaths, model_cfg: ModelConfig, tokenizer: Any,
                 context_len: int, is_alive: Callable[[], bool]) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.is_alive = is_alive
        self.ctx = zmq.Context()
        self.recv = socket(self.ctx, zmq.PULL, paths.tokenizer, bind=True)
        self.to_scheduler = socket(self.ctx, zmq.PUSH, paths.scheduler, bind=False)
        self.to_detokenizer = socket(self.ctx, zmq.PUSH, paths.detokenizer, bind=False)
        self.send_lock = threading.Lock()
        self.states: dict[str, ReqState] = {}
        self.sub_to_state: dict[str, tuple[ReqState, int]] = {}
        self.controls: dict[int, Future] = {}
        self.control_ids = itertools.count()
        self.rng = random.Random(config.seed)
        self.dead: str | None = None
        self.closing = False
        self.thread = threading.Thread(target=self._receive_loop, name="tokenizer-manager", daemon=True)
        self.thread.start()

    # ---- requests -----------------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine was started without a tokenizer: pass prompt_token_ids")
        return self.tokenizer.encode(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """ValueError naming the problem with a request; nothing is sent for an invalid one."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_cfg.vocab_size
        not_ints = [t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool)]
        if not_ints:
            raise ValueError(f"prompt token ids must be ints, got {not_ints[:5]}")
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary [0, {vocab}): {bad[:5]}")
        if len(prompt_ids) >= self.context_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens, but the context length is "
                             f"{self.context_len} (at least one token must be generated)")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids out of vocabulary [0, {vocab}): {bad_stop}")
        if params.prompt_logprobs is not None and params.logprob_start_len >= len(prompt_ids):
            raise ValueError(f"logprob_start_len ({params.logprob_start_len}) must be less than the prompt length "
                             f"({len(prompt_ids)})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")

    def submit(self, prompt: str | None, prompt_ids: list[int] | None, params: SamplingParams,
               sink: Callable[[ReqState], None], rid: str | None = None, stream: bool = False) -> ReqState:
        """Validate and send one request; its updates go to ``sink``. Raises ValueError for bad input."""
        self._check_alive()
        if prompt_ids is None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            prompt_ids = self.tokenize(prompt)
        prompt_ids = list(prompt_ids)
        self.validate(prompt_ids, params)
        rid = rid or uuid.uuid4().hex
        if rid in self.states:
            raise ValueError(f"duplicate request id {rid!r}")
        state = ReqState(rid, prompt, prompt_ids, params, sink)
        msgs = []
        for i, sub in enumerate(state.sub_rids()):
            seed = (params.seed + i * _GOLDEN) & _MASK63 if params.seed is not None else self.rng.getrandbits(63)
            msgs.append(GenerateReq(sub, prompt_ids, params, seed, stream,
                                    return_prompt_logprobs=i == 0 and params.prompt_logprobs is not None))
        with self.send_lock:
            self.states[rid] = state
            for i, sub in enumerate(state.sub_rids()):
                self.sub_to_state[sub] = (state, i)
            for msg in msgs:
                self.to_scheduler.send_pyobj(msg)
        return state

    def abort(self, rid: str) -> None:
        state = self.states.get(rid)
        if state is None:
            return
        with self.send_lock:
            for sub in state.sub_rids():
                self.to_scheduler.send_pyobj(AbortReq(sub))

    # ---- control ------------------------------------------------------------------------------

    def control_async(self, op: str, **kwargs: Any) -> Future:
        """Run ``Scheduler.handle_<op>(**kwargs)`` on every TP rank; the Future holds rank 0's result."""
        self._check_alive()
        fut: Future = Future()
        cid = next(self.control_ids)
        with self.send_lock:
            self.controls[cid] = fut
            self.to_scheduler.send_pyobj(ControlReq(cid, op, kwargs))
        return fut

    def control(self, op: str, timeout: float | None = None, **kwargs: Any) -> Any:
        return self.control_async(op, **kwargs).result(timeout)

    # ---- receiving ----------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        while not self.closing:
            try:
                if not self.recv.poll(500):
                    if not self.closing and not self.is_alive():
                        self._fail_all("an engine subprocess died unexpectedly")
                    continue
                msg = self.recv.recv_pyobj()
            except zmq.ZMQError:
                if self.closing:
                    return
                raise
            try:
                self._dispatch(msg)
            except Exception:  # noqa: BLE001 - never let the receiver die
                logger.exception("failed to dispatch %s", type(msg).__name__)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, BatchTokenOut):
            touched: dict[str, ReqState] = {}
            for out in msg.outs:
                entry = self.sub_to_state.get(out.rid)
                if entry is not None:
                    self._apply(entry[0], entry[1], out)
                    touched[entry[0].rid] = entry[0]
            for state in touched.values():
                if state.finished:
                    self._forget(state)
                state.sink(state)
        elif isinstance(msg, ControlReply):
            fut = self.controls.pop(msg.cid, None)
            if fut is not None:
                if msg.ok:
                    fut.set_result(msg.result)
                else:
                    exc = ValueError if msg.error_type == "ValueError" else RuntimeError
                    fut.set_exception(exc(msg.error))
        elif isinstance(msg, SchedulerError):
            self._fail_all(f"the scheduler failed: {msg.message}")

    def _apply(self, state: ReqState, index: int, out: TokenOut) -> None:
        with state.lock:
            seq = state.seqs[index]
            seq.token_ids.extend(out.token_ids)
            seq.text += out.text
            if out.logprobs is not None:
                seq.logprobs.extend(out.logprobs)
                seq.ranks.extend(out.ranks or [])
            if out.top_logprobs is not None:
                seq.top_logprobs.extend(out.top_logprobs)
            state.cached_tokens = max(state.cached_tokens, out.cached_tokens)
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = out.prompt_logprobs
            state.weight_version = out.weight_version
            if out.finished is not None:
                seq.finish_reason = out.finished.type
                seq.stop_reason = out.finished.matched
                if out.finished.type == "abort" and out.finished.message not in (None, "aborted"):
                    state.error, state.error_type = out.finished.message, out.finished.error_type

    def _forget(self, state: ReqState) -> None:
        self.states.pop(state.rid, None)
        for sub in state.sub_rids():
            self.sub_to_state.pop(sub, None)

    def _fail_all(self, message: str) -> None:
        self.dead = message
        for state in list(self.states.values()):
            state.error = message
            self._forget(state)
            state.sink(state)
        for fut in list(self.controls.values()):
            fut.set_exception(RuntimeError(message))
        self.controls.clear()

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise RuntimeError(f"the engine is not running: {self.dead}")

    # ---- outputs ------------------------------------------------------------------------------

    def build_output(self, state: ReqState, delta: bool = False) -> RequestOutput:
        """A vLLM-shaped RequestOutput of everything so far (or, with ``delta``, what is new)."""
        with state.lock:
            outputs = [self._completion(state, i, seq, delta) for i, seq in enumerate(state.seqs)]
            prompt_lps = None
            if state.prompt_logprobs is not None and not (delta and state.prompt_logprobs_sent):
                prompt_lps = self._prompt_logprob_dicts(state.prompt_ids, state.prompt_logprobs)
                state.prompt_logprobs_sent = delta
            return RequestOutput(request_id=state.rid, prompt=state.prompt, prompt_token_ids=state.prompt_ids,
                                 outputs=outputs, finished=state.finished, weight_version=state.weight_version,
                                 num_cached_tokens=state.cached_tokens, error=state.error,
                                 prompt_logprobs=prompt_lps)

    def _completion(self, state: ReqState, index: int, seq: SeqState, delta: bool) -> CompletionOutput:
        t0, c0 = (seq.sent_tokens, seq.sent_text) if delta else (0, 0)
        if delta:
            seq.sent_tokens, seq.sent_text = len(seq.token_ids), len(seq.text)
        want = state.params.logprobs is not None
        lps = seq.logprobs[t0:] if want else None
        return CompletionOutput(
            index=index, text=seq.text[c0:], token_ids=seq.token_ids[t0:],
            cumulative_logprob=sum(seq.logprobs) if want else None,
            logprobs=self._logprob_dicts(seq, t0) if want else None, token_logprobs=lps,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)

    def _logprob_dicts(self, seq: SeqState, start: int) -> list[dict[int, Logprob]]:
        ids = seq.token_ids[start:len(seq.logprobs)]
        return [self._logprob_entry(tok, seq.logprobs[j], seq.ranks[j] if j < len(seq.ranks) else None,
                                    seq.top_logprobs[j] if j < len(seq.top_logprobs) else None)
                for j, tok in enumerate(ids, start)]

    def _prompt_logprob_dicts(self, prompt_ids: list[int], plp: PromptLogprobsOut) -> list[dict[int, Logprob] | None]:
        """vLLM's ``prompt_logprobs``: one entry per prompt token, None where none was computed (the first token,
        and those up to ``logprob_start_len``)."""
        out: list[dict[int, Logprob] | None] = [None] * len(prompt_ids)
        for j, lp in enumerate(plp.token_logprobs):
            pos = plp.first + j
            out[pos] = self._logprob_entry(prompt_ids[pos], lp, plp.ranks[j], plp.top[j] if plp.top else None)
        return out

    def _logprob_entry(self, token: int, logprob: float, rank: int | None,
                       top: list[tuple[int, float]] | None) -> dict[int, Logprob]:
        """{token: its Logprob, then each top-k alternative not already there}, with decoded tokens."""
        entry = {token: Logprob(logprob, rank)}
        for alt_rank, (alt, lp) in enumerate(top or [], 1):
            entry.setdefault(alt, Logprob(lp, alt_rank))
        if self.tokenizer is not None:
            for tok, value in entry.items():
                value.decoded_token = self.tokenizer.convert_ids_to_tokens(tok)
        return entry

    # ---- shutdown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Ask the scheduler and detokenizer to exit, stop the receiver, close the sockets."""
        if self.closing:
            return
        self.closing = True
        with self.send_lock:
            for sock in (self.to_scheduler, self.to_detokenizer):
                try:
                    sock.send_pyobj(ShutdownReq(), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        self.thread.join(timeout=2)
        self._fail_all("the engine was shut down")
        for sock in (self.recv, self.to_scheduler, self.to_detokenizer):
            sock.close(linger=0)
        self.ctx.term()
