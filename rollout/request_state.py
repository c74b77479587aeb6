"""What the front end knows of one request while it runs (``ReqState``: its ``n`` sequences, ``SeqState``),
and the vLLM-shaped ``RequestOutput`` built from it, whole or as a delta since the last one."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from rollout.io_struct import PromptLogprobsOut, TokenOut
from rollout.outputs import CompletionOutput, Logprob, RequestOutput
from rollout.sampling_params import SamplingParams

TokenText = Callable[[int], str] | None  # token id → its text alone (None: no tokenizer, no texts)


@dataclass
class SeqState:
    """Everything received so far for one of a request's ``n`` sequences."""

    token_ids: list[int] = field(default_factory=list)
    token_weight_versions: list[str] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_text: int = 0
    routed_experts: Any = None
    sent_routed: bool = False  # a stream delivered ``routed_experts`` (a delta carries them once)


class ReqState:
    """One user request (``n`` sequences) and where its updates go."""

    def __init__(self, rid: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 sink: Callable[["ReqState"], None]) -> None:
        self.rid = rid
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.sink = sink
        self.seqs = [SeqState() for _ in range(params.n)]
        self.cached_tokens = 0
        self.prompt_logprobs: PromptLogprobsOut | None = None
        self.prompt_logprobs_sent = False  # a stream delivered them (with its first chunk)
        self.weight_version = ""
        self.error: str | None = None
        self.error_type = "RuntimeError"
        self.closed = False  # a stream already delivered its final chunk
        self.lock = threading.Lock()

    @property
    def finished(self) -> bool:
        return self.error is not None or all(s.finish_reason is not None for s in self.seqs)

    def sub_rids(self) -> list[str]:
        return [f"{self.rid}#{i}" for i in range(len(self.seqs))] if len(self.seqs) > 1 else [self.rid]

    def apply(self, index: int, out: TokenOut) -> None:
        """Add a scheduler message about sequence ``index`` (new tokens, text, logprobs, the finish)."""
        with self.lock:
            seq = self.seqs[index]
            seq.token_ids.extend(out.token_ids)
            seq.token_weight_versions.extend(out.token_weight_versions or [])
            seq.text += out.text
            if out.logprobs is not None:
                seq.logprobs.extend(out.logprobs)
                seq.ranks.extend(out.ranks or [])
            if out.top_logprobs is not None:
                seq.top_logprobs.extend(out.top_logprobs)
            self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
            if out.prompt_logprobs is not None:
                self.prompt_logprobs = out.prompt_logprobs
            self.weight_version = out.weight_version
            if out.routed_experts is not None:
                seq.routed_experts = out.routed_experts
            if out.finished is not None:
                seq.finish_reason = out.finished.type
                seq.stop_reason = None if out.finished.eos else out.finished.matched  # vLLM: None for EOS
                if out.finished.type == "abort" and out.finished.message not in (None, "aborted"):
                    self.error, self.error_type = out.finished.message, out.finished.error_type


def build_output(state: ReqState, token_text: TokenText, delta: bool = False) -> RequestOutput:
    """A vLLM-shaped RequestOutput of everything so far (or, with ``delta``, what is new)."""
    with state.lock:
        outputs = [_completion(state, i, seq, delta, token_text) for i, seq in enumerate(state.seqs)]
        prompt_lps = None
        if state.prompt_logprobs is not None and not (delta and state.prompt_logprobs_sent):
            prompt_lps = _prompt_logprob_dicts(state.prompt_ids, state.prompt_logprobs, token_text)
            state.prompt_logprobs_sent = delta
        return RequestOutput(request_id=state.rid, prompt=state.prompt, prompt_token_ids=state.prompt_ids,
                             outputs=outputs, finished=state.finished, weight_version=state.weight_version,
                             num_cached_tokens=state.cached_tokens, error=state.error,
                             prompt_logprobs=prompt_lps)

def _completion(state: ReqState, index: int, seq: SeqState, delta: bool, token_text: TokenText) -> CompletionOutput:
    t0, c0 = (seq.sent_tokens, seq.sent_text) if delta else (0, 0)
    routed = None if delta and seq.sent_routed else seq.routed_experts
    if delta:
        seq.sent_tokens, seq.sent_text = len(seq.token_ids), len(seq.text)
        seq.sent_routed = seq.routed_experts is not None
    want = state.params.logprobs is not None
    lps = seq.logprobs[t0:] if want else None
    return CompletionOutput(
        index=index, text=seq.text[c0:], token_ids=seq.token_ids[t0:],
        token_weight_versions=seq.token_weight_versions[t0:],
        cumulative_logprob=sum(seq.logprobs) if want else None,
        logprobs=_logprob_dicts(seq, t0, token_text) if want else None, token_logprobs=lps,
        finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, routed_experts=routed)

def _logprob_dicts(seq: SeqState, start: int, token_text: TokenText) -> list[dict[int, Logprob]]:
    ids = seq.token_ids[start:len(seq.logprobs)]
    return [_logprob_entry(tok, seq.logprobs[j], seq.ranks[j] if j < len(seq.ranks) else None,
                           seq.top_logprobs[j] if j < len(seq.top_logprobs) else None, token_text)
            for j, tok in enumerate(ids, start)]

def _prompt_logprob_dicts(prompt_ids: list[int], plp: PromptLogprobsOut, token_text: TokenText
                      ) -> list[dict[int, Logprob] | None]:
    """vLLM's ``prompt_logprobs``: one entry per prompt token, None where none was computed (the first token,
    and those up to ``logprob_start_len``)."""
    out: list[dict[int, Logprob] | None] = [None] * len(prompt_ids)
    for j, lp in enumerate(plp.token_logprobs):
        pos = plp.first + j
        out[pos] = _logprob_entry(prompt_ids[pos], lp, plp.ranks[j], plp.top[j] if plp.top else None, token_text)
    return out

def _logprob_entry(token: int, logprob: float, rank: int | None, top: list[tuple[int, float]] | None,
               token_text: TokenText) -> dict[int, Logprob]:
    """{token: its Logprob, then each top-k alternative not already there}, each with its text
    (``token_text``: vLLM's ``decoded_token``, the token decoded alone)."""
    entry = {token: Logprob(logprob, rank)}
    for alt_rank, (alt, lp) in enumerate(top or [], 1):
        entry.setdefault(alt, Logprob(lp, alt_rank))
    if token_text is not None:
        for tok, value in entry.items():
            value.decoded_token = token_text(tok)
    return entry
