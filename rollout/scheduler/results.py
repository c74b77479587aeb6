"""Applying a launched step's results, once they reach the host: append each sampled token, check stops,
finish requests, hand freshly prefilled prompts to the prefix cache, deliver prompt logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout.io_struct import FinishReason
from rollout.model_executor.forward_batch import ForwardMode
from rollout.model_executor.model_runner import StepInput, StepOutput
from rollout.scheduler.cache import KVCacheManager
from rollout.scheduler.output import BackgroundTokenizer, OutputManager
from rollout.scheduler.prefill import PrefillManager
from rollout.scheduler.req import Req
from rollout.scheduler.stats import SchedulerStats


@dataclass
class LaunchedStep:
    """A step whose forward and sampling were queued on the device; its results are read later."""

    inputs: StepInput
    sampled: list[Req]          # the requests that get a token from this step
    output: StepOutput | None
    launched_at: float
    prompt_lp_reqs: list[tuple[Req, int]] = field(default_factory=list)  # (request, rows) of prompt logprobs
    weight_version: str = ""    # the version of the weights this step's forward reads


class ResultProcessor:
    """``apply`` moves requests between states: a prefilled request joins ``running`` (the scheduler's list),
    a finished one leaves it and releases its KV."""

    def __init__(self, running: list[Req], cache: KVCacheManager, prefill: PrefillManager, outputs: OutputManager,
                 stats: SchedulerStats, tokenizer: BackgroundTokenizer) -> None:
        self.running = running
        self.cache = cache
        self.prefill = prefill
        self.outputs = outputs
        self.stats = stats
        self.tokenizer = tokenizer

    def apply(self, step: LaunchedStep, out: StepOutput | None) -> None:
        if out is not None and out.prompt_logprobs is not None:
            _add_prompt_logprobs(step.prompt_lp_reqs, out)
        if out is None or out.next_token_ids is None:
            return
        ids, lps, ranks = out.next_token_ids.tolist(), out.logprobs.tolist(), out.ranks.tolist()
        top_ids = out.top_logprob_ids.tolist() if out.top_logprob_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        extend = step.inputs.mode == ForwardMode.EXTEND
        decoding = {id(r) for r in self.running} if extend else set()  # running rows of a mixed step
        for j, req in enumerate(step.sampled):
            req.inflight_tokens -= 1
            if req.finished is not None:  # ended (or aborted) while this step was in flight: drop the token
                continue
            if extend and id(req) not in decoding and not self._prefill_done(req):
                continue
            k = req.sampling.logprobs or 0
            top = list(zip(top_ids[j][:k], top_lps[j][:k])) if k and top_ids is not None else None
            req.append_token(ids[j], lps[j], top, ranks[j], step.weight_version)
            if req.sampling.stop:
                req.check_finished(self.tokenizer.get(), self.tokenizer.skipped_ids())
            else:
                req.check_finished(None)
            self.stats.gen_tokens += 1
            if req.finished is not None:
                self.running.remove(req)
                self._finish(req, req.finished)

    def _prefill_done(self, req: Req) -> bool:
        """A request's prefill was read: cache its prompt and let it run; False when it wants no token (a
        ``max_tokens=0`` request, prefilled for its prompt logprobs: it finishes here)."""
        self.prefill.drop(req)
        self.cache.cache_prefix(req)
        if req.max_output == 0:
            self._finish(req, FinishReason("length"))
            return False
        self.running.append(req)
        return True

    def _finish(self, req: Req, reason: FinishReason) -> None:
        """A request ended by a stop or its length: read its routing (if asked), give back its KV, send it."""
        self.cache.read_routed_experts(req)
        self.cache.release(req)
        self.outputs.finish(req, reason)


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
