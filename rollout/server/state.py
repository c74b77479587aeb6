"""What the HTTP handlers share: the args, the Engine (once started), metrics and a pool for blocking calls.

The Engine (and so its TokenizerManager) lives in the server process. It starts in a background thread
so that the server answers ``/health`` with 503 while the model loads; a start-up failure is reported
through ``on_failure`` (the launcher then exits non-zero).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from rollout.gc_policy import freeze_heap
from rollout.server.errors import APIError
from rollout.server.metrics import ServerMetrics
from rollout.server.server_args import ServerArgs

logger = logging.getLogger(__name__)

_START_ABANDON_TIMEOUT_S = 60.0  # how long shutdown waits for a start in progress to stop (it polls every 0.5 s)


class ServerState:
    """The server's one Engine and its bookkeeping: in-flight request ids, the open weight-sync session."""

    def __init__(self, args: ServerArgs, engine_factory: Callable[..., Any] | None = None) -> None:
        self.args = args
        self.engine: Any = None
        self.error: str | None = None
        self.metrics = ServerMetrics()
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="engine-call")
        # tokenizing and templating, one at a time (a tokenizer is not safe to share between threads, as vLLM's
        # one-worker tokenizer executor assumes): off the event loop, so a huge prompt does not stall the server
        self.tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.inflight: dict[str, Any] = {}  # request id → the job (GenJob) that submitted it
        self.groups: dict[str, Any] = {}  # a multi-prompt response's id → its job (whose rids are its prompts')
        self.sync_started: float | None = None
        self.created = int(time.time())
        self._factory = engine_factory
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self, on_failure: Callable[[str], None] | None = None) -> None:
        """Start the Engine in a background thread; ``on_failure(message)`` if it cannot start. The factory
        (``engine_factory``, default ``Engine``) gets the engine kwargs and ``start_cancelled``, which turns true
        once ``shutdown`` is called."""
        def run() -> None:
            try:
                factory = self._factory or _default_engine
                engine = factory(**self.args.engine_kwargs(), start_cancelled=self._closing.is_set)
            except BaseException as e:  # noqa: BLE001 - reported, the launcher exits
                if self._closing.is_set():  # abandoned by shutdown: not a failure
                    logger.info("the server stopped before the engine was ready (%s)", e)
                    return
                self.error = f"the engine failed to start: {type(e).__name__}: {e}"
                logger.error(self.error)
                if on_failure is not None:
                    on_failure(self.error)
                return
            if self._closing.is_set():
                engine.shutdown()
                return
            self.engine = engine
            if self._factory is None:  # the real server's process: later collections skip its start-up heap
                freeze_heap()
            logger.info("engine ready: %s (context length %d)", self.args.model_path, engine.context_len)

        self._thread = threading.Thread(target=run, name="engine-start", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the Engine (idempotent). An engine still starting is abandoned and its start awaited, so that
        its subprocesses and IPC directory are gone when this returns (the process may exit right after: uvicorn
        re-raises SIGTERM; the start thread, a daemon, died with it and left them behind)."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join(_START_ABANDON_TIMEOUT_S)
            if self._thread.is_alive():
                logger.warning("the engine's start did not stop within %g s", _START_ABANDON_TIMEOUT_S)
        if self.engine is not None:
            self.engine.shutdown()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # ---- access -------------------------------------------------------------------------------

    def not_ready_reason(self) -> str | None:
        """None when the engine serves; otherwise why not (starting, failed, died)."""
        if self.error is not None:
            return self.error
        if self.engine is None:
            return "the engine is starting"
        dead = self.engine.tokenizer_manager.dead
        return f"the engine is not running: {dead}" if dead is not None else None

    def require_engine(self) -> Any:
        """The running Engine, or APIError 503 saying why there is none."""
        reason = self.not_ready_reason()
        if reason is not None:
            raise APIError(503, reason)
        return self.engine

    def require_tokenizer(self) -> Any:
        engine = self.require_engine()
        if engine.tokenizer is None:
            raise APIError(400, "this server was started without a tokenizer: pass token ids")
        return engine.tokenizer

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a blocking Engine call on the pool, off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    async def tokenize(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run tokenizer work (encoding, decoding, chat templates: a 16 MB prompt takes tens of seconds) on the
        tokenizer's own thread, off the event loop, which keeps answering other requests meanwhile."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_pool, functools.partial(fn, *args, **kwargs))

    @staticmethod
    async def wait(fut: Future) -> Any:
        """Await a ``concurrent.futures.Future`` returned by an ``async_op=True`` Engine call."""
        return await asyncio.wrap_future(fut)

    # ---- in-flight requests (for /abort_request) ---------------------------------------------------

    def track(self, job: Any) -> None:
        """``job`` (a ``GenJob``) was submitted: its request ids, and its group id if it has one, are live.
        An id a live job already holds stays that job's: the engine refuses the newcomer as a duplicate."""
        for rid in job.rids:
            self.inflight.setdefault(rid, job)
        if job.group_id is not None:
            self.groups.setdefault(job.group_id, job)

    def untrack(self, job: Any) -> None:
        """Forget the ids ``job`` holds (not those of a live job with the same ids: a refused duplicate's
        untrack removed them, so ``abort_all`` and ``/abort_request`` by the group id missed the live job)."""
        for rid in job.rids:
            if self.inflight.get(rid) is job:
                del self.inflight[rid]
        if job.group_id is not None and self.groups.get(job.group_id) is job:
            del self.groups[job.group_id]

    def request_ids(self, rid: str) -> list[str]:
        """The engine request ids that ``rid`` names: a multi-prompt response's id names all its prompts'."""
        job = self.groups.get(rid)
        return list(job.rids) if job is not None else [rid]

    # ---- weight-sync sessions (for /metrics) ----------------------------------------------------

    def sync_call_started(self) -> None:
        if self.sync_started is None:
            self.sync_started = time.monotonic()

    def sync_call_ended(self, result: Any, ok: bool) -> None:
        """An update call returned: a complete session sets the last sync duration; a failure ends it."""
        complete = isinstance(result, dict) and result.get("complete", False)
        if ok and not complete:
            return
        if ok and self.sync_started is not None:
            self.metrics.weight_sync_done(time.monotonic() - self.sync_started)
        self.sync_started = None


def _default_engine(**kwargs: Any) -> Any:
    from rollout.engine import Engine

    return Engine(**kwargs)
