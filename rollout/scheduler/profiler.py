"""``StepProfiler``: SGLang's ``start_profile`` / ``stop_profile`` for one TP rank, a torch.profiler trace of the
scheduler's steps (host work, the launches and, on CUDA, every kernel, those inside CUDA graphs included).

Contract:
- Each rank writes ``{output_dir}/{profile_id}-TP-{rank}.trace.json.gz`` (Chrome trace format: Perfetto and
  ``chrome://tracing`` read it; ``benchmarks/trace_gaps.py`` sums its GPU idle time).
- While recording, the scheduler's phases appear as named ranges (``scope``): ``receive``, ``schedule prefill``,
  ``schedule decode``, ``launch <mode> <rows> rows``, ``wait``, ``results``, ``emit``.
- Steps are counted as they are launched (prefill, mixed and decode alike). Recording starts before the
  launch of step ``start_step`` (at the next launch when it is None or already past) and, with ``num_steps``,
  ends by itself before the launch that follows the ``num_steps``-th recorded one, after the device has run
  the recorded steps; otherwise at ``stop``.
- One profile at a time: starting a second, stopping none, an unknown activity ("CPU", "GPU") or "GPU" on an
  engine without CUDA is a ValueError and changes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from rollout.io_struct import StartProfileReq, StopProfileReq

logger = logging.getLogger(__name__)

ACTIVITIES = ("CPU", "GPU")


@dataclass
class _Window:
    req: StartProfileReq
    path: str
    start_at: int
    activities: list[str]
    profile: Any = None  # torch.profiler.profile once recording
    recorded: int = 0


class StepProfiler:
    def __init__(self, rank: int, tp_size: int, device: torch.device) -> None:
        self.rank = rank
        self.tp_size = tp_size
        self.device = device
        self.steps = 0  # steps launched so far
        self.window: _Window | None = None

    def handlers(self) -> dict[type, Callable[[Any], Any]]:
        """The control requests this component runs, by type (part of ``Scheduler.control_handlers``)."""
        return {StartProfileReq: self.start, StopProfileReq: self.stop}

    def start(self, req: StartProfileReq) -> dict[str, Any]:
        """Validate and arm the profile -> ``{"traces": [one path per rank], "start_step": n}``."""
        if self.window is not None:
            raise ValueError("a profile is already running; call stop_profile first")
        activities = self._activities(req.activities)
        if req.num_steps is not None and req.num_steps < 1:
            raise ValueError(f"num_steps must be at least 1, got {req.num_steps}")
        if req.start_step is not None and req.start_step < 0:
            raise ValueError(f"start_step must be non-negative, got {req.start_step}")
        os.makedirs(req.output_dir, exist_ok=True)
        start_at = max(req.start_step or 0, self.steps)
        self.window = _Window(req, self._path(req.output_dir, req.profile_id, self.rank), start_at, activities)
        if start_at == self.steps:
            self._begin()
        return {"traces": [self._path(req.output_dir, req.profile_id, r) for r in range(self.tp_size)],
                "start_step": start_at}

    def stop(self, req: StopProfileReq | None = None) -> dict[str, Any]:
        """End the profile now and write the trace -> ``{"trace": path, "steps": steps recorded}``."""
        if self.window is None:
            raise ValueError("no profile is running; call start_profile first")
        return self._finish()

    def on_launch(self) -> None:
        """Call before each step's launch: starts or ends the armed window, then counts the step."""
        w = self.window
        if w is not None and w.profile is not None and w.req.num_steps is not None and w.recorded >= w.req.num_steps:
            self._finish()
        elif w is not None and w.profile is None and self.steps >= w.start_at:
            self._begin()
        if self.window is not None and self.window.profile is not None:
            self.window.recorded += 1
        self.steps += 1

    def scope(self, *name: Any) -> contextlib.AbstractContextManager:
        """A range named by ``name``'s parts joined with spaces in the trace while recording (the scheduler's
        phases: receive, schedule, launch, results); a no-op context otherwise, which formats nothing."""
        if self.window is None or self.window.profile is None:
            return contextlib.nullcontext()
        from torch.profiler import record_function

        return record_function(" ".join(map(str, name)))

    def _activities(self, names: list[str] | None) -> list[str]:
        cuda = self.device.type == "cuda"
        names = list(names) if names else (["CPU", "GPU"] if cuda else ["CPU"])
        unknown = [a for a in names if a not in ACTIVITIES]
        if unknown:
            raise ValueError(f"unknown profiler activities {unknown}; choose from {list(ACTIVITIES)}")
        if "GPU" in names and not cuda:
            raise ValueError("the GPU activity needs an engine on CUDA")
        return names

    @staticmethod
    def _path(output_dir: str, profile_id: str, rank: int) -> str:
        return os.path.join(output_dir, f"{profile_id}-TP-{rank}.trace.json.gz")

    def _begin(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        w = self.window
        kinds = {"CPU": ProfilerActivity.CPU, "GPU": ProfilerActivity.CUDA}
        w.profile = profile(activities=[kinds[a] for a in w.activities], with_stack=w.req.with_stack,
                            record_shapes=w.req.record_shapes)
        w.profile.start()
        logger.info("profiling from step %d into %s", self.steps, w.path)

    def _finish(self) -> dict[str, Any]:
        w, self.window = self.window, None
        if w.profile is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the recorded steps' kernels, before the trace is cut
            w.profile.stop()
            w.profile.export_chrome_trace(w.path)
            logger.info("profile of %d steps written to %s", w.recorded, w.path)
        return {"trace": w.path if w.profile is not None else None, "steps": w.recorded}
