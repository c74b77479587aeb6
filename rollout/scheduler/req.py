"""A request as the scheduler sees it: tokens, KV placement, sampling state, finish checks."""

from __future__ import annotations

from typing import Any

from rollout.detokenize_state import REPLACEMENT_CHAR, SEED_LOOKBACK_TOKENS, prompt_seed_ids, skipped_special_ids
from rollout.io_struct import FinishReason, GenerateReq
from rollout.sampling_params import SamplingParams

# how many tokens the stop-string window may grow backwards to start at a whole character (a byte-fallback
# tokenizer decodes a run of <0xNN> tokens as one group, all U+FFFD until it is complete)
_MAX_WINDOW_WIDENING = 64
# how many ids without text (special tokens that skip_special_tokens drops) the stop-string window may span
_MAX_ZERO_WIDTH_IDS = 1024


def _window_start(ids: list[int], count: int, zero_width: frozenset[int]) -> int:
    """Where the last ``count`` ids of ``ids`` that add text start, the ids in ``zero_width`` among them not
    counted (at most ``_MAX_ZERO_WIDTH_IDS`` of them)."""
    lo, skipped = len(ids), 0
    while lo > 0 and count > 0:
        lo -= 1
        if ids[lo] in zero_width and skipped < _MAX_ZERO_WIDTH_IDS:
            skipped += 1
        else:
            count -= 1
    return lo


class Req:
    """One sequence being generated.

    ``fill_ids`` = prompt + output so far. ``kv_len`` tokens of it have KV in the cache (slots listed in
    row ``pool_row`` of the request table); ``prefix_len`` of those belong to the radix tree (locked
    through ``last_node``), the rest are owned by the request. ``kv_len`` counts launched steps, and
    ``inflight_tokens`` tokens have been sampled by a launched step but not yet appended (overlap scheduling).
    ``eos_token_ids``: the model's EOS ids and the request's own (``GenerateReq.eos_token_ids``, the tokenizer's).
    Any of them ends the request; only the tokenizer's is reported as EOS (``FinishReason.eos``: stop_reason
    None), the model's others as stop tokens (their id), as vLLM turns generation_config's extra EOS ids into
    stop token ids.
    """

    def __init__(self, msg: GenerateReq, eos_token_ids: tuple[int, ...], context_len: int) -> None:
        self.rid = msg.rid
        self.prompt_ids = list(msg.input_ids)
        self.sampling: SamplingParams = msg.sampling
        # the output length that ends the request: max_new_tokens, or the end of the context (also for None)
        room = context_len - len(self.prompt_ids)
        self.max_output = room if self.sampling.max_new_tokens is None else min(self.sampling.max_new_tokens, room)
        self.needs_history = self.sampling.uses_token_history
        self.seed = msg.seed
        self.stream = msg.stream
        # prompt logprobs: None (off) or top-k; they are computed for prompt positions from prompt_lp_first on
        self.prompt_lp_k = self.sampling.prompt_logprobs if msg.return_prompt_logprobs else None
        self.prompt_lp_first = self.sampling.logprob_start_len + 1
        self.prompt_lps: list[float] = []
        self.prompt_lp_ranks: list[int] = []
        self.prompt_lp_top: list[list[tuple[int, float]]] = []
        self.eos_token_ids = tuple(dict.fromkeys(tuple(eos_token_ids) + tuple(msg.eos_token_ids)))
        self.tokenizer_eos = tuple(msg.eos_token_ids)  # vLLM's primary EOS: stop_reason None; the others report their id
        self.output_ids: list[int] = []
        self.token_versions: list[str] = []  # the weight version that sampled each output token
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.ranks: list[int] = []
        self.sent = 0                      # output tokens already sent to the detokenizer
        self.pool_row: int | None = None
        self.kv_len = 0
        self.inflight_tokens = 0
        self.prefix_len = 0
        self.last_node: Any = None
        self.tree: Any = None              # the radix tree that last_node belongs to
        self.cached_tokens = 0
        self.cached_tokens_known = False
        self.finished: FinishReason | None = None
        self.routed_experts: Any = None    # read from the KV pool's routing at finish (return_routed_experts)
        self.stop_token_ids = frozenset(self.sampling.stop_token_ids)  # checked after every token: O(1)
        # tokens that a stop string can span: each token decodes to at least one byte
        self.stop_tail_len = max((len(s.encode("utf-8", "surrogatepass")) for s in self.sampling.stop), default=0)

    def tokens(self, start: int, end: int) -> list[int]:
        """``fill_ids[start:end]`` without building the whole list (a decode row needs one token of it)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(start - n, 0):end - n]

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def wants_logprobs(self) -> bool:
        return self.sampling.logprobs is not None

    @property
    def prompt_lp_next(self) -> int:
        """The first prompt position whose logprob is still missing (== len(prompt) when all are in)."""
        return self.prompt_lp_first + len(self.prompt_lps)

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.prompt_lp_k is not None and self.prompt_lp_next < len(self.prompt_ids)

    def prefix_match_len(self) -> int:
        """How much of ``fill_ids`` may come from the prefix cache: all but the last token, and no position
        whose prompt logprob must still be computed (it needs that position's logits from the token before)."""
        if self.needs_prompt_logprobs:
            return self.prompt_lp_next - 1
        return self.seq_len - 1

    def prompt_logprob_positions(self, start: int, n: int) -> range:
        """The positions among ``fill_ids[start:start + n]`` whose logits give a missing prompt logprob (of
        the token after each)."""
        if not self.needs_prompt_logprobs:
            return range(0)
        return range(max(start, self.prompt_lp_next - 1), min(start + n, len(self.prompt_ids) - 1))

    def add_prompt_logprobs(self, lps: list[float], ranks: list[int], top: list[list[tuple[int, float]]] | None) -> None:
        self.prompt_lps.extend(lps)
        self.prompt_lp_ranks.extend(ranks)
        if top is not None:
            self.prompt_lp_top.extend(top)

    def drop_prompt_logprobs(self) -> None:
        """Forget the prompt logprobs computed so far: a prefill started again (on new weights) computes them all
        again, from ``prompt_lp_first`` on."""
        self.prompt_lps, self.prompt_lp_ranks, self.prompt_lp_top = [], [], []

    def append_token(self, token: int, logprob: float | None, top: list[tuple[int, float]] | None,
                     rank: int | None, weight_version: str = "") -> None:
        self.output_ids.append(token)
        self.token_versions.append(weight_version)
        if self.wants_logprobs:
            self.logprobs.append(logprob)
            self.ranks.append(rank)
            if self.sampling.logprobs:
                self.top_logprobs.append(top or [])

    def ends_by_length(self) -> bool:
        """The tokens in flight already end this request by length, whatever their values."""
        return self.inflight_tokens > 0 and len(self.output_ids) + self.inflight_tokens >= self.max_output

    def check_finished(self, tokenizer: Any, skipped_ids: frozenset[int] | None = None) -> None:
        """Set ``finished`` if the newest token ends the request (order: stop id, stop string, length).
        ``skipped_ids``: the tokenizer's ``skipped_special_ids`` if the caller keeps them (else found here)."""
        p = self.sampling
        last = self.output_ids[-1]
        n = len(self.output_ids)
        if n >= p.min_new_tokens:
            eos = not p.ignore_eos and last in self.eos_token_ids
            if eos or last in self.stop_token_ids:
                self.finished = FinishReason("stop", matched=last, eos=eos and last in self.tokenizer_eos)
                return
            if p.stop and tokenizer is not None:
                matched = self._match_stop_string(tokenizer, skipped_ids)
                if matched is not None:
                    self.finished = FinishReason("stop", matched=matched)
                    return
        if n >= self.max_output:
            self.finished = FinishReason("length")

    def _match_stop_string(self, tokenizer: Any, skipped_ids: frozenset[int] | None) -> str | None:
        """The first stop string (in the list's order) that occurs in the decoded last tokens and ends past
        the text of the first ``min_new_tokens`` output tokens (vLLM's ``min_tokens``: none counts before)."""
        n, m = len(self.output_ids), self.sampling.min_new_tokens
        if n <= m:
            return None
        skip = self.sampling.skip_special_tokens
        # special tokens that the text leaves out take no part of the stop string: a window of its bytes + 1
        # ids missed "Yes!" in "Yes" <special> <special> <special> "!" (vLLM's text reads "Yes!")
        zero_width = frozenset() if not skip else skipped_ids if skipped_ids is not None else \
            skipped_special_ids(tokenizer)
        lo = _window_start(self.output_ids, self.stop_tail_len + 1, zero_width)
        tail = self._decode_output(tokenizer, lo, n, skip)
        floor = max(lo - _MAX_WINDOW_WIDENING, 0)
        while tail.startswith(REPLACEMENT_CHAR) and lo > floor:  # it starts inside a character or inside a
            lo = max(floor, lo - (n - lo))                       # byte-fallback group: double it
            tail = self._decode_output(tokenizer, lo, n, skip)
        start = 0
        if m > lo:  # text of the first m output tokens in the window: no stop string may end within it
            start = len(self._decode_output(tokenizer, lo, m, skip).rstrip(REPLACEMENT_CHAR))
        for stop in self.sampling.stop:
            if tail.find(stop, max(0, start - len(stop) + 1)) >= 0:
                return stop
        return None

    def _decode_output(self, tokenizer: Any, lo: int, hi: int, skip: bool) -> str:
        """The text of ``output_ids[lo:hi]``; from the output's start (``lo == 0``) as it reads after the prompt's
        last tokens, seeded as the detokenizer seeds it (``prompt_seed_ids`` of the prompt tail it is sent): decoded
        alone, a SentencePiece decoder (Llama 2, Mistral) strips the first token's leading space, and a stop
        string " foo" in the first tokens was missed."""
        ids = self.output_ids[lo:hi]

        def decode(part: list[int]) -> str:
            return tokenizer.decode(part, skip_special_tokens=skip)

        seed = prompt_seed_ids(decode, self.prompt_ids[-SEED_LOOKBACK_TOKENS:]) if lo == 0 else []
        if seed:
            base, full = decode(seed), decode(seed + ids)
            if full.startswith(base):
                return full[len(base):]
        return decode(ids)
