"""Prefill admission and chunking: which waiting requests start, with how many tokens, in one extend step.

Policy (``PrefillManager.schedule``):
1. A request whose prompt is partly computed (``chunked``) continues first.
2. Then waiting requests in order, while the step's token budget (``max_prefill_tokens``), the running
   limit and free KV allow: each reuses its longest cached prefix and computes the rest, in chunks of at
   most ``chunked_prefill_size``; one chunked request at a time ends the batch. Free KV means room for the
   chunk while the slots the running requests are expected to need (``NewTokenRatio.reserved``) and the
   output budgets of the requests admitted in this step stay free (SGLang's ``PrefillAdder``); a request
   admitted while nothing else runs needs room for its chunk only.
3. A request whose prompt a request in this batch (or the prefill in flight) is computing waits for that
   cache entry instead of computing it twice, when the entry would give it whole pages (the cache shares
   only those; without the cache there is no entry to wait for, and such requests join the batch); a
   prompt that fits a batch of its own is not split to fill the rest of this one.
"""

from __future__ import annotations

from collections import deque

import torch

from rollout.config import EngineConfig
from rollout.io_struct import FinishReason
from rollout.mem_cache.radix_cache import common_len
from rollout.model_executor.forward_batch import ForwardMode
from rollout.model_executor.model_runner import PromptLogprobsRequest, StepInput
from rollout.scheduler.admission import NewTokenRatio
from rollout.scheduler.cache import KVCacheManager
from rollout.scheduler.output import OutputManager
from rollout.scheduler.req import Req


class PrefillManager:
    def __init__(self, config: EngineConfig, cache: KVCacheManager, outputs: OutputManager,
                 ratio: NewTokenRatio) -> None:
        self.config = config
        self.cache = cache
        self.outputs = outputs
        self.ratio = ratio
        self.chunked: Req | None = None  # the request whose prompt is partly computed

    def schedule(self, waiting: deque[Req], running: list[Req], in_flight: list[Req], admitting: bool,
                 reserve: int = 0) -> tuple[list[Req], list[int]]:
        """The requests of the next extend step and how many new tokens each computes (empty: none now).

        ``running``: the requests already running (``in_flight``, those of the prefill in flight, included);
        admitted requests leave ``waiting`` and get their KV placed. Without ``admitting`` (an update
        pending, generation paused) only the chunked request continues. ``reserve`` tokens of the step's
        budget go to running requests decoding in it (a mixed step; at least a quarter is kept)."""
        budget = max(self.config.max_prefill_tokens - reserve, self.config.max_prefill_tokens // 4)
        kept = self.ratio.reserved(running)  # slots kept free for the running requests' next tokens
        reqs: list[Req] = []
        lens: list[int] = []
        if self.chunked is not None:
            n = self._admit_chunk(self.chunked, budget, kept)
            if n == 0:
                return [], []
            reqs.append(self.chunked), lens.append(n)
            budget -= n
            if self.chunked.kv_len + n < self.chunked.seq_len:
                return reqs, lens
            kept += self.ratio.future_tokens(self.chunked)
            self.chunked = None  # its last chunk: it is running once this step is read
        in_batch = PromptsInBatch()  # prompts being computed (a chunked one's last chunk too): sharers wait
        for req in in_flight + reqs:
            in_batch.add(req.fill_ids)
        deferred: list[Req] = []
        while admitting and waiting and budget > 0:
            if len(running) + len(reqs) >= self.config.max_running_requests or not self.cache.req_pool.available:
                break
            req = waiting.popleft()
            if req.seq_len + 1 > self.cache.num_slots:
                self.outputs.finish(req, FinishReason("abort", message="sequence does not fit in the KV cache"))
                continue
            future = self.ratio.admission_tokens(req)
            alone = not running and not reqs
            n = self._admit_new(req, budget, 0 if alone else kept + future, in_batch, split_ok=not reqs)
            if n is None:
                deferred.append(req)
                continue
            if n == 0:
                waiting.appendleft(req)
                break
            reqs.append(req), lens.append(n)
            budget -= n
            kept += future
            if req.kv_len + n < req.seq_len:
                self.chunked = req
                break
        waiting.extendleft(reversed(deferred))
        return reqs, lens

    def _admit_new(self, req: Req, budget: int, kept: int, in_batch: "PromptsInBatch",
                   split_ok: bool = True) -> int | None:
        """Place a waiting request's cached prefix and first chunk, if ``kept`` more slots stay free beside
        it; 0 = no room now, None = defer (a prompt the batch computes, to be reused from the prefix cache).

        Without ``split_ok`` (the batch already holds requests) a prompt that would fit a batch of its own
        is not split to fill the rest of this one: it waits for the next batch whole (0). A whole prompt
        needs no cached prefix in its step, so with a float8 KV pool it attends over its fresh K/V, and no
        chunk continuation puts the next batch on the prefix path. Prompts longer than a batch are chunked."""
        fill = req.fill_ids
        key = fill[:req.prefix_match_len()]
        prefix, node = self.cache.match(key)
        if self._reusable_after_wait(in_batch.shared_len(key), len(fill) - 1, len(prefix)):
            return None  # computed by a request already in this batch: wait and reuse its cache entry
        rest = len(fill) - len(prefix)
        whole_batch = min(self.config.max_prefill_tokens, self.config.chunked_prefill_size)
        if not split_ok and budget < rest <= whole_batch:
            return 0
        self.cache.lock(node)
        chunk = min(rest, budget, self.config.chunked_prefill_size)
        if not self._make_room(self.cache.slots_needed(chunk, len(prefix)), kept):
            self.cache.unlock(node)
            return 0
        in_batch.add(fill)
        self.cache.place(req, prefix, node)
        if not req.cached_tokens_known:
            req.cached_tokens, req.cached_tokens_known = len(prefix), True
        self.cache.extend(req, chunk)
        return chunk

    def _reusable_after_wait(self, shared: int, most: int, cached: int) -> bool:
        """Whether a request should wait for the cache entry of ``shared`` tokens that a request in the batch
        computes: the entry (whole pages only, and none without the prefix cache) would give it at least
        ``in_batch_prefix_threshold`` tokens past the ``cached`` it has, or every token it could reuse (whole
        pages of its first ``most``)."""
        if self.cache.disabled:
            return False
        page = self.cache.page_size
        extra = shared - shared % page - cached
        return extra > 0 and extra >= min(self.config.in_batch_prefix_threshold, most - most % page - cached)

    def _admit_chunk(self, req: Req, budget: int, kept: int) -> int:
        chunk = min(req.seq_len - req.kv_len, budget, self.config.chunked_prefill_size)
        if not self._make_room(self.cache.slots_needed(chunk, req.kv_len), kept):
            return 0
        self.cache.extend(req, chunk)
        return chunk

    def _make_room(self, need: int, kept: int) -> bool:
        """Free ``need`` slots now (evicting cache entries) if ``kept`` more can stay free beside them."""
        return self.cache.can_hold(need + kept) and self.cache.ensure_free(need)

    def build_step(self, reqs: list[Req], lens: list[int]) -> tuple[StepInput, list[Req]]:
        """The extend step computing ``lens`` new tokens of each of ``reqs`` (their slots already placed), and
        the requests it samples a token for: those whose prompt (and earlier output) it completes. Running
        requests decoding in a mixed step are rows of one token (their last) that complete theirs."""
        ids, pos, slots = [], [], []
        for req, n in zip(reqs, lens):
            ids.extend(req.tokens(req.kv_len, req.kv_len + n))
            pos.extend(range(req.kv_len, req.kv_len + n))
            slots.append(self.cache.req_pool.slots(req.pool_row, req.kv_len + n)[req.kv_len:])
        inputs = StepInput(ForwardMode.EXTEND, [r.pool_row for r in reqs], ids, pos, torch.cat(slots),
                           [r.kv_len + n for r, n in zip(reqs, lens)], lens, _prompt_logprobs_request(reqs, lens))
        sampled = [r for r, n in zip(reqs, lens) if r.kv_len + n == r.seq_len]
        return inputs, sampled

    def drop(self, req: Req) -> None:
        """``req`` leaves (aborted or retracted): it is no longer the chunked request."""
        if self.chunked is req:
            self.chunked = None


class PromptsInBatch:
    """The prompts an extend step being built (and the one in flight) computes, by first token:
    ``shared_len(tokens)`` is the longest prefix of ``tokens`` that one of them starts with (what a radix tree
    of them would match, without building one per step)."""

    def __init__(self) -> None:
        self._by_first: dict[int, list[list[int]]] = {}

    def add(self, tokens: list[int]) -> None:
        if tokens:
            self._by_first.setdefault(tokens[0], []).append(tokens)

    def shared_len(self, tokens: list[int]) -> int:
        if not tokens:
            return 0
        return max((common_len(t, tokens) for t in self._by_first.get(tokens[0], ())), default=0)


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
