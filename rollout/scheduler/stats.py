"""Scheduler counters: step timings (``Engine.get_step_stats``) and the periodic log line SGLang and vLLM
users read (running, queued, KV use, prefill and generation tokens/s, weight version)."""

from __future__ import annotations

import logging
import time
from typing import Any

from rollout.model_executor.forward_batch import ForwardMode
from rollout.model_executor.model_runner import StepInput

logger = logging.getLogger(__name__)


class SchedulerStats:
    def __init__(self, log_interval_s: float) -> None:
        self.log_interval_s = log_interval_s
        self.prefill_tokens = 0
        self.gen_tokens = 0
        self.retractions = 0
        self.mixed_steps = 0   # extend steps that also decoded the running requests (enable_mixed_chunk)
        self.cascade_steps = 0  # decode steps with rows grouped by a shared prefix (cascade decode)
        self.cascade_rows = 0   # rows in those groups, summed over the steps
        self.decode_steps: dict[int, list[float]] = {}  # batch size → [count, total seconds, total kv tokens]
        self.prefill_steps = [0, 0.0, 0]                # count, seconds, tokens
        self.prefill_host = [0.0, 0.0]  # seconds scheduling + launching extend steps, seconds waiting for them
        self._last_log = time.monotonic()
        self._last_prefill = 0
        self._last_gen = 0

    def record(self, step: StepInput, seconds: float, waited: float = 0.0) -> None:
        """One step read back: ``seconds`` since its launch (or the previous step's read), ``waited`` of them
        blocked on its results."""
        if step.mode == ForwardMode.EXTEND:
            self.prefill_host[1] += waited
            n = sum(step.extend_lens)
            self.prefill_tokens += n
            self.prefill_steps[0] += 1
            self.prefill_steps[1] += seconds
            self.prefill_steps[2] += n
        else:
            entry = self.decode_steps.setdefault(len(step.seq_lens), [0, 0.0, 0])
            entry[0] += 1
            entry[1] += seconds
            entry[2] += sum(step.seq_lens)
            if step.shared_prefixes is not None:
                self.cascade_steps += 1
                self.cascade_rows += sum(map(len, step.shared_prefixes.members))

    def snapshot(self, reset: bool) -> dict[str, Any]:
        out = {"decode": {b: {"steps": c, "seconds": t, "kv_tokens": k} for b, (c, t, k) in self.decode_steps.items()},
               "prefill": {"steps": self.prefill_steps[0], "seconds": self.prefill_steps[1],
                           "tokens": self.prefill_steps[2], "launch_seconds": self.prefill_host[0],
                           "wait_seconds": self.prefill_host[1]},
               "gen_tokens": self.gen_tokens, "prefill_tokens": self.prefill_tokens,
               "retractions": self.retractions, "mixed_steps": self.mixed_steps,
               "cascade_steps": self.cascade_steps, "cascade_rows": self.cascade_rows}
        if reset:
            self.decode_steps = {}
            self.prefill_steps = [0, 0.0, 0]
            self.prefill_host = [0.0, 0.0]
        return out

    def maybe_log(self, load: dict[str, Any]) -> None:
        """Log one line if ``log_interval_s`` passed since the last (``load``: ``Scheduler.get_load``)."""
        now = time.monotonic()
        dt = now - self._last_log
        if dt < self.log_interval_s:
            return
        logger.info("running %d, queued %d, KV %d/%d (%.1f%%), prefill %.1f tok/s, gen %.1f tok/s, "
                    "retracted %d, weight version %s", load["running"], load["waiting"], load["kv_used"],
                    load["kv_total"], 100.0 * load["kv_used"] / load["kv_total"],
                    (self.prefill_tokens - self._last_prefill) / dt, (self.gen_tokens - self._last_gen) / dt,
                    self.retractions, load["weight_version"])
        self._last_log, self._last_prefill, self._last_gen = now, self.prefill_tokens, self.gen_tokens
