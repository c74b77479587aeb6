"""Waiting for a batch of submitted requests, whole or as delta chunks, from sync or asyncio code.

Every function submits its items through the ``TokenizerManager`` (whose receiver thread calls each
request's sink) and aborts whatever is unfinished when the caller stops early (an exception, a cancelled
task, a stream closed or dropped, started or not), so nothing keeps running for nobody.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
import weakref
from typing import AsyncIterator, Iterator

from rollout.engine_inputs import PromptItem
from rollout.outputs import RequestOutput
from rollout.request_state import ReqState
from rollout.tokenizer_manager import TokenizerManager


def run_batch(tm: TokenizerManager, items: list[PromptItem], use_tqdm: bool) -> list[RequestOutput]:
    """Submit every item and block until all finished (a tqdm bar with output tokens/s when ``use_tqdm``)."""
    done: queue.Queue = queue.Queue()
    states: list[ReqState] = []
    try:
        states = tm.submit_batch([(prompt, ids, params, _finish_sink(done), rid) for prompt, ids, params, rid in items])
        _wait_all(done, len(states), use_tqdm and len(states) > 1)
    except BaseException:
        _abort_unfinished(tm, states)
        raise
    return [_result(tm, state) for state in states]


async def run_batch_async(tm: TokenizerManager, items: list[PromptItem]) -> list[RequestOutput]:
    """``run_batch`` for asyncio callers (any event loop)."""
    loop = asyncio.get_running_loop()
    futures, states = [], []
    try:
        futures = [loop.create_future() for _ in items]
        states = tm.submit_batch([(prompt, ids, params, _future_sink(loop, fut), rid)
                                  for (prompt, ids, params, rid), fut in zip(items, futures)])
        await asyncio.gather(*futures)
    except BaseException:
        _abort_unfinished(tm, states)
        raise
    return [_result(tm, state) for state in states]


class RequestStream(Iterator[RequestOutput]):
    """The delta chunks of submitted requests. Breaking off, ``close()``, or dropping the stream (even before
    its first chunk, when a generator's ``finally`` would never run) aborts whatever is unfinished. The stream
    keeps its ``owner`` (the Engine) alive, as a method's generator keeps its object: an engine that only the
    stream still refers to is not shut down under it."""

    def __init__(self, tm: TokenizerManager, states: list[ReqState], chunks: Iterator[RequestOutput],
                 owner: object = None) -> None:
        self._tm, self._states = tm, states
        self._chunks = chunks
        self._owner = owner
        self._on_drop = _abort_when_dropped(self, tm, states)

    def __iter__(self) -> "RequestStream":
        return self

    def __next__(self) -> RequestOutput:
        return next(self._chunks)

    def close(self) -> None:
        """Abort what is unfinished. From another thread while one iterates the stream, that one ends with the
        abort's final chunks (finish reason "abort"), as after ``Engine.abort``."""
        _abort_unfinished(self._tm, self._states)  # first: closing a generator another thread runs fails
        try:
            self._chunks.close()
        except ValueError:  # "generator already executing": another thread iterates it
            pass
        self._on_drop()


class AsyncRequestStream(AsyncIterator[RequestOutput]):
    """``RequestStream`` for asyncio callers (``aclose()`` closes it)."""

    def __init__(self, tm: TokenizerManager, states: list[ReqState], chunks: AsyncIterator[RequestOutput],
                 owner: object = None) -> None:
        self._tm, self._states = tm, states
        self._chunks = chunks
        self._owner = owner
        self._on_drop = _abort_when_dropped(self, tm, states)

    def __aiter__(self) -> "AsyncRequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        """``close`` for asyncio: from another task while one iterates the stream, that one ends with the abort's
        final chunks."""
        _abort_unfinished(self._tm, self._states)  # first: closing a generator another task awaits in fails
        try:
            await self._chunks.aclose()
        except RuntimeError as e:
            if "already running" not in str(e):  # "aclose(): asynchronous generator is already running"
                raise
        self._on_drop()


def _abort_when_dropped(owner: object, tm: TokenizerManager, states: list[ReqState]) -> weakref.finalize:
    """A finalizer that aborts the unfinished ``states`` when ``owner`` is collected (or when called). It
    goes through the receiver thread (``TokenizerManager.abort_soon``): a collection can run while this
    thread holds the send lock."""
    def abort() -> None:
        for state in states:
            if not state.finished:
                tm.abort_soon(state.rid)

    finalizer = weakref.finalize(owner, abort)
    finalizer.atexit = False  # at exit the engine's shutdown fails every request anyway
    return finalizer


def stream(tm: TokenizerManager, items: list[PromptItem], owner: object = None) -> RequestStream:
    """Submit now (like any request), then iterate over delta chunks as they arrive (the stream keeps ``owner``
    alive)."""
    updates: queue.Queue = queue.Queue()
    states = tm.submit_batch([(prompt, ids, params, updates.put, rid) for prompt, ids, params, rid in items],
                             stream=True)
    return RequestStream(tm, states, _iterate(tm, states, updates), owner)


def _iterate(tm: TokenizerManager, states: list[ReqState], updates: queue.Queue) -> Iterator[RequestOutput]:
    try:
        remaining = len(states)
        while remaining:
            chunk = _chunk(tm, updates.get())
            if chunk is not None:
                remaining -= chunk.finished
                yield chunk
    finally:
        _abort_unfinished(tm, states)


def astream(tm: TokenizerManager, items: list[PromptItem], owner: object = None) -> AsyncRequestStream:
    """``stream`` for asyncio callers: an async iterator of delta chunks, which any event loop may iterate (not
    only the one that created it)."""
    updates = _LoopFreeQueue()
    states = tm.submit_batch([(prompt, ids, params, updates.put, rid) for prompt, ids, params, rid in items],
                             stream=True)
    return AsyncRequestStream(tm, states, _aiterate(tm, states, updates), owner)


class _LoopFreeQueue:
    """The updates of an async stream: put from the receiver thread, got by whichever event loop iterates the
    stream. An ``asyncio.Queue`` fed through the creating loop's ``call_soon_threadsafe`` tied the stream to that
    loop: one made in ``asyncio.run(engine.async_generate(..., stream=True))`` and iterated in another loop waited
    forever (its updates went to the closed loop and were dropped)."""

    def __init__(self) -> None:
        self._items: collections.deque[ReqState] = collections.deque()
        self._lock = threading.Lock()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None

    def put(self, state: ReqState) -> None:
        with self._lock:
            self._items.append(state)
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            _call_soon(waiter[0], _wake, waiter[1])

    async def get(self) -> ReqState:
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if self._items:
                    return self._items.popleft()
                fut = loop.create_future()
                self._waiter = (loop, fut)
            await fut


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():  # done: its waiter was cancelled
        fut.set_result(None)


async def _aiterate(tm: TokenizerManager, states: list[ReqState], updates: _LoopFreeQueue
                    ) -> AsyncIterator[RequestOutput]:
    try:
        remaining = len(states)
        while remaining:
            chunk = _chunk(tm, await updates.get())
            if chunk is not None:
                remaining -= chunk.finished
                yield chunk
    finally:
        _abort_unfinished(tm, states)


def _abort_unfinished(tm: TokenizerManager, states: list[ReqState]) -> None:
    for state in states:
        if not state.finished:
            tm.abort(state.rid)


def _chunk(tm: TokenizerManager, state: ReqState) -> RequestOutput | None:
    if state.closed:
        return None
    if state.error is not None:
        _raise(state)
    if state.params.prompt_logprobs is not None and state.prompt_logprobs is None and not state.finished:
        return None  # sample 0 computes them, for the first chunk; the others (max_tokens=0: done at once) wait
    out = tm.build_output(state, delta=True)
    state.closed = out.finished
    return out


def _result(tm: TokenizerManager, state: ReqState) -> RequestOutput:
    if state.error is not None:
        _raise(state)
    return tm.build_output(state)


def _raise(state: ReqState) -> None:
    exc = ValueError if state.error_type == "ValueError" else RuntimeError
    raise exc(f"request {state.rid}: {state.error}")


def _finish_sink(done: queue.Queue):
    def sink(state: ReqState) -> None:
        if state.finished:
            done.put(state)
    return sink


def _future_sink(loop: asyncio.AbstractEventLoop, fut: asyncio.Future):
    def resolve() -> None:
        if not fut.done():
            fut.set_result(None)

    def sink(state: ReqState) -> None:
        if state.finished:
            _call_soon(loop, resolve)
    return sink


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """``loop.call_soon_threadsafe`` from the receiver thread, or nothing once the caller's loop has closed: its
    task was cancelled and ``asyncio.run`` returned before the abort's last output came back, so nobody waits."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise


def _wait_all(done: queue.Queue, total: int, show: bool) -> None:
    """Block until ``total`` requests finished, with a tqdm bar showing output tokens/s."""
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
    start, tokens = time.monotonic(), 0
    for _ in range(total):
        state = done.get()
        tokens += sum(len(s.token_ids) for s in state.seqs)
        if bar is not None:
            bar.set_postfix_str(f"out {tokens / max(time.monotonic() - start, 1e-9):.1f} tok/s", refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
