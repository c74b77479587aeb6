"""``MemoryOccupation``: which of the engine's memory is released for a colocated trainer, and the calls that
release and resume it (SGLang's ``release_memory_occupation`` / ``resume_memory_occupation``; vLLM's
``sleep`` / ``wake_up`` map onto them in ``Engine``).

Contract:
- Release and resume run when no request is in flight (``ExclusiveReq``); requests still to finish (paused
  in place and holding KV, held by an open in-flight update session, or held by a pause: retracted, or sent
  while paused) make a release a ValueError (SGLang releases only an idle engine), as do an open weight-update
  session for a release of the weights (the KV cache alone may go), releasing a released tag and resuming one
  that is not released.
- While anything is released, new requests fail at once with ``refusal()`` (the engine sleeps); the prefix
  cache is dropped with the KV cache.
- Released weights come back with their contents only when they were kept (``keep_weights``, vLLM's sleep
  level 1). Otherwise their memory holds no weights after resume: the weights are marked inconsistent until
  a complete update (every parameter) or a reload (what a failed update had loaded before counts for nothing),
  and a push while the weights' memory is released is refused (``update_problem``).
"""

from __future__ import annotations

from typing import Any, Callable

from rollout.io_struct import GetMemoryStateReq, ReleaseMemoryOccupationReq, ResumeMemoryOccupationReq
from rollout.model_executor.memory_saver import TAGS
from rollout.model_executor.model_runner import ModelRunner
from rollout.scheduler.cache import KVCacheManager
from rollout.weights.updater import WeightUpdater


class MemoryOccupation:
    def __init__(self, runner: ModelRunner, cache: KVCacheManager, updater: WeightUpdater,
                 held: Callable[[], tuple[int, int, str | None]]) -> None:
        """``held()``: (requests still holding KV: paused in place, requests waiting, the pause mode or None) when
        a release runs: waiting requests are held by a pause, or else arrived while the release waited for the
        running ones (it holds new requests back)."""
        self.runner = runner
        self.cache = cache
        self.updater = updater
        self.held = held
        self.released: dict[str, bool] = {}  # tag → its contents were kept

    def handlers(self) -> dict[type, Callable[[Any], Any]]:
        """The control requests this component runs, by type (part of ``Scheduler.control_handlers``)."""
        return {ReleaseMemoryOccupationReq: self.release, ResumeMemoryOccupationReq: self.resume,
                GetMemoryStateReq: self.state}

    def release(self, req: ReleaseMemoryOccupationReq) -> dict[str, Any]:
        """Release ``req.tags`` (all by default)."""
        tags = _check_tags(req.tags)
        running, waiting, paused = self.held()
        already = [t for t in tags if t in self.released]
        if already:
            raise ValueError(f"memory already released: {already} (the engine is asleep; wake_up() first)")
        if running and self.updater.session:
            raise ValueError(f"{running} requests hold KV and wait for the open weight update "
                             "(update_weights_in_flight): complete the update and let them finish, or abort them, "
                             "before releasing memory")
        if running:
            raise ValueError(f"{running} requests are paused in place and hold KV: abort them or let them "
                             "finish before releasing memory")
        if waiting and paused is None:  # a release would fail them: they were accepted
            raise ValueError(f"{waiting} requests arrived while this release waited for the running ones and wait "
                             "behind it: let them finish or abort them, or call pause_generation() first so that no "
                             "new request starts, before releasing memory")
        if waiting:
            raise ValueError(f"{waiting} requests are held by pause_generation (retracted, or sent while paused): "
                             "continue_generation() and let them finish, or abort them, before releasing memory")
        if "weights" in tags and self.updater.state == "updating":
            raise ValueError("a weight update is in progress: complete it before releasing the weights")
        for tag in sorted(tags, key=TAGS.index):
            keep = req.keep_weights if tag == "weights" else False
            if tag == "kv_cache" and not self.cache.flush():
                raise RuntimeError("the prefix cache is still in use")
            if tag == "weights":  # distributed updates' receive buffer (a bucket), freed before the device's cache is
                self.updater.drop_scratch()
            self.runner.release_memory(tag, keep)
            self.released[tag] = keep
        return self.state()

    def resume(self, req: ResumeMemoryOccupationReq) -> dict[str, Any]:
        """Resume ``req.tags`` (default: every released tag; "kv_cache" brings "cuda_graph" back with it)."""
        if req.tags is None:
            tags = list(self.released)
            if not tags:
                raise ValueError("the engine is awake: no memory is released")
        else:
            tags = _check_tags(req.tags)
            awake = [t for t in tags if t not in self.released]
            if awake:
                raise ValueError(f"memory not released: {awake} (released: {sorted(self.released) or 'none'})")
        if "kv_cache" in tags and "cuda_graph" in self.released:
            tags.append("cuda_graph")  # the graphs' memory comes back with the KV cache (vLLM has no such tag)
        for tag in sorted(set(tags), key=TAGS.index):
            kept = self.released.pop(tag)
            self.runner.resume_memory(tag, kept)
            if tag == "weights" and not kept:
                self.updater.discard("the weights were released without a copy (sleep(level=2) or "
                                     "release_memory_occupation), so their memory holds none")
        return self.state()

    def state(self, req: Any = None) -> dict[str, Any]:
        return {"sleeping": bool(self.released), "released": sorted(self.released, key=TAGS.index),
                "weights_kept": self.released.get("weights")}

    def refusal(self) -> str | None:
        """Why requests cannot run now (None when nothing is released)."""
        if not self.released:
            return None
        return (f"the engine is asleep (released: {', '.join(sorted(self.released, key=TAGS.index))}): "
                "call wake_up() (resume_memory_occupation) first")

    def update_problem(self) -> str | None:
        """Why a weight update cannot load now (None when it can)."""
        if "weights" not in self.released:
            return None
        return "the weights' memory is released: wake_up(tags=['weights']) (resume_memory_occupation) before an update"


def _check_tags(tags: list[str] | None) -> list[str]:
    if tags is None:
        return list(TAGS)
    if not isinstance(tags, (list, tuple)) or not tags:
        raise ValueError(f"tags must be a non-empty list of {list(TAGS)}, got {tags!r}")
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}: use {list(TAGS)}")
    return list(dict.fromkeys(tags))
