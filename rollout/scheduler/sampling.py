"""The sampling tensors of a step's requests (``SamplingBatchInfo``), built on the device once and, for a
decode step over the same requests as the step right before it (also a decode step), reused one position later.

Reuse holds only while each request moved exactly one position since: any other step that samples (an extend
step, mixed or a re-prefill after retraction) ends it, and the requests are compared as objects, since a
request id may be used again by a later request."""

from __future__ import annotations

from rollout.layers.sampling_info import SamplingBatchInfo, SamplingRow
from rollout.model_executor.forward_batch import ForwardMode
from rollout.model_executor.model_runner import ModelRunner
from rollout.scheduler.req import Req


class SamplingInfoCache:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        # (requests, sampling tensors) of the last step when it was a decode step, for the next one
        self._last_decode: tuple[list[Req], SamplingBatchInfo] | None = None

    def get(self, sampled: list[Req], mode: ForwardMode) -> SamplingBatchInfo:
        """Sampling tensors for ``sampled`` (before their in-flight token counts move)."""
        last, self._last_decode = self._last_decode, None
        if mode != ForwardMode.DECODE:
            return self._build(sampled)
        if last is not None and _same(last[0], sampled):
            info = last[1].advanced()
        else:
            info = self._build(sampled)
        if info.reusable:
            self._last_decode = (list(sampled), info)  # a copy: the caller's list may change in place
        return info

    def _build(self, reqs: list[Req]) -> SamplingBatchInfo:
        return self.runner.sampling_info([
            SamplingRow(params=r.sampling, seed=r.seed, output_len=len(r.output_ids) + r.inflight_tokens,
                        prompt_token_ids=r.prompt_ids, output_token_ids=r.output_ids, eos_token_ids=list(r.eos_token_ids))
            for r in reqs])


def _same(a: list[Req], b: list[Req]) -> bool:
    """The same request objects in the same order."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
