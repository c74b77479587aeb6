"""The sampling tensors of a step's requests (``SamplingBatchInfo``), built on the device once and, for a
decode step over the same requests as the decode step before it, reused one position later."""

from __future__ import annotations

from rollout.layers.sampling_info import SamplingBatchInfo, SamplingRow
from rollout.model_executor.forward_batch import ForwardMode
from rollout.model_executor.model_runner import ModelRunner
from rollout.scheduler.req import Req


class SamplingInfoCache:
    def __init__(self, runner: ModelRunner, eos_token_ids: tuple[int, ...]) -> None:
        self.runner = runner
        self.eos_token_ids = list(eos_token_ids)
        # (request ids, sampling tensors) of the last decode step, reused by the next one over the same requests
        self._last_decode: tuple[tuple[str, ...], SamplingBatchInfo] | None = None

    def get(self, sampled: list[Req], mode: ForwardMode) -> SamplingBatchInfo:
        """Sampling tensors for ``sampled`` (before their in-flight token counts move)."""
        if mode != ForwardMode.DECODE:
            return self._build(sampled)
        key = tuple(r.rid for r in sampled)
        if self._last_decode is not None and self._last_decode[0] == key:
            info = self._last_decode[1].advanced()
        else:
            info = self._build(sampled)
        self._last_decode = (key, info) if info.reusable else None
        return info

    def _build(self, reqs: list[Req]) -> SamplingBatchInfo:
        return self.runner.sampling_info([
            SamplingRow(params=r.sampling, seed=r.seed, output_len=len(r.output_ids) + r.inflight_tokens,
                        prompt_token_ids=r.prompt_ids, output_token_ids=r.output_ids, eos_token_ids=self.eos_token_ids)
            for r in reqs])
