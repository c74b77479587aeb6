"""Decode batches and retraction: every running request gets one token per step.

Policy (``DecodeManager``): a decode step takes every running request that the step in flight does not
already end by length. When the KV pool has no slot left for them, the most recently admitted requests are
retracted (their KV released, requeued at the front of the waiting queue, re-prefilled later with their
output so far) until the rest fit ``RETRACT_DECODE_STEPS`` more steps (SGLang's ``retract_decode``), so a
full pool does not retract again at the next step; the admission estimate (``NewTokenRatio``) then
follows what the remaining requests really generated. The last request standing that does not fit one
step is aborted.

A step's KV read: cascade decode over the groups of requests sharing a cached prefix (``SharedPrefixFinder``),
except for a step whose lengths the attention backend wants cut into pieces (``balanced_decode``: one request
holding ``decode_balance_ratio`` times the mean length or more), which runs the load-balanced kernel without
groups (one H100, ``tools/exp_straggler.py``, groups of 8 beside one long request: 1.11x the cascade step's
speed at 256 rows with a 4k request, 1.87x at 128 rows with a 16k one).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from rollout.io_struct import FinishReason
from rollout.model_executor.forward_batch import ForwardMode
from rollout.model_executor.model_runner import StepInput
from rollout.scheduler.admission import RETRACT_DECODE_STEPS, NewTokenRatio
from rollout.scheduler.cache import KVCacheManager
from rollout.scheduler.output import OutputManager
from rollout.scheduler.prefix_groups import SharedPrefixFinder
from rollout.scheduler.req import Req
from rollout.scheduler.stats import SchedulerStats

logger = logging.getLogger(__name__)


class DecodeManager:
    def __init__(self, cache: KVCacheManager, outputs: OutputManager, stats: SchedulerStats,
                 ratio: NewTokenRatio, shared_prefix_members: int = 0,
                 balanced_decode: Callable[[list[int]], bool] = lambda seq_lens: False) -> None:
        self.cache = cache
        self.outputs = outputs
        self.stats = stats
        self.ratio = ratio
        self.prefixes = SharedPrefixFinder(shared_prefix_members)  # cascade decode's groups (0 members: off)
        self.balanced_decode = balanced_decode  # AttentionBackend.wants_balanced_decode

    @staticmethod
    def candidates(running: list[Req]) -> list[Req]:
        """Running requests, less those that the step in flight ends by length (known without its tokens)."""
        return [r for r in running if not r.ends_by_length()]

    def can_overlap(self, reqs: list[Req]) -> bool:
        """Whether a step over ``reqs`` can launch before the step in flight is read: their slots are free,
        and no request's sampling reads tokens that are not on the host yet (penalties)."""
        return (self.cache.ensure_free(self.cache.decode_slots_needed(reqs))
                and not any(r.inflight_tokens and r.needs_history for r in reqs))

    def make_room(self, running: list[Req], waiting: deque[Req],
                  retract_chunked: Callable[[], bool] = lambda: False) -> list[Req]:
        """Retract requests until the rest fit ``RETRACT_DECODE_STEPS`` steps (one without an admission
        estimate: the retracted requests would be admitted again at once) when they do not fit one;
        returns the step's requests (nothing may be in flight: retraction releases KV). The request part-way
        through a chunked prefill, the newest, goes first (``retract_chunked``: False when there is none), so
        that only a request that does not fit the pool on its own is aborted."""
        reqs = self.candidates(running)
        if self.cache.ensure_free(self.cache.decode_slots_needed(reqs)):
            self.ratio.after_decode()
            return reqs
        retracted, before = 0, self.ratio.value
        steps = RETRACT_DECODE_STEPS if self.ratio.careful else 1
        if not self.cache.can_hold(steps * self.cache.decode_slots_needed(reqs)) and retract_chunked():
            retracted += 1
        while len(running) > 1 and not self.cache.can_hold(steps * self.cache.decode_slots_needed(reqs)):
            self.retract(running.pop(), waiting)
            retracted += 1
            reqs = self.candidates(running)
        if retracted:
            self.ratio.after_retract(running)
            logger.info("KV cache pool is full: retracted %d requests, %d running; new_token_ratio %.4f -> %.4f",
                        retracted, len(running), before, self.ratio.value)
        if not self.cache.ensure_free(self.cache.decode_slots_needed(reqs)):
            victim = running.pop()  # the last request standing does not fit one step
            self.cache.read_routed_experts(victim)
            self.cache.release(victim)
            self.outputs.finish(victim, FinishReason("abort", message="sequence does not fit in the KV cache"))
            return []
        return reqs

    def retract(self, req: Req, waiting: deque[Req]) -> None:
        """Give a running request's KV back and requeue it at the front; it resumes by re-prefilling."""
        self.cache.release(req)
        waiting.appendleft(req)
        self.outputs.retract(req)
        self.stats.retractions += 1

    def build_step(self, reqs: list[Req]) -> StepInput:
        """One decode step over ``reqs`` (their next slots taken here), with the groups sharing a cached prefix
        when cascade decode is on and the step is not one for the load-balanced kernel (module docstring)."""
        slots = self.cache.alloc_decode(reqs)
        positions = [r.kv_len for r in reqs]
        seq_lens = [p + 1 for p in positions]
        balanced = self.balanced_decode(seq_lens)
        shared = None if balanced else \
            self.prefixes(reqs, self.stats.prefill_tokens)  # prefill_tokens moves with every extend step
        return StepInput(ForwardMode.DECODE, [r.pool_row for r in reqs], None, positions, slots,
                         seq_lens, [1] * len(reqs), shared_prefixes=shared, balanced_decode=balanced)
