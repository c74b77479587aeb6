"""TokenizerManager: lives in the caller's process; tokenizes, validates, tracks requests, gathers outputs.

A background thread receives the detokenizer's outputs and the scheduler's control replies and hands
each update to the request's sink (a thread-safe callback), so sync callers, asyncio callers in any
loop, streaming and the HTTP server all share one path.
"""

from __future__ import annotations

import collections
import itertools
import logging
import random
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any, Callable

import zmq

from rollout.config import EngineConfig, ModelConfig
from rollout.engine_inputs import check_unicode
from rollout.gc_policy import deferred_gc
from rollout.io_struct import (AbortReq, BatchGenerateReq, BatchTokenOut, ControlReply, ControlReq, GenerateReq,
                               SchedulerError, ShutdownReq)
from rollout.ipc import IPCPaths, socket
from rollout.outputs import RequestOutput
from rollout.request_state import ReqState, build_output
from rollout.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1  # a seed is 64-bit (vLLM's range): every distinct seed keeps its own samples
_LIVENESS_CHECK_S = 0.5  # how often the receiver checks that every engine subprocess is alive


def tokenizer_eos_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokenizer's EOS id, which ends a sequence beside the model's ``eos_token_id`` ids (config.json and
    generation_config.json): vLLM stops at it (``InputPreprocessor.get_eos_token_id``), as SGLang does
    (``Req.check_finished``). Empty without a tokenizer (``skip_tokenizer_init``) or an EOS token."""
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    return (eos,) if isinstance(eos, int) and not isinstance(eos, bool) else ()


class TokenizerManager:
    """Front end of one engine: submit/abort requests, run control calls, build vLLM-shaped outputs."""

    def __init__(self, config: EngineConfig, paths: IPCPaths, model_cfg: ModelConfig, tokenizer: Any,
                 context_len: int, is_alive: Callable[[], bool]) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.tokenizer = tokenizer
        self.token_texts: dict[int, str] = {}  # token_text's decodes, by id
        self.eos_token_ids = tokenizer_eos_ids(tokenizer)  # sent with every request (GenerateReq.eos_token_ids)
        self.context_len = context_len
        self.is_alive = is_alive
        self.ctx = zmq.Context()
        self.recv = socket(self.ctx, zmq.PULL, paths.tokenizer, bind=True)
        self.to_scheduler = socket(self.ctx, zmq.PUSH, paths.scheduler, bind=False)
        self.to_detokenizer = socket(self.ctx, zmq.PUSH, paths.detokenizer, bind=False)
        self.send_lock = threading.RLock()  # re-entrant: ``close`` may run in a finalizer on a thread that holds it
        self.finished_cv = threading.Condition()  # notified when a request finishes or fails (``wait_finished``)
        self.to_abort: collections.deque[str] = collections.deque()  # abort_soon's requests, for the receiver
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
        check_unicode(prompt, "the prompt")
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
        self._validate_logprobs(params)
        if params.return_routed_experts:
            self._validate_routed_experts(prompt_ids, params)

    def _validate_logprobs(self, params: SamplingParams) -> None:
        """vLLM's check (``Processor._validate_logprobs``): at most ``max_logprobs`` top logprobs a position (-1: the
        vocabulary), with vLLM's messages."""
        limit = self.config.max_logprobs if self.config.max_logprobs >= 0 else self.model_cfg.vocab_size
        for kind, k in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
            if k is not None and k > limit:
                raise ValueError(f"Requested {kind} logprobs of {k}, which is greater than max allowed: {limit}")

    def _validate_routed_experts(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not self.model_cfg.is_moe:
            raise ValueError(f"return_routed_experts needs a mixture-of-experts model; {self.model_cfg.architecture} "
                             "routes no experts")
        if not self.config.enable_return_routed_experts:
            raise ValueError("return_routed_experts needs an engine started with enable_return_routed_experts=True "
                             "(server flag --enable-return-routed-experts)")
        if params.routed_experts_start_len > len(prompt_ids):
            raise ValueError(f"routed_experts_start_len ({params.routed_experts_start_len}) must be at most the prompt "
                             f"length ({len(prompt_ids)})")

    def submit_batch(self, items: list[tuple[str | None, list[int] | None, SamplingParams,
                                             Callable[[ReqState], None], str | None]],
                     stream: bool = False) -> list[ReqState]:
        """Validate every ``(prompt, prompt_ids, params, sink, rid)`` (updates of each go to its ``sink``), then
        send all their sequences in one message (``BatchGenerateReq``; a lone sequence as its ``GenerateReq``).
        A ValueError for any item (bad input, a duplicate request id) sends nothing. The garbage collector is
        paused meanwhile (``rollout.gc_policy.deferred_gc``)."""
        with deferred_gc():  # no full collection between two requests of the batch
            return self._submit_batch(items, stream)

    def _submit_batch(self, items: list[tuple[str | None, list[int] | None, SamplingParams,
                                              Callable[[ReqState], None], str | None]],
                      stream: bool) -> list[ReqState]:
        self._check_alive()
        states: list[ReqState] = []
        msgs: list[GenerateReq] = []
        for prompt, prompt_ids, params, sink, rid in items:
            state = self._new_state(prompt, prompt_ids, params, sink, rid)
            states.append(state)
            msgs += self._sequences(state, stream)
        with self.send_lock:
            self._check_open()
            self._check_ids_free(states)
            for state in states:
                self.states[state.rid] = state
                for i, sub in enumerate(state.sub_rids()):
                    self.sub_to_state[sub] = (state, i)
            if msgs:
                self.to_scheduler.send_pyobj(msgs[0] if len(msgs) == 1 else BatchGenerateReq(msgs))
        return states

    def _check_ids_free(self, states: list[ReqState]) -> None:
        """ValueError unless every request id of ``states`` and every id of their samples (``rid#i`` for
        n > 1, the scheduler's ids) is new: taken by no live request and by no other of ``states``."""
        rids: set[str] = set()  # this call's, beside the live ones (not copied: O(batch), not O(live))
        subs: set[str] = set()
        for state in states:
            if state.rid in rids or state.rid in self.states:
                raise ValueError(f"duplicate request id {state.rid!r}")
            clash = next((sub for sub in state.sub_rids() if sub in subs or sub in self.sub_to_state), None)
            if clash is not None:
                raise ValueError(f"request id {state.rid!r} clashes with a live request: its sample id {clash!r} "
                                 f"is taken (a request with n > 1 names its samples '<id>#<i>')")
            rids.add(state.rid)
            subs.update(state.sub_rids())

    def _new_state(self, prompt: str | None, prompt_ids: list[int] | None, params: SamplingParams,
                   sink: Callable[[ReqState], None], rid: str | None) -> ReqState:
        """The tracked state of one validated request (tokenized here when only text is given)."""
        if prompt_ids is None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            prompt_ids = self.tokenize(prompt)
        prompt_ids = list(prompt_ids)
        self.validate(prompt_ids, params)
        return ReqState(rid or uuid.uuid4().hex, prompt, prompt_ids, params, sink)

    def _sequences(self, state: ReqState, stream: bool) -> list[GenerateReq]:
        """One ``GenerateReq`` per sample of ``state`` (``n`` of them), each with its own seed."""
        params, msgs = state.params, []
        for i, sub in enumerate(state.sub_rids()):
            seed = (params.seed + i * _GOLDEN) & _MASK64 if params.seed is not None else self.rng.getrandbits(63)
            msgs.append(GenerateReq(sub, state.prompt_ids, params, seed, stream,
                                    return_prompt_logprobs=i == 0 and params.prompt_logprobs is not None,
                                    eos_token_ids=self.eos_token_ids))
        return msgs

    def abort_soon(self, rid: str) -> None:
        """``abort(rid)`` from the receiver thread (within its 0.5 s poll): safe to call from a finalizer, which
        may run while this thread holds ``send_lock``."""
        self.to_abort.append(rid)

    def abort(self, rid: str) -> bool:
        """Abort request ``rid`` (all its samples), or one sample of it by its id ``rid#i``; False when no
        live request or sample has that id."""
        state = self.states.get(rid)
        if state is not None:
            subs = state.sub_rids()
        elif rid in self.sub_to_state:
            subs = [rid]
        else:
            return False
        with self.send_lock:
            if self.closing:  # shut down: every request has failed (or is failing) already
                return False
            for sub in subs:
                self.to_scheduler.send_pyobj(AbortReq(sub))
        return True

    def unfinished(self) -> list[ReqState]:
        """The requests submitted and not finished yet, as the receiver knows them now."""
        with self.send_lock:
            return [state for state in self.states.values() if not state.finished]

    def wait_finished(self, states: list[ReqState]) -> None:
        """Block until every one of ``states`` has its final output (or failed: a dead or closed engine fails
        them all). Their last outputs come through the detokenizer, after a control call's reply. Woken by
        ``_notify``; the timeout only bounds a wait past a wake-up missed by a path that does not notify."""
        with self.finished_cv:
            while not all(state.finished for state in states):
                self.finished_cv.wait(timeout=_LIVENESS_CHECK_S)

    # ---- control ------------------------------------------------------------------------------

    def control_async(self, req: ControlReq) -> Future:
        """Run a control call (its handler: ``Scheduler.control_handlers[type(req)]``) on every TP rank; the
        Future holds rank 0's result. It is running from the start (sent, the call will run whatever the caller
        does), so ``cancel()`` returns False instead of pretending the call will not run: a cancelled
        ``update_weights_from_tensor`` freed the tensors it shares while the engine still loaded them."""
        self._check_alive()
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        with self.send_lock:
            self._check_open()
            req.cid = next(self.control_ids)
            self.controls[req.cid] = fut
            self.to_scheduler.send_pyobj(req)
        return fut

    def control(self, req: ControlReq, timeout: float | None = None) -> Any:
        return self.control_async(req).result(timeout)

    # ---- receiving ----------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        next_check = time.monotonic() + _LIVENESS_CHECK_S
        while not self.closing:
            try:
                while self.to_abort:
                    self.abort(self.to_abort.popleft())
            except zmq.ZMQError:
                if self.closing:
                    return
                raise
            # every half second, busy or idle: a stream of control replies (a poller of get_load, /metrics) must
            # not keep a dead child (the detokenizer) from being seen, or its requests wait forever
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + _LIVENESS_CHECK_S
                if not self.closing and not self.is_alive():
                    self._fail_all("an engine subprocess died unexpectedly")
            try:
                if not self.recv.poll(int(_LIVENESS_CHECK_S * 1000)):
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
                    entry[0].apply(entry[1], out)
                    touched[entry[0].rid] = entry[0]
            for state in touched.values():
                if state.finished:
                    self._forget(state)
                self._notify(state)
        elif isinstance(msg, ControlReply):
            fut = self.controls.pop(msg.cid, None)
            if fut is not None and not fut.done():  # done: the caller cancelled it
                if msg.ok:
                    fut.set_result(msg.result)
                else:
                    exc = ValueError if msg.error_type == "ValueError" else RuntimeError
                    fut.set_exception(exc(msg.error))
        elif isinstance(msg, SchedulerError):
            self._fail_all(f"the scheduler failed: {msg.message}")

    def _forget(self, state: ReqState) -> None:
        self.states.pop(state.rid, None)
        for sub in state.sub_rids():
            self.sub_to_state.pop(sub, None)

    def _notify(self, state: ReqState) -> None:
        """Hand ``state`` to its sink; one that fails (a bug in the caller's code) is logged, so that it keeps
        neither the other requests from their updates nor ``close`` from closing."""
        try:
            state.sink(state)
        except Exception:  # noqa: BLE001
            logger.exception("request %s: its output sink failed", state.rid)
        if state.finished:
            with self.finished_cv:
                self.finished_cv.notify_all()

    def _fail_all(self, message: str) -> None:
        self.dead = message
        for state in list(self.states.values()):
            state.error = message
            self._forget(state)
            self._notify(state)
        for fut in list(self.controls.values()):
            if not fut.done():  # done: the caller cancelled it
                fut.set_exception(RuntimeError(message))
        self.controls.clear()

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise RuntimeError(f"the engine is not running: {self.dead}")

    def _check_open(self) -> None:
        """``_check_alive`` under ``send_lock``, right before a send: a ``close`` that ran since the caller's first
        check has failed every request and call it knew of (or is about to), so one registered now would wait
        forever, and its sockets may be closed already (a raw ZMQError)."""
        if self.closing:
            raise RuntimeError(f"the engine is not running: {self.dead or 'the engine was shut down'}")
        self._check_alive()

    # ---- outputs ------------------------------------------------------------------------------

    def build_output(self, state: ReqState, delta: bool = False) -> RequestOutput:
        """A vLLM-shaped RequestOutput of everything so far (or, with ``delta``, what is new)."""
        texts = self.tokenizer is not None and state.params.detokenize
        return build_output(state, self.token_text if texts else None, delta)

    def token_text(self, token_id: int) -> str:
        """A token's text decoded alone, as vLLM's ``Logprob.decoded_token`` (``tokenizer.decode([id])``, "" for
        an id past the tokenizer's vocabulary); each id is decoded once."""
        text = self.token_texts.get(token_id)
        if text is None:
            text = self.token_texts[token_id] = self.tokenizer.decode([token_id]) or ""
        return text

    # ---- shutdown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Ask the scheduler and detokenizer to exit, stop the receiver, close the sockets. Safe from any thread,
        the receiver's included: the engine's finalizer runs wherever the garbage collector frees it."""
        if self.closing:
            return
        self.closing = True
        try:
            with self.send_lock:
                for sock in (self.to_scheduler, self.to_detokenizer):
                    try:
                        sock.send_pyobj(ShutdownReq(), zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass
            if threading.current_thread() is not self.thread:  # a finalizer may run in the receiver itself
                self.thread.join(timeout=2)
            self._fail_all("the engine was shut down")
        finally:  # whatever failed above: a context left open hangs the garbage collector's ``term`` later
            for sock in (self.recv, self.to_scheduler, self.to_detokenizer):
                sock.close(linger=0)
            self.ctx.term()
