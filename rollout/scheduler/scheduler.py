"""The scheduler of one TP rank: continuous batching over a paged KV pool with a radix prefix cache.

Every rank runs this same loop on the same inputs (rank 0 receives them and broadcasts), so every rank
makes the same decisions; only rank 0 talks to the detokenizer and answers control calls.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.config import EngineConfig, ModelConfig
from rollout.distributed import TPGroup
from rollout.io_struct import (AbortReq, BatchTokenOut, ControlReply, ControlReq, DecodeSpec, ExpireUpdateSession,
                               FinishReason, GenerateReq, PromptLogprobsOut, ShutdownReq, TokenOut)
from rollout.layers.sampler import SamplingBatchInfo, SamplingRow
from rollout.mem_cache.radix_cache import RadixCache
from rollout.model_executor.forward_batch import ForwardMode
from rollout.model_executor.model_runner import ModelRunner, PromptLogprobsRequest, StepInput, StepOutput
from rollout.scheduler.req import Req
from rollout.scheduler.weight_mixin import WEIGHT_OPS, WeightUpdateMixin
from rollout.weight_updater import WeightUpdater

logger = logging.getLogger(__name__)

# control calls that only read state: they may run while a step is in flight
_READ_ONLY_OPS = frozenset({"get_load", "get_step_stats", "get_weight_version", "get_weight_state"})


@dataclass
class LaunchedStep:
    """A step whose forward and sampling were queued on the device; its results are read later."""

    inputs: StepInput
    sampled: list[Req]          # the requests that get a token from this step
    output: StepOutput | None
    launched_at: float
    prompt_lp_reqs: list[tuple[Req, int]] = field(default_factory=list)  # (request, rows) of prompt logprobs


class Scheduler(WeightUpdateMixin):
    """Request queue, batch formation, KV accounting and output emission for one TP rank.

    Overlap scheduling (on unless ``disable_overlap_schedule``): while decode step N runs on the device,
    the host schedules and launches step N+1, then reads N's tokens. Decode inputs come from the
    device-side ``last_token_ids``, so N+1 needs nothing from N on the host. A request stopped by N's
    token has one extra token computed by N+1, which is dropped; requests whose length ends them at N
    are left out of N+1. Anything that changes requests or weights (prefill, aborts, control calls,
    retraction, penalties that need the token history) first waits for the step in flight (``sync``).
    Prefill steps overlap the same way: the next prefill batch is launched while the previous one runs
    (its requests count as running for admission, and waiting requests that share its prompts wait for
    it to be read and cached); the first decode step after a prefill waits for it, so its requests join.
    """

    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, tp: TPGroup, device: torch.device,
                 send_output: Any = None, send_reply: Any = None) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.tp = tp
        self.runner = ModelRunner(config, model_cfg, tp, device)
        self.allocator = self.runner.allocator
        self.req_pool = self.runner.req_to_token
        self.tree = RadixCache(self.allocator.free, disabled=config.disable_radix_cache, page_size=config.page_size)
        self.send_output = send_output
        self.reply = send_reply or (lambda reply: None)
        self.updater = WeightUpdater(self.runner.weight_map, tp, device, keep_copy=config.keep_weight_copy)
        self.pending_updates: deque[ControlReq] = deque()
        self.paused: str | None = None
        self.stale_trees: list[RadixCache] = []
        self.version_before_session: str | None = None
        self.updates_completed = 0
        self.timing: dict[str, float] = {}
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.reqs: dict[str, Req] = {}
        self.weight_version = config.weight_version
        self.stopped = False
        self._tokenizer = _BackgroundTokenizer(config)  # for stop strings; loads while serving starts
        self._pending: list[Req] = []
        self.stats = SchedulerStats()
        self.overlap = not config.disable_overlap_schedule
        self.in_flight: LaunchedStep | None = None
        self._last_done = 0.0  # when the previous step's results reached the host
        # (request ids, sampling tensors) of the last decode step, reused by the next one over the same requests
        self._decode_info: tuple[tuple[str, ...], SamplingBatchInfo] | None = None

    @property
    def context_len(self) -> int:
        return self.runner.context_len

    # ---- inputs -------------------------------------------------------------------------------

    def handle(self, msg: Any) -> None:
        """Apply one incoming message (control calls reply through ``self.reply``)."""
        if not isinstance(msg, GenerateReq) and not (isinstance(msg, ControlReq) and msg.op in _READ_ONLY_OPS):
            self.sync()
        if isinstance(msg, GenerateReq):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg.rid)
        elif isinstance(msg, ControlReq):
            if msg.op in WEIGHT_OPS:
                self.pending_updates.append(msg)
            else:
                self.reply(self.run_control(msg))
        elif isinstance(msg, ExpireUpdateSession):
            self.expire_session()
        elif isinstance(msg, ShutdownReq):
            self.stopped = True

    def add_request(self, msg: GenerateReq) -> None:
        req = Req(msg, self.model_cfg.eos_token_ids, self.context_len)
        self.reqs[req.rid] = req
        if len(req.prompt_ids) + 1 > self.context_len:
            self.finish(req, FinishReason("abort", message=(
                f"prompt of {len(req.prompt_ids)} tokens does not fit the context of {self.context_len}")))
            return
        if req.sampling.max_new_tokens == 0 and req.prompt_lp_k is None:  # else prefilled for its prompt logprobs
            self.finish(req, FinishReason("length"))
            return
        if self.updater.state == "inconsistent":
            self.finish(req, FinishReason("abort", message=self.refusal(), error_type="RuntimeError"))
            return
        self.waiting.append(req)

    def abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None or req.finished is not None:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        self.release(req)
        self.finish(req, FinishReason("abort", message="aborted"))

    def run_control(self, msg: ControlReq) -> ControlReply:
        handler = getattr(self, f"handle_{msg.op}", None)
        if handler is None:
            return ControlReply(msg.cid, False, error=f"unknown control call {msg.op!r}", error_type="ValueError")
        try:
            reply = ControlReply(msg.cid, True, result=handler(**msg.kwargs))
        except (ValueError, TypeError) as e:
            reply = ControlReply(msg.cid, False, error=str(e), error_type="ValueError")
        except Exception as e:  # noqa: BLE001 - reported to the caller, the engine keeps serving
            logger.exception("control call %s failed", msg.op)
            reply = ControlReply(msg.cid, False, error=f"{type(e).__name__}: {e}")
        if msg.op in WEIGHT_OPS and self.tp.size > 1:  # ranks must never disagree about their weights
            all_ok, none_ok = self.tp.all_true(reply.ok), self.tp.all_true(not reply.ok)
            if not all_ok and not none_ok:
                self.updater.mark_inconsistent(f"{msg.op} failed on some tensor-parallel ranks only")
        return reply

    def handle_get_weight_version(self) -> str:
        return self.weight_version

    def handle_get_step_stats(self, reset: bool = False) -> dict[str, Any]:
        """Forward+sample timings: decode steps grouped by batch size, prefill token counts."""
        return self.stats.snapshot(reset)

    def handle_get_load(self) -> dict[str, Any]:
        return {"running": len(self.running) + (self.chunked is not None), "waiting": len(self.waiting),
                "kv_used": self.allocator.num_slots - self.allocator.available - self.tree.evictable_size,
                "kv_total": self.allocator.num_slots, "retractions": self.stats.retractions,
                "cached_tokens": self.tree.total_size,
                # cumulative totals for the HTTP server's /metrics
                "prefill_tokens": self.stats.prefill_tokens, "gen_tokens": self.stats.gen_tokens,
                "weight_version": self.weight_version}

    # ---- one step -----------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """There is work to do now (held requests and a paused engine are not work)."""
        if self.in_flight is not None:
            return True
        if self.paused == "in_place":
            return bool(self.pending_updates)
        return bool(self.running or self.chunked or self.pending_updates or (self.waiting and self.admitting)
                    or (self.waiting and self.updater.state == "inconsistent"))

    def step(self) -> None:
        """Run due weight updates, then launch one batch (prefill first, else decode), read the results of
        the step before it, and emit outputs. A decode step stays in flight until the next call."""
        self.run_ready_updates()
        self.check_weight_state()
        launched = None
        if self.paused != "in_place":
            if (self.waiting and self.admitting) or self.chunked:
                if not self._extend_in_flight():
                    self.sync()
                launched = self.schedule_prefill()
                if launched is None and self._extend_in_flight():  # e.g. all waiting share its prompts
                    self.sync()
                    launched = self.schedule_prefill()
            if launched is None:
                if self._extend_in_flight():  # its requests join this decode step
                    self.sync()
                if self.running:
                    launched = self.schedule_decode()
        self.sync()  # the step launched before this one
        if launched is not None:
            if self.overlap:
                self.in_flight = launched
            else:
                self.process_results(launched)
        self.emit()
        self.stats.maybe_log(self)

    def _extend_in_flight(self) -> bool:
        return self.in_flight is not None and self.in_flight.inputs.mode == ForwardMode.EXTEND

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
        info = self._sampling_info(sampled, inputs.mode) if sampled else None
        for req, n in zip(reqs, inputs.extend_lens):
            req.kv_len += n
        for req in sampled:
            req.pending += 1
        want = inputs.prompt_logprobs
        prompt_lp_reqs = [(r, n) for r, n in zip(reqs, want.counts) if n] if want is not None else []
        start = time.perf_counter()
        return LaunchedStep(inputs, sampled, self.runner.run_step(inputs, index, info), start, prompt_lp_reqs)

    def _sampling_info(self, sampled: list[Req], mode: ForwardMode) -> SamplingBatchInfo:
        """Sampling tensors for ``sampled`` (before their ``pending`` counts move). A decode step over the
        same requests as the previous decode step reuses that step's, one position later."""
        if mode != ForwardMode.DECODE:
            return self.runner.sampling_info([self._sampling_row(r) for r in sampled])
        key = tuple(r.rid for r in sampled)
        if self._decode_info is not None and self._decode_info[0] == key:
            info = self._decode_info[1].advanced()
        else:
            info = self.runner.sampling_info([self._sampling_row(r) for r in sampled])
        self._decode_info = (key, info) if info.reusable else None
        return info

    # ---- prefill ------------------------------------------------------------------------------

    def schedule_prefill(self) -> LaunchedStep | None:
        budget = self.config.max_prefill_tokens
        reqs: list[Req] = []
        lens: list[int] = []
        in_flight = self._in_flight_prefilled()
        running = len(self.running) + len(in_flight)
        if self.chunked is not None:
            n = self._admit_chunk(self.chunked, budget, headroom=running)
            if n == 0:
                return None
            reqs.append(self.chunked), lens.append(n)
            budget -= n
            if self.chunked.kv_len + n < self.chunked.seq_len:
                return self._launch_extend(reqs, lens)
            self.chunked = None  # its last chunk: it is running once this step is read
        in_batch = RadixCache(lambda slots: None)  # prompts being computed: requests sharing them wait
        for req in in_flight:
            in_batch.insert(req.fill_ids, torch.zeros(len(req.fill_ids), dtype=torch.int64))
        deferred: list[Req] = []
        while self.waiting and budget > 0 and self.admitting:
            if running + len(reqs) >= self.config.max_running_requests or not self.req_pool.available:
                break
            req = self.waiting.popleft()
            if req.seq_len + 1 > self.allocator.num_slots:
                self.finish(req, FinishReason("abort", message="sequence does not fit in the KV cache"))
                continue
            n = self._admit_new(req, budget, running + len(reqs), in_batch, split_ok=not reqs)
            if n is None:
                deferred.append(req)
                continue
            if n == 0:
                self.waiting.appendleft(req)
                break
            reqs.append(req), lens.append(n)
            budget -= n
            if req.kv_len + n < req.seq_len:
                self.chunked = req
                break
        self.waiting.extendleft(reversed(deferred))
        if not reqs:
            return None
        return self._launch_extend(reqs, lens)

    def _admit_new(self, req: Req, budget: int, headroom: int, in_batch: RadixCache,
                   split_ok: bool = True) -> int | None:
        """Place a waiting request's cached prefix and first chunk; 0 = no room now, None = defer.

        Without ``split_ok`` (the batch already holds requests) a prompt that would fit a batch of its own
        is not split to fill the rest of this one: it waits for the next batch whole (0). A whole prompt
        needs no cached prefix in its step, so with a float8 KV pool it attends over its fresh K/V, and no
        chunk continuation puts the next batch on the prefix path. Prompts longer than a batch are chunked."""
        fill = req.fill_ids
        key = fill[:req.prefix_match_len()]
        prefix, node = self.tree.match_prefix(key)
        shared, _ = in_batch.match_prefix(key)
        extra = len(shared) - len(prefix)
        if extra > 0 and extra >= min(self.config.in_batch_prefix_threshold, len(fill) - 1 - len(prefix)):
            return None  # computed by a request already in this batch: wait and reuse its cache entry
        rest = len(fill) - len(prefix)
        whole_batch = min(self.config.max_prefill_tokens, self.config.chunked_prefill_size)
        if not split_ok and budget < rest <= whole_batch:
            return 0
        self.tree.inc_lock_ref(node)
        chunk = min(len(fill) - len(prefix), budget, self.config.chunked_prefill_size)
        if not self._ensure_slots(self.allocator.slots_needed(chunk, len(prefix)) + self._headroom(headroom)):
            self.tree.dec_lock_ref(node)
            return 0
        in_batch.insert(fill, torch.zeros(len(fill), dtype=torch.int64))
        req.pool_row = self.req_pool.alloc()
        self.req_pool.write(req.pool_row, 0, prefix)
        req.kv_len = req.prefix_len = len(prefix)
        req.last_node, req.tree = node, self.tree
        if not req.cached_tokens_known:
            req.cached_tokens, req.cached_tokens_known = len(prefix), True
        self._place_chunk(req, chunk)
        return chunk

    def _admit_chunk(self, req: Req, budget: int, headroom: int) -> int:
        chunk = min(req.seq_len - req.kv_len, budget, self.config.chunked_prefill_size)
        if not self._ensure_slots(self.allocator.slots_needed(chunk, req.kv_len) + self._headroom(headroom)):
            return 0
        self._place_chunk(req, chunk)
        return chunk

    def _place_chunk(self, req: Req, n: int) -> None:
        """Take ``n`` slots (already ensured free) for the request's next ``n`` tokens."""
        last = int(self.req_pool.last_slots([req.pool_row], [req.kv_len])[0])
        self.req_pool.write(req.pool_row, req.kv_len, self.allocator.alloc(n, req.kv_len, last))

    def _headroom(self, requests: int) -> int:
        """Slots kept free for the next decode token of ``requests`` running requests (a page each)."""
        return requests * self.config.page_size

    def _launch_extend(self, reqs: list[Req], lens: list[int]) -> LaunchedStep:
        """Launch the chunks; a request whose prompt (and earlier output) is now complete gets a token."""
        ids, pos, slots = [], [], []
        for req, n in zip(reqs, lens):
            ids.extend(req.fill_ids[req.kv_len:req.kv_len + n])
            pos.extend(range(req.kv_len, req.kv_len + n))
            slots.append(self.req_pool.slots(req.pool_row, req.kv_len + n)[req.kv_len:])
        inputs = StepInput(ForwardMode.EXTEND, [r.pool_row for r in reqs], ids, pos, torch.cat(slots),
                           [r.kv_len + n for r, n in zip(reqs, lens)], lens, self._prompt_logprobs_request(reqs, lens))
        sampled = [r for r, n in zip(reqs, lens) if r.kv_len + n == r.seq_len]
        return self.launch(reqs, inputs, sampled)

    @staticmethod
    def _prompt_logprobs_request(reqs: list[Req], lens: list[int]) -> PromptLogprobsRequest | None:
        """The prompt logprobs an extend step over ``reqs`` (``lens`` new tokens each) computes: rows of the
        step's flattened tokens whose logits give a prompt token's logprob (None when there are none)."""
        indices, targets, counts, k, offset = [], [], [], 0, 0
        for req, n in zip(reqs, lens):
            positions = req.prompt_logprob_positions(req.kv_len, n)
            indices.extend(offset + p - req.kv_len for p in positions)
            targets.extend(req.prompt_ids[p + 1] for p in positions)
            counts.append(len(positions))
            if positions:
                k = max(k, req.prompt_lp_k)
            offset += n
        return PromptLogprobsRequest(indices, targets, k, counts) if indices else None

    # ---- decode -------------------------------------------------------------------------------

    def schedule_decode(self) -> LaunchedStep | None:
        """Launch one decode step over the running requests (after the step in flight, if any)."""
        reqs = self._decode_candidates()
        if self.in_flight is not None and (not self._ensure_slots(self._decode_slots(reqs)) or self._needs_history(reqs)):
            self.sync()
            reqs = self._decode_candidates()
        while not self._ensure_slots(self._decode_slots(reqs)):  # nothing is in flight here
            victim = self.running.pop()
            if not self.running:
                self.release(victim)
                self.finish(victim, FinishReason("abort", message="sequence does not fit in the KV cache"))
                return None
            self.retract(victim)
            reqs = self._decode_candidates()
        if not reqs:
            return None
        rows, positions = [r.pool_row for r in reqs], [r.kv_len for r in reqs]
        slots = self.allocator.alloc_decode(positions, self.req_pool.last_slots(rows, positions))
        self.req_pool.write_many(rows, positions, slots, device=False)  # the runner writes the device table
        inputs = StepInput(ForwardMode.DECODE, rows, None, positions, slots, [p + 1 for p in positions],
                           [1] * len(reqs))
        return self.launch(reqs, inputs, reqs)

    def _decode_slots(self, reqs: list[Req]) -> int:
        """Free-page slots a decode step over ``reqs`` takes (one token each)."""
        if self.config.page_size == 1:
            return len(reqs)
        return sum(self.allocator.slots_needed(1, r.kv_len) for r in reqs)

    def _decode_candidates(self) -> list[Req]:
        """Running requests, less those that the step in flight ends by length (known without its tokens)."""
        return [r for r in self.running if not r.ends_by_length()]

    @staticmethod
    def _needs_history(reqs: list[Req]) -> bool:
        """Some request's sampling reads its generated tokens (penalties): they must be on the host."""
        return any(r.pending and r.needs_history for r in reqs)

    def retract(self, req: Req) -> None:
        """Give a running request's KV back and requeue it at the front; it resumes by re-prefilling."""
        self.release(req)
        self.waiting.appendleft(req)
        self.stats.retractions += 1

    # ---- results ------------------------------------------------------------------------------

    def process_results(self, step: LaunchedStep) -> None:
        """Wait for a launched step's tokens and apply them: append, check stops, finish, cache prefixes."""
        out = step.output.wait() if step.output is not None else None
        now = time.perf_counter()
        self.stats.record(step.inputs, now - max(step.launched_at, self._last_done))
        self._last_done = now
        if out is None:
            return
        if out.prompt_logprobs is not None:
            self._add_prompt_logprobs(step.prompt_lp_reqs, out)
        if out.next_token_ids is None:
            return
        ids, lps, ranks = out.next_token_ids.tolist(), out.logprobs.tolist(), out.ranks.tolist()
        top_ids = out.top_logprob_ids.tolist() if out.top_logprob_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        extend = step.inputs.mode == ForwardMode.EXTEND
        for j, req in enumerate(step.sampled):
            req.pending -= 1
            if req.finished is not None:  # ended (or aborted) while this step was in flight: drop the token
                continue
            if extend:
                if self.chunked is req:
                    self.chunked = None
                self.cache_prefix(req)
                if req.max_output == 0:  # prefilled for its prompt logprobs only: no token
                    self.release(req)
                    self.finish(req, FinishReason("length"))
                    continue
                self.running.append(req)
            k = req.sampling.logprobs or 0
            top = list(zip(top_ids[j][:k], top_lps[j][:k])) if k and top_ids is not None else None
            req.append_token(ids[j], lps[j], top, ranks[j])
            req.check_finished(self.tokenizer if req.sampling.stop else None)
            self.stats.gen_tokens += 1
            if req.finished is not None:
                self.running.remove(req)
                self.release(req)
                self.finish(req, req.finished)

    @staticmethod
    def _add_prompt_logprobs(lp_reqs: list[tuple[Req, int]], out: StepOutput) -> None:
        """Hand each request its rows of a step's prompt logprobs (in ``lp_reqs`` order)."""
        plp = out.prompt_logprobs
        lps, ranks = plp.token_logprobs.tolist(), plp.ranks.tolist()
        top_ids = plp.top_ids.tolist() if plp.top_ids is not None else None
        top_lps = plp.top_logprobs.tolist() if plp.top_logprobs is not None else None
        row = 0
        for req, count in lp_reqs:
            rows = slice(row, row + count)
            row += count
            if req.finished is not None:
                continue
            k = req.prompt_lp_k
            top = [list(zip(i[:k], v[:k])) for i, v in zip(top_ids[rows], top_lps[rows])] if k and top_ids else None
            req.add_prompt_logprobs(lps[rows], ranks[rows], top)

    def _sampling_row(self, req: Req) -> SamplingRow:
        return SamplingRow(params=req.sampling, seed=req.seed, output_len=len(req.output_ids) + req.pending,
                           prompt_token_ids=req.prompt_ids, output_token_ids=req.output_ids,
                           eos_token_ids=list(self.model_cfg.eos_token_ids))

    # ---- KV bookkeeping -----------------------------------------------------------------------

    def _ensure_slots(self, n: int) -> bool:
        short = n - self.allocator.available
        if short > 0:
            self.tree.evict(short)
        return self.allocator.available >= n

    def cache_prefix(self, req: Req) -> None:
        """Hand a freshly prefilled request's KV to the radix tree so later requests can share it (its whole
        pages: a last, partly filled page stays the request's own)."""
        if self.tree.disabled or req.tree is not self.tree:
            return
        tokens = req.fill_ids[:req.kv_len]
        slots = self.req_pool.slots(req.pool_row, req.kv_len)
        already = self.tree.insert(tokens, slots)
        self.allocator.free(slots[req.prefix_len:already])
        shared, node = self.tree.match_prefix(tokens)
        self.req_pool.write(req.pool_row, req.prefix_len, shared[req.prefix_len:already])
        self.tree.inc_lock_ref(node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node, req.prefix_len = node, len(shared)

    def release(self, req: Req) -> None:
        """Return a request's KV: computed tokens go to the radix tree (or are freed), its row is freed."""
        if req.pool_row is None:
            return
        slots = self.req_pool.slots(req.pool_row, req.kv_len)
        if self.tree.disabled:
            self.allocator.free(slots)
        elif req.tree is not self.tree:  # KV from older weights: never share it, free it
            self.allocator.free(slots[req.prefix_len:])
            req.tree.dec_lock_ref(req.last_node)
            req.tree.evict(req.tree.evictable_size)
            if req.tree.total_size == 0:
                self.stale_trees.remove(req.tree)
        else:
            already = self.tree.insert(req.fill_ids[:req.kv_len], slots)
            self.allocator.free(slots[req.prefix_len:already])
            self.allocator.free(slots[req.kv_len - req.kv_len % self.config.page_size:])  # a last partial page
            self.tree.dec_lock_ref(req.last_node)
        self.req_pool.free(req.pool_row)
        req.pool_row, req.kv_len, req.prefix_len, req.last_node, req.tree = None, 0, 0, None, None

    # ---- outputs ------------------------------------------------------------------------------

    def finish(self, req: Req, reason: FinishReason) -> None:
        req.finished = reason
        self.reqs.pop(req.rid, None)
        self._pending.append(req)

    def emit(self) -> None:
        """Send new tokens of streaming requests and every finished request to the detokenizer."""
        outs = [self._token_out(r) for r in self._pending]
        self._pending.clear()
        outs += [self._token_out(r) for r in self.running if r.stream and len(r.output_ids) > r.sent]
        if outs and self.send_output is not None and self.tp.rank == 0:
            self.send_output(BatchTokenOut(outs))

    def _token_out(self, req: Req) -> TokenOut:
        start, end = req.sent, len(req.output_ids)
        p = req.sampling
        spec = None
        if start == 0:
            spec = DecodeSpec(p.skip_special_tokens, p.spaces_between_special_tokens, p.stop,
                              p.include_stop_str_in_output, req.prompt_ids[-6:])
        req.sent = end
        prompt_lps = None
        if start == 0 and req.prompt_lp_k is not None:
            prompt_lps = PromptLogprobsOut(req.prompt_lp_first, req.prompt_lps, req.prompt_lp_ranks,
                                           req.prompt_lp_top if req.prompt_lp_k else None)
        return TokenOut(
            rid=req.rid, token_ids=req.output_ids[start:end],
            logprobs=req.logprobs[start:end] if req.wants_logprobs else None,
            top_logprobs=req.top_logprobs[start:end] if p.logprobs else None,
            ranks=req.ranks[start:end] if req.wants_logprobs else None,
            finished=req.finished, prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached_tokens,
            completion_tokens=end, weight_version=self.weight_version, spec=spec, prompt_logprobs=prompt_lps)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer.get()


class _BackgroundTokenizer:
    """The tokenizer, loaded on a background thread from start-up (a first stop-string request would
    otherwise stall every running request for the seconds a load takes)."""

    def __init__(self, config: EngineConfig) -> None:
        import threading

        self._path = config.tokenizer_path or config.model_path
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = None
        if not config.skip_tokenizer_init:
            self._thread = threading.Thread(target=self._load, name="tokenizer-load", daemon=True)
            self._thread.start()

    def _load(self) -> None:
        try:
            from transformers import AutoTokenizer

            self._value = AutoTokenizer.from_pretrained(self._path)
        except BaseException as e:  # noqa: BLE001 - reported when the tokenizer is first needed
            self._error = e

    def get(self) -> Any:
        if self._thread is not None:
            self._thread.join()
        elif self._value is None and self._error is None:
            self._load()
        if self._error is not None:
            raise RuntimeError(f"could not load the tokenizer from {self._path!r}: {self._error}")
        return self._value


class SchedulerStats:
    """Counters behind the periodic log line."""

    def __init__(self) -> None:
        self.prefill_tokens = 0
        self.gen_tokens = 0
        self.retractions = 0
        self.decode_steps: dict[int, list[float]] = {}  # batch size → [count, total seconds, total kv tokens]
        self.prefill_steps = [0, 0.0, 0]                # count, seconds, tokens
        self._last_log = time.monotonic()
        self._last_prefill = 0
        self._last_gen = 0

    def record(self, step: StepInput, seconds: float) -> None:
        if step.mode == ForwardMode.EXTEND:
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

    def snapshot(self, reset: bool) -> dict[str, Any]:
        out = {"decode": {b: {"steps": c, "seconds": t, "kv_tokens": k} for b, (c, t, k) in self.decode_steps.items()},
               "prefill": {"steps": self.prefill_steps[0], "seconds": self.prefill_steps[1],
                           "tokens": self.prefill_steps[2]},
               "gen_tokens": self.gen_tokens, "prefill_tokens": self.prefill_tokens,
               "retractions": self.retractions}
        if reset:
            self.decode_steps = {}
            self.prefill_steps = [0, 0.0, 0]
        return out

    def maybe_log(self, s: Scheduler) -> None:
        now = time.monotonic()
        dt = now - self._last_log
        if dt < s.config.log_interval_s or s.tp.rank != 0 or not s.busy:
            return
        load = s.handle_get_load()
        logger.info("running %d, queued %d, KV %d/%d (%.1f%%), prefill %.1f tok/s, gen %.1f tok/s, "
                    "retracted %d, weight version %s", load["running"], load["waiting"], load["kv_used"],
                    load["kv_total"], 100.0 * load["kv_used"] / load["kv_total"],
                    (self.prefill_tokens - self._last_prefill) / dt, (self.gen_tokens - self._last_gen) / dt,
                    self.retractions, s.weight_version)
        self._last_log, self._last_prefill, self._last_gen = now, self.prefill_tokens, self.gen_tokens
