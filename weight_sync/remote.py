"""An engine handle for another process: calls travel over a ``multiprocessing`` connection.

``serve_engine(engine, conn)`` runs in the engine's process; ``RemoteEngine(conn)`` in the trainer's
process has the engine's methods and returns futures, so ``WeightSender`` drives it like an
in-process engine. Calls that take ``async_op`` are issued in arrival order without blocking (the
order of update announcements matters); others run on a small thread pool.
"""

from __future__ import annotations

import inspect
import itertools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from rollout.engine_handle import ForwardingEngineHandle


def serve_engine(engine: Any, conn: Any) -> threading.Thread:
    """Serve ``engine``'s methods on ``conn`` from a daemon thread until the peer closes it."""
    thread = threading.Thread(target=_serve, args=(engine, conn), name="engine-server", daemon=True)
    thread.start()
    return thread


def _serve(engine: Any, conn: Any) -> None:
    pool = ThreadPoolExecutor(max_workers=4)
    lock = threading.Lock()

    def reply(call_id: int, fut: Future) -> None:
        exc = fut.exception()
        msg = (call_id, True, fut.result(), None) if exc is None else (call_id, False, str(exc), type(exc).__name__)
        with lock:
            try:
                conn.send(msg)
            except (OSError, EOFError):
                pass

    while True:
        try:
            call_id, method, args, kwargs = conn.recv()
        except (EOFError, OSError):
            break
        fn = getattr(engine, method, None)
        if fn is None or method.startswith("_"):
            fut: Future = Future()
            fut.set_exception(AttributeError(f"engine has no method {method!r}"))
        elif "async_op" in inspect.signature(fn).parameters:
            try:
                fut = fn(*args, **{**kwargs, "async_op": True})
            except Exception as e:  # noqa: BLE001 - returned to the caller
                fut = Future()
                fut.set_exception(e)
        else:
            fut = pool.submit(fn, *args, **kwargs)
        fut.add_done_callback(lambda f, cid=call_id: reply(cid, f))
    pool.shutdown(wait=False)


class RemoteEngine(ForwardingEngineHandle):
    """The trainer-side proxy: ``rollout.engine_handle.EngineHandle``'s calls, plus any other engine method
    by name (``generate``, ``chat``, ...). ``engine.method(...)`` blocks for the result unless
    ``async_op=True``."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._ids = itertools.count()
        self._futures: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="remote-engine", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                call_id, ok, value, error_type = self._conn.recv()
            except (EOFError, OSError):
                break
            fut = self._futures.pop(call_id, None)
            if fut is None:
                continue
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception((ValueError if error_type == "ValueError" else RuntimeError)(value))
        for fut in list(self._futures.values()):
            fut.set_exception(RuntimeError("the engine's process closed the connection"))

    def _call(self, method: str, async_op: bool, **kwargs: Any) -> Any:
        return self.call(method, async_op=async_op, **kwargs)

    def call(self, method: str, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        fut: Future = Future()
        with self._lock:
            call_id = next(self._ids)
            self._futures[call_id] = fut
            self._conn.send((call_id, method, args, kwargs))
        return fut if async_op else fut.result()

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self.call(method, *args, **kwargs)
