"""Engine handles for the trainer: make a Ray engine actor (or an actor object in this process) look like
an engine to ``weight_sync.WeightSender``, whose calls take ``async_op=True`` and return futures.

- ``ActorEngine(actor)`` wraps a Ray ``ActorHandle`` of ``EngineActor``: ``handle.update_weight(...,
  async_op=True)`` is ``actor.update_weight.remote(...)`` as a ``concurrent.futures.Future``; without
  ``async_op`` it waits for the result.
- ``LocalActor(obj)`` gives an actor object in this process Ray's calling convention without Ray:
  ``local.update_weight.remote(...)`` runs the call on one worker thread in submission order (like a
  Ray actor's default concurrency group) and returns a Future; ``get(refs)`` waits like ``ray.get``.
  Request-serving calls (``EngineActor.GENERATE_METHODS``) and control calls (``EngineActor.CONTROL_METHODS``)
  run on pools of their own, as in the actor's concurrency groups on Ray.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable

from rollout.engine_handle import ForwardingEngineHandle


def is_ray_actor(obj: Any) -> bool:
    return type(obj).__name__ == "ActorHandle" and type(obj).__module__.startswith("ray")


class ActorEngine(ForwardingEngineHandle):
    """An engine handle (``rollout.engine_handle.EngineHandle``) over an actor (Ray or ``LocalActor``) with
    ``EngineActor``'s methods; other actor methods are reachable by name too."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor

    def _submit(self, method: str, args: tuple, kwargs: dict) -> Future:
        ref = getattr(self._actor, method).remote(*args, **kwargs)
        return ref if isinstance(ref, Future) else ref.future()

    def _call(self, method: str, async_op: bool, **kwargs: Any) -> Any:
        fut = self._submit(method, (), kwargs)
        return fut if async_op else fut.result()

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)

        def call(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
            fut = self._submit(method, args, kwargs)
            return fut if async_op else fut.result()

        return call

    def __repr__(self) -> str:
        return f"ActorEngine({self._actor!r})"


def as_engine(engine: Any) -> Any:
    """What ``WeightSender`` can drive: Ray actors and ``LocalActor``s are wrapped, engines (``Engine``,
    ``RemoteEngine``, ``ActorEngine``) pass through."""
    if isinstance(engine, LocalActor) or is_ray_actor(engine):
        return ActorEngine(engine)
    return engine


class _Method:
    def __init__(self, pool: ThreadPoolExecutor, fn: Any) -> None:
        self._pool, self._fn = pool, fn

    def remote(self, *args: Any, **kwargs: Any) -> Future:
        return self._pool.submit(self._fn, *args, **kwargs)


class LocalActor:
    """Ray's ``actor.method.remote(...)`` for an object in this process (no Ray needed): calls run on one
    ordered worker thread, except ``generate_methods`` and ``control_methods`` (default: the object's
    ``GENERATE_METHODS`` / ``CONTROL_METHODS``), which run on pools of their own."""

    def __init__(self, obj: Any, control_methods: Iterable[str] | None = None,
                 generate_methods: Iterable[str] | None = None, generate_concurrency: int = 8) -> None:
        self._obj = obj
        self._ordered = ThreadPoolExecutor(max_workers=1, thread_name_prefix="actor")
        self._control = ThreadPoolExecutor(max_workers=4, thread_name_prefix="actor-control")
        self._generate = ThreadPoolExecutor(max_workers=generate_concurrency, thread_name_prefix="actor-generate")
        if control_methods is None:
            control_methods = getattr(obj, "CONTROL_METHODS", ())
        if generate_methods is None:
            generate_methods = getattr(obj, "GENERATE_METHODS", ())
        self._pools = {**{m: self._generate for m in generate_methods}, **{m: self._control for m in control_methods}}

    def __getattr__(self, method: str) -> _Method:
        if method.startswith("_"):
            raise AttributeError(method)
        fn = getattr(self._obj, method)
        return _Method(self._pools.get(method, self._ordered), fn)

    def stop_threads(self) -> None:
        """Stop the worker threads (after the calls already submitted); the object itself stays."""
        for pool in (self._ordered, self._control, self._generate):
            pool.shutdown(wait=True)


def get(refs: Any, timeout: float | None = None) -> Any:
    """``ray.get`` for futures from ``LocalActor`` (a list or one), and for Ray object refs."""
    if isinstance(refs, list):
        return [get(r, timeout) for r in refs]
    if isinstance(refs, Future):
        return refs.result(timeout)
    import ray

    return ray.get(refs, timeout=timeout)
