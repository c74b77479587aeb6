"""The scheduler of one TP rank: the step loop with overlap, message handling, and the control table.

Every rank runs this same loop on the same inputs (rank 0 receives them and broadcasts), so every rank
makes the same decisions; only rank 0 talks to the detokenizer and answers control calls. The policies
live beside it: ``prefill.py`` (admission, chunking), ``decode.py`` (decode batches, retraction),
``cache.py`` (KV slots and the prefix tree), ``output.py`` (finishing, streaming), ``stats.py``; the
weight-update calls in ``rollout.weights.sync``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable

import torch

from rollout.config import EngineConfig, ModelConfig
from rollout.distributed import TPGroup
from rollout.io_struct import (AbortReq, BatchGenerateReq, ContinueGenerationReq, ControlReply, ControlReq,
                               ExclusiveReq, ExpireUpdateSession, FinishReason, GenerateReq, GetLoadReq,
                               GetStepStatsReq, GetWeightStateReq, PauseGenerationReq, ReadOnlyReq, ShutdownReq,
                               WeightUpdateReq)
from rollout.model_executor.forward_batch import ForwardMode
from rollout.model_executor.model_runner import ModelRunner, StepInput
from rollout.scheduler.admission import NewTokenRatio
from rollout.scheduler.cache import KVCacheManager
from rollout.scheduler.decode import DecodeManager
from rollout.scheduler.memory import MemoryOccupation
from rollout.scheduler.output import BackgroundTokenizer, OutputManager
from rollout.scheduler.prefill import PrefillManager
from rollout.scheduler.profiler import StepProfiler
from rollout.scheduler.req import Req
from rollout.scheduler.results import LaunchedStep, ResultProcessor
from rollout.scheduler.sampling import SamplingInfoCache
from rollout.scheduler.stats import SchedulerStats
from rollout.weights.sync import WeightSync
from rollout.weights.updater import WeightUpdater

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


class Scheduler:
    """Request queues, the step loop and control calls of one TP rank.

    Overlap scheduling (on unless ``disable_overlap_schedule``): while step N runs on the device, the host
    schedules and launches step N+1, then reads N's tokens. Decode inputs come from the device-side
    ``last_token_ids``, so N+1 needs nothing from N on the host. A request stopped by N's token has one
    extra token computed by N+1, which is dropped; requests whose length ends them at N are left out of
    N+1. Anything that changes requests or weights (aborts, control calls, retraction, penalties that read
    the token history) first waits for the step in flight (``sync``). Prefill steps overlap the same way
    (the prefill in flight counts as running for admission); the first decode after a prefill waits for it.
    """

    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, tp: TPGroup, device: torch.device,
                 send_output: Callable[[Any], None] | None = None,
                 send_reply: Callable[[ControlReply], None] | None = None) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.tp = tp
        self.runner = ModelRunner(config, model_cfg, tp, device)
        self.cache = KVCacheManager(self.runner.allocator, self.runner.req_to_token, config.page_size,
                                    config.disable_radix_cache, self.runner.kv_pool.routed_experts)
        self.outputs = OutputManager(send_output if tp.rank == 0 else None)
        self.stats = SchedulerStats(config.log_interval_s)
        self.new_token_ratio = NewTokenRatio(config.schedule_conservativeness, config.page_size)
        self.prefill = PrefillManager(config, self.cache, self.outputs, self.new_token_ratio)
        self.decode = DecodeManager(self.cache, self.outputs, self.stats, self.new_token_ratio,
                                    self.runner.shared_prefix_members, self.runner.attn_backend.wants_balanced_decode)
        updater = WeightUpdater(self.runner.weight_map, device, keep_copy=config.keep_weight_copy)
        self.memory = MemoryOccupation(self.runner, self.cache, updater,
                                       lambda: (len(self.running) + len(self._chunked_reqs()), len(self.waiting),
                                                self.paused))
        self.weights = WeightSync(updater, tp, device, self.cache, config.weight_version, self.memory.update_problem)
        self.reply = send_reply or (lambda reply: None)
        self.update_queue: deque[ExclusiveReq] = deque()  # calls waiting for no request in flight
        self.paused: str | None = None
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.stopped = False
        self.tokenizer = BackgroundTokenizer(config)  # for stop strings; loads while serving starts
        self.overlap = not config.disable_overlap_schedule
        self.in_flight: LaunchedStep | None = None
        self._last_done = 0.0  # when the previous step's results reached the host
        self.sampling = SamplingInfoCache(self.runner)
        self.profiler = StepProfiler(tp.rank, tp.size, device)
        self.results = ResultProcessor(self.running, self.cache, self.prefill, self.outputs, self.stats, self.tokenizer)
        self.control_handlers: dict[type, Callable[[Any], Any]] = {
            GetLoadReq: self.get_load, GetStepStatsReq: self.get_step_stats,
            GetWeightStateReq: self.get_weight_state, PauseGenerationReq: self.pause_generation,
            ContinueGenerationReq: self.continue_generation, **self.weights.handlers(), **self.memory.handlers(),
            **self.profiler.handlers()}

    def get_step_stats(self, req: GetStepStatsReq) -> dict[str, Any]:
        """``SchedulerStats.snapshot``, plus the decode steps replayed from each CUDA graph variant ("plain",
        "cascade", "balanced"; empty without graphs), the extend steps replayed from piecewise CUDA graphs
        (``extend_graph_replays``) and ``launched_steps``, the step count ``start_profile``'s ``start_step``
        refers to."""
        out = self.stats.snapshot(req.reset)
        out["launched_steps"] = self.profiler.steps
        graphs, pieces = self.runner.graph_runner, self.runner.piecewise_runner
        out["graph_replays"] = dict(graphs.replays) if graphs is not None else {}
        out["extend_graph_replays"] = pieces.replays if pieces is not None else 0
        if req.reset and graphs is not None:
            graphs.replays.clear()
        if req.reset and pieces is not None:
            pieces.replays = 0
        return out

    @property
    def context_len(self) -> int:
        return self.runner.context_len

    # ---- inputs -------------------------------------------------------------------------------

    def handle(self, msg: Any) -> None:
        """Apply one incoming message (control calls reply through ``self.reply``)."""
        if not isinstance(msg, (GenerateReq, BatchGenerateReq, ReadOnlyReq)):
            self.sync()
        if isinstance(msg, GenerateReq):
            self.add_request(msg)
        elif isinstance(msg, BatchGenerateReq):
            for req in msg.reqs:
                self.add_request(req)
        elif isinstance(msg, AbortReq):
            self.abort(msg.rid)
        elif isinstance(msg, ExclusiveReq):
            self.update_queue.append(msg)
        elif isinstance(msg, ControlReq):
            self.reply(self.run_control(msg))
        elif isinstance(msg, ExpireUpdateSession):
            self.weights.expire_session()
            self.fail_held_requests()
        elif isinstance(msg, ShutdownReq):
            self.weights.opened.clear()  # unmap a colocated trainer's tensors now: it may outlive this process
            if self.profiler.window is not None:  # an open profile is written, not lost
                self.profiler.stop()
            self.stopped = True

    def add_request(self, msg: GenerateReq) -> None:
        req = Req(msg, self.model_cfg.eos_token_ids, self.context_len)
        self.outputs.add(req)
        if len(req.prompt_ids) + 1 > self.context_len:
            self.outputs.finish(req, FinishReason("abort", message=(
                f"prompt of {len(req.prompt_ids)} tokens does not fit the context of {self.context_len}")))
        elif req.sampling.max_new_tokens == 0 and not self._wants_prefill_output(req):
            self.outputs.finish(req, FinishReason("length"))
        elif self._refusal() is not None:
            self.outputs.finish(req, FinishReason("abort", message=self._refusal(), error_type="RuntimeError"))
        else:
            self.waiting.append(req)

    def _wants_prefill_output(self, req: Req) -> bool:
        """A ``max_new_tokens=0`` request is still prefilled when its prompt gives an output: prompt logprobs, or
        the routed experts of its prompt (rows ``[routed_experts_start_len, prompt - 1)``, as SGLang returns them);
        any other one finishes at once."""
        return req.prompt_lp_k is not None or (req.sampling.return_routed_experts
                                               and self.cache.routed_experts is not None)

    def abort(self, rid: str, reason: FinishReason | None = None) -> None:
        req = self.outputs.live.get(rid)
        if req is None:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self.prefill.drop(req)
        self.cache.read_routed_experts(req)  # the partial tokens' routing, as SGLang returns it on an abort
        self.cache.release(req)
        self.outputs.finish(req, reason or FinishReason("abort", message="aborted"))

    def run_control(self, req: ControlReq) -> ControlReply:
        """Run one control call with its handler from ``control_handlers``; errors become the reply."""
        handler = self.control_handlers.get(type(req))
        if handler is None:
            return ControlReply(req.cid, False, error=f"unknown control call {type(req).__name__}",
                                error_type="ValueError")
        try:
            reply = ControlReply(req.cid, True, result=handler(req))
        except (ValueError, TypeError) as e:
            reply = ControlReply(req.cid, False, error=str(e), error_type="ValueError")
        except Exception as e:  # noqa: BLE001 - reported to the caller, the engine keeps serving
            logger.exception("control call %s failed", type(req).__name__)
            reply = ControlReply(req.cid, False, error=f"{type(e).__name__}: {e}")
        if isinstance(req, WeightUpdateReq) and self.tp.size > 1:  # ranks must never disagree about weights
            all_ok, none_ok = self.tp.all_true(reply.ok), self.tp.all_true(not reply.ok)
            if not all_ok and not none_ok:
                self.weights.mark_inconsistent(f"{type(req).__name__} failed on some tensor-parallel ranks only")
        return reply

    # ---- one step -----------------------------------------------------------------------------

    @property
    def admitting(self) -> bool:
        """New requests may start: no pending update, not paused, weights complete and consistent, awake."""
        return (not self.update_queue and self.paused is None and self.weights.updater.state == "consistent"
                and not self.memory.released)

    def _refusal(self) -> str | None:
        """Why requests fail now: the engine sleeps, or its weights are inconsistent (None: they may run)."""
        if self.memory.released:
            return self.memory.refusal()
        return self.weights.refusal() if self.weights.updater.state == "inconsistent" else None

    @property
    def frozen(self) -> bool:
        """Running requests must not step: paused in place, or a weight-update session is open (weights half
        updated, ``update_weights_in_flight``)."""
        return self.paused == "in_place" or bool(self.weights.updater.session)

    def _runs_now(self, req: ExclusiveReq) -> bool:
        """``req`` may run at this step boundary although requests are in flight: a weight update under
        ``update_weights_in_flight``, or any call while the running requests cannot step (``frozen``: paused in
        place, or held by an open update session), since they would never finish for it (a release queued
        between two buckets of an in-flight update held back the next bucket, which alone could unfreeze them)."""
        return self.frozen or (self.config.update_weights_in_flight and isinstance(req, WeightUpdateReq))

    @property
    def busy(self) -> bool:
        """There is work to do now (held requests and a frozen engine are not work)."""
        if self.in_flight is not None:
            return True
        if self.frozen:
            return bool(self.update_queue)
        return bool(self.running or self.prefill.chunked or self.update_queue
                    or (self.waiting and (self.admitting or self._refusal() is not None)))

    def step(self) -> None:
        """Run due weight updates, then launch one batch (prefill first, else decode), read the results of
        the step before it, and emit outputs. A step stays in flight until the next call."""
        self.run_ready_updates()
        self.fail_held_requests()
        launched = None
        if not self.frozen:
            if (self.waiting and self.admitting) or self.prefill.chunked:
                if not self._extend_in_flight():
                    self.sync()
                launched = self._timed_prefill()
                if launched is None and self._extend_in_flight():  # e.g. all waiting share its prompts
                    self.sync()
                    launched = self._timed_prefill()
            if launched is None:
                if self._extend_in_flight():  # its requests join this decode step
                    self.sync()
                if self.running:
                    with self.profiler.scope("schedule decode"):
                        launched = self._schedule_decode()
        self.sync()  # the step launched before this one
        if launched is not None:
            if self.overlap:
                self.in_flight = launched
            else:
                self.process_results(launched)
        elif not self.running and not self.waiting and self.prefill.chunked is None:
            self.new_token_ratio.reset()  # idle: the next batch is admitted carefully again
        self.emit()
        if self.tp.rank == 0 and self.busy:
            self.stats.maybe_log(self.get_load())

    def emit(self) -> None:
        with self.profiler.scope("emit"):
            self.outputs.emit(self.running, self.weights.weight_version)

    def _timed_prefill(self) -> LaunchedStep | None:
        """``_schedule_prefill``, its host time counted in the step stats (and a range in a profile)."""
        with self.profiler.scope("schedule prefill"):
            start = time.perf_counter()
            launched = self._schedule_prefill()
            self.stats.prefill_host[0] += time.perf_counter() - start
        return launched

    def _schedule_prefill(self) -> LaunchedStep | None:
        """Launch an extend step over the admitted prompts (and chunk); with ``enable_mixed_chunk`` the running
        requests decode in it too, one token each (their last tokens must be on the host: read the step in
        flight first)."""
        mixing = self.config.enable_mixed_chunk and bool(self.running)
        if mixing:
            self.sync()
        in_flight = self._in_flight_prefilled()
        decoding = self.decode.candidates(self.running) if mixing else []
        ids = {id(r) for r in self.running}
        running = self.running + [r for r in in_flight if id(r) not in ids]  # a mixed step's rows are both
        reqs, lens = self.prefill.schedule(self.waiting, running, in_flight, self.admitting, reserve=len(decoding))
        if not reqs:
            return None
        if decoding and self.cache.ensure_free(self.cache.decode_slots_needed(decoding)):
            self.cache.alloc_decode(decoding)
            reqs, lens = reqs + decoding, lens + [1] * len(decoding)
            self.stats.mixed_steps += 1
        inputs, sampled = self.prefill.build_step(reqs, lens)
        return self.launch(reqs, inputs, sampled)

    def _schedule_decode(self) -> LaunchedStep | None:
        """Launch one decode step over the running requests (after the step in flight, if any)."""
        if self.in_flight is not None and not self.decode.can_overlap(self.decode.candidates(self.running)):
            self.sync()
        reqs = self.decode.make_room(self.running, self.waiting, self._retract_chunked)
        if not reqs:
            return None
        return self.launch(reqs, self.decode.build_step(reqs), reqs)

    def _retract_chunked(self) -> bool:
        """Retract the request part-way through a chunked prefill (its KV back, requeued first); False if none."""
        req = self.prefill.chunked
        if req is None:
            return False
        self.prefill.drop(req)
        self.decode.retract(req, self.waiting)
        return True

    def _extend_in_flight(self) -> bool:
        return self.in_flight is not None and self.in_flight.inputs.mode == ForwardMode.EXTEND

    def _chunked_reqs(self) -> list[Req]:
        """The request whose prompt is partly computed, as a list (empty when none)."""
        return [self.prefill.chunked] if self.prefill.chunked is not None else []

    def _num_admitted(self) -> int:
        """Admitted, unfinished requests: running, the chunked one, and those whose prefill is in flight."""
        counted = {id(r) for r in self.running} | {id(self.prefill.chunked)}
        starting = sum(id(r) not in counted for r in self._in_flight_prefilled())
        return len(self.running) + (self.prefill.chunked is not None) + starting

    def _in_flight_prefilled(self) -> list[Req]:
        """Requests whose prefill completes in the extend step in flight (running once it is read)."""
        return self.in_flight.sampled if self._extend_in_flight() else []

    def sync(self) -> None:
        """Read the results of the step in flight, if any (the host state is then complete)."""
        if self.in_flight is not None:
            launched, self.in_flight = self.in_flight, None
            self.process_results(launched)

    def launch(self, reqs: list[Req], inputs: StepInput, sampled: list[Req]) -> LaunchedStep:
        """Queue the forward of ``inputs`` and sampling for ``sampled`` (a subset of ``reqs``, in order)."""
        chosen = {id(r) for r in sampled}
        index = [i for i, r in enumerate(reqs) if id(r) in chosen]
        info = self.sampling.get(sampled, inputs.mode) if sampled else None
        for req, n in zip(reqs, inputs.extend_lens):
            req.kv_len += n
        for req in sampled:
            req.inflight_tokens += 1
        want = inputs.prompt_logprobs
        prompt_lp_reqs = [(r, n) for r, n in zip(reqs, want.counts) if n] if want is not None else []
        self.profiler.on_launch()
        start = time.perf_counter()
        with self.profiler.scope("launch", inputs.mode.name.lower(), len(reqs), "rows"):
            output = self.runner.run_step(inputs, index, info)
        return LaunchedStep(inputs, sampled, output, start, prompt_lp_reqs, self.weights.weight_version)

    # ---- results ------------------------------------------------------------------------------

    def process_results(self, step: LaunchedStep) -> None:
        """Wait for a launched step's results and apply them (``ResultProcessor``)."""
        start = time.perf_counter()
        with self.profiler.scope("wait"):
            out = step.output.wait() if step.output is not None else None
        now = time.perf_counter()
        self.stats.record(step.inputs, now - max(step.launched_at, self._last_done), waited=now - start)
        self._last_done = now
        with self.profiler.scope("results"):
            self.results.apply(step, out)

    # ---- control handlers ---------------------------------------------------------------------

    def run_ready_updates(self) -> None:
        """Run queued exclusive calls once nothing is in flight, or at this step boundary when they may run
        beside requests in flight (``_runs_now``)."""
        busy = self.running or self.prefill.chunked is not None or self.in_flight is not None
        if not self.update_queue or (busy and not self._runs_now(self.update_queue[0])):
            return
        self.sync()  # no forward may read the weights while they change
        self.emit()  # requests that ended (aborted to let the call run) return before it, which may wait on a trainer
        while self.update_queue and (not busy or self._runs_now(self.update_queue[0])):
            call = self.update_queue.popleft()
            if isinstance(call, WeightUpdateReq):
                self._restart_prefills()
            self.reply(self.run_control(call))

    def _restart_prefills(self) -> None:
        """A weight update lands while a prompt is part-way through its chunked prefill: its KV so far is given back
        and it waits first in line to be prefilled again. It has sampled no token, so every token it samples is the
        new weights' (``token_weight_versions`` all name them), and so is its KV: kept, the chunks computed by the old
        weights made those tokens neither policy's while their versions claimed the new one. So are its prompt logprobs,
        and those of every waiting request that has sampled no token (one retracted part-way through its prefill, by
        a full pool or ``pause_generation(mode="retract")``): those computed so far are dropped and computed again."""
        req = self.prefill.chunked
        if req is not None:
            self.prefill.drop(req)
            self.cache.release(req)
            self.waiting.appendleft(req)
        for req in self.waiting:
            if not req.output_ids:
                req.drop_prompt_logprobs()

    def fail_held_requests(self) -> None:
        """While the weights are inconsistent or the engine sleeps, every held request fails with the reason;
        so do requests kept running across an update (in place, or in flight) once the weights are a mix."""
        reason = self._refusal()
        while reason is not None and self.waiting:
            req = self.waiting.popleft()
            self.outputs.finish(req, FinishReason("abort", message=reason, error_type="RuntimeError"))
        if reason is None or self.weights.updater.state != "inconsistent":
            return
        started = list(self.running) + self._chunked_reqs()
        if started:
            self.sync()
        for req in started:
            self.abort(req.rid, FinishReason("abort", message=reason, error_type="RuntimeError"))

    def pause_generation(self, req: PauseGenerationReq) -> bool:
        """Hold new requests; running ones are aborted, retracted (re-run later) or kept in place."""
        if req.mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {req.mode!r}")
        self.paused = req.mode
        chunked = self._chunked_reqs()
        if req.mode == "abort":
            for r in list(self.waiting) + list(self.running) + chunked:
                self.abort(r.rid)
        elif req.mode == "retract":
            while self.running:
                self.decode.retract(self.running.pop(), self.waiting)
            for r in chunked:
                self.prefill.drop(r)
                self.decode.retract(r, self.waiting)
        return True

    def continue_generation(self, req: Any = None) -> bool:
        self.paused = None
        return True

    def get_weight_state(self, req: Any = None) -> dict[str, Any]:
        return {**self.weights.state(), "paused": self.paused}

    def get_load(self, req: Any = None) -> dict[str, Any]:
        """Counters for ``Engine.get_server_info`` and the HTTP server's /metrics (cumulative totals)."""
        return {"running": self._num_admitted(), "waiting": len(self.waiting),
                "kv_used": self.cache.used, "kv_total": self.cache.num_slots, "retractions": self.stats.retractions,
                "cached_tokens": self.cache.tree.total_size, "prefill_tokens": self.stats.prefill_tokens,
                "gen_tokens": self.stats.gen_tokens, "weight_version": self.weights.weight_version}
