"""Finishing requests and sending their tokens to the detokenizer (rank 0 only), and the tokenizer that
stop-string checks need."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from rollout.config import EngineConfig
from rollout.detokenize_state import SEED_LOOKBACK_TOKENS
from rollout.io_struct import BatchTokenOut, DecodeSpec, FinishReason, PromptLogprobsOut, TokenOut
from rollout.scheduler.req import Req


class OutputManager:
    """The scheduler's live requests by id, and their outputs: one ``BatchTokenOut`` per ``emit``.

    ``send`` is rank 0's socket send (None on other ranks: they compute the same things but send nothing)."""

    def __init__(self, send: Callable[[BatchTokenOut], None] | None) -> None:
        self.send = send
        self.live: dict[str, Req] = {}  # added and not finished yet
        self.finished: list[Req] = []   # finished since the last emit
        self.retracted: list[Req] = []  # left the running requests since the last emit (their tokens may be unsent)

    def add(self, req: Req) -> None:
        self.live[req.rid] = req

    def finish(self, req: Req, reason: FinishReason) -> None:
        req.finished = reason
        self.live.pop(req.rid, None)
        self.finished.append(req)

    def retract(self, req: Req) -> None:
        """``req`` leaves the running requests unfinished (retracted): a stream gets the tokens it already has at
        the next ``emit``, not once the request runs again (after a pause, or when the KV pool has room)."""
        self.retracted.append(req)

    def emit(self, running: Iterable[Req], weight_version: str) -> None:
        """Send every finished request, and the new tokens of streaming running (or just retracted) requests."""
        outs = [self.token_out(r, weight_version) for r in self.finished]
        self.finished.clear()
        for reqs in (running, self.retracted):  # one that ran again since it was retracted is sent once
            outs += [self.token_out(r, weight_version) for r in reqs
                     if r.stream and r.finished is None and len(r.output_ids) > r.sent]
        self.retracted.clear()
        if outs and self.send is not None:
            self.send(BatchTokenOut(outs))

    @staticmethod
    def token_out(req: Req, weight_version: str) -> TokenOut:
        """The request's tokens since its last message (its first carries the decode spec and prompt logprobs).
        Its ``weight_version`` is the version that sampled its last token (``weight_version``, the served one, when
        it has none): a request whose last step was read just before an in-flight update does not report the
        update's version."""
        start, end = req.sent, len(req.output_ids)
        p = req.sampling
        spec = prompt_lps = None
        if start == 0:
            spec = DecodeSpec(p.skip_special_tokens, p.spaces_between_special_tokens, p.stop,
                              p.include_stop_str_in_output, req.prompt_ids[-SEED_LOOKBACK_TOKENS:], p.min_new_tokens,
                              p.detokenize)
            if req.prompt_lp_k is not None:
                prompt_lps = PromptLogprobsOut(req.prompt_lp_first, req.prompt_lps, req.prompt_lp_ranks,
                                               req.prompt_lp_top if req.prompt_lp_k else None)
        req.sent = end
        if end:  # the weights that sampled its last token (an update may have landed since, in flight)
            weight_version = req.token_versions[end - 1] or weight_version
        return TokenOut(
            rid=req.rid, token_ids=req.output_ids[start:end],
            logprobs=req.logprobs[start:end] if req.wants_logprobs else None,
            top_logprobs=req.top_logprobs[start:end] if p.logprobs else None,
            ranks=req.ranks[start:end] if req.wants_logprobs else None,
            token_weight_versions=req.token_versions[start:end],
            finished=req.finished, prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached_tokens,
            completion_tokens=end, weight_version=weight_version, spec=spec, prompt_logprobs=prompt_lps,
            routed_experts=req.routed_experts if req.finished is not None else None)


class BackgroundTokenizer:
    """The tokenizer, loaded on a background thread from start-up (a first stop-string request would
    otherwise stall every running request for the seconds a load takes)."""

    def __init__(self, config: EngineConfig) -> None:
        import importlib
        import threading

        self._path = config.tokenizer_path or config.model_path
        self._value: Any = None
        self._error: BaseException | None = None
        self._skipped: frozenset[int] | None = None
        self._thread = None
        if not config.skip_tokenizer_init:
            # transformers' first import is not thread-safe (another thread's ``from transformers import X``
            # meanwhile fails ~1 time in 3 with an ImportError); once imported, concurrent imports are fine
            importlib.import_module("transformers")

            self._thread = threading.Thread(target=self._load, name="tokenizer-load", daemon=True)
            self._thread.start()

    def _load(self) -> None:
        try:
            from transformers import AutoTokenizer

            self._value = AutoTokenizer.from_pretrained(self._path)
        except BaseException as e:  # noqa: BLE001 - reported when the tokenizer is first needed
            self._error = e

    def skipped_ids(self) -> frozenset[int]:
        """``skipped_special_ids`` of the tokenizer, found once (stop-string matching asks on every token)."""
        if self._skipped is None:
            from rollout.detokenize_state import skipped_special_ids

            self._skipped = skipped_special_ids(self.get())
        return self._skipped

    def get(self) -> Any:
        if self._thread is not None:
            self._thread.join()
        elif self._value is None and self._error is None:
            self._load()
        if self._error is not None:
            raise RuntimeError(f"could not load the tokenizer from {self._path!r}: {self._error}")
        return self._value
