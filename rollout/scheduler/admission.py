"""``NewTokenRatio``: how many KV slots the running requests will still want, for admission and retraction
(SGLang's ``new_token_ratio``, with its constants).

Contract:
- A running request is expected to generate ``value`` of its remaining output budget (``max_output`` less the
  tokens it has, clipped at ``CLIP_MAX_NEW_TOKENS_ESTIMATION``); ``future_tokens`` is that, at least one page.
  Admission keeps those slots free for the running requests, and a request admitted in the same prefill
  step reserves its whole clipped budget (``admission_tokens``), as SGLang's ``PrefillAdder`` does.
- ``value`` starts at ``INIT_NEW_TOKEN_RATIO`` x ``schedule_conservativeness`` (at most 1) and falls by
  ``decay`` after every decode step that retracted nothing, down to ``MIN_NEW_TOKEN_RATIO_FACTOR`` of its
  start after ``NEW_TOKEN_RATIO_DECAY_STEPS`` steps: a batch is admitted carefully, then more boldly while
  nothing runs out.
- A decode step that does not fit retracts requests until the rest fit ``RETRACT_DECODE_STEPS`` more steps;
  ``value`` is then set from what the remaining requests actually generated (``after_retract``), so the next
  admissions reserve what is really needed.
- ``reset`` when the engine is idle: the next batch starts careful again.
``schedule_conservativeness`` 0 reserves one page per running request and per request admitted alongside,
and a full pool retracts until the rest fit one step (the engine's behaviour before this estimate).
"""

from __future__ import annotations

import math
from typing import Iterable

from rollout.scheduler.req import Req

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20
CLIP_MAX_NEW_TOKENS_ESTIMATION = 4096


class NewTokenRatio:
    def __init__(self, schedule_conservativeness: float, page_size: int = 1) -> None:
        self.init = min(INIT_NEW_TOKEN_RATIO * schedule_conservativeness, 1.0)
        self.min = min(self.init * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.decay = (self.init - self.min) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.value = self.init
        self.page_size = page_size

    @property
    def careful(self) -> bool:
        """An estimate is kept (conservativeness > 0): requests admitted alongside reserve their budgets and a
        full pool retracts for ``RETRACT_DECODE_STEPS`` steps."""
        return self.init > 0

    @staticmethod
    def _remaining(req: Req) -> int:
        """A request's output budget left, clipped (tokens in flight already hold their slots)."""
        left = req.max_output - len(req.output_ids) - req.inflight_tokens
        return min(max(left, 0), CLIP_MAX_NEW_TOKENS_ESTIMATION)

    def future_tokens(self, req: Req) -> int:
        """Slots kept free for a running request's next tokens: its expected output, at least one page."""
        return max(math.ceil(self._remaining(req) * self.value), self.page_size)

    def reserved(self, running: Iterable[Req]) -> int:
        """Slots kept free for all of ``running``."""
        return sum(self.future_tokens(r) for r in running)

    def admission_tokens(self, req: Req) -> int:
        """Slots reserved for the output of a request admitted in this prefill step: its whole clipped budget
        (one page when ``schedule_conservativeness`` is 0)."""
        return self._remaining(req) if self.careful else self.page_size

    def after_decode(self) -> None:
        """A decode step fitted without retracting: expect a little less of every request."""
        self.value = max(self.value - self.decay, self.min)

    def after_retract(self, remaining: list[Req]) -> None:
        """Requests were retracted: expect what the remaining ones generated so far, plus the
        ``RETRACT_DECODE_STEPS`` steps just made room for, over their whole budgets (at most 1)."""
        if not self.careful or not remaining:
            return
        decoded = sum(len(r.output_ids) + r.inflight_tokens for r in remaining)
        budget = sum(r.max_output for r in remaining)
        self.value = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(remaining)) / (budget + 1))

    def reset(self) -> None:
        self.value = self.init
