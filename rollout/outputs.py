"""Result objects shaped like vLLM's ``RequestOutput`` (plus ``weight_version`` and ``token_logprobs``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """vLLM's Logprob: the log-probability of one token, its 1-based rank, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence (one of the ``n`` samples of a request).

    ``logprobs[i]`` maps token id → Logprob for generated token ``i`` (the sampled token, plus the
    top-k alternatives when ``SamplingParams.logprobs = k > 0``); ``token_logprobs[i]`` is the sampled
    token's logprob as a plain float. Both are None when logprobs were not requested.
    ``finish_reason`` is "stop", "length" or "abort" (None while running); ``stop_reason`` is the stop
    token id or stop string that ended it (None for EOS, as in vLLM). ``token_weight_versions[i]`` is the
    weight version that sampled token ``i`` (all equal unless the weights changed while the request ran:
    ``update_weights_in_flight``).
    ``routed_experts`` (with ``SamplingParams.return_routed_experts``,
    in the final output; vLLM's and SGLang's shape): int32 ndarray [prompt + completion - 1 -
    routed_experts_start_len, num_hidden_layers, top_k], the experts each token that went through the model
    was routed to at each layer (largest routing weight first; -1 on dense layers).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_weight_versions: list[str] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    token_logprobs: list[float] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    routed_experts: Any = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The outputs of one prompt. In a stream, each chunk holds only what is new since the last chunk.

    ``prompt_logprobs`` (with ``SamplingParams.prompt_logprobs``; vLLM's shape): one entry per prompt token,
    token id → Logprob (the prompt token, plus the top-k alternatives), None for the first token (and for
    positions up to ``logprob_start_len``); a stream carries it in its first chunk.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    weight_version: str = ""
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


def routed_experts_to_base64(routed_experts: Any) -> str:
    """SGLang's wire format of ``CompletionOutput.routed_experts``: the int32 values, little-endian, flattened
    in (token, layer, slot) order, base64-encoded (``meta_info["routed_experts"]`` of ``/generate``)."""
    import base64

    import numpy as np

    return base64.b64encode(np.ascontiguousarray(routed_experts, dtype="<i4").tobytes()).decode("ascii")


def routed_experts_from_base64(payload: str, num_layers: int, top_k: int) -> Any:
    """The int32 ndarray [tokens, num_layers, top_k] that ``routed_experts_to_base64`` encoded."""
    import base64

    import numpy as np

    return np.frombuffer(base64.b64decode(payload), dtype="<i4").astype(np.int32).reshape(-1, num_layers, top_k)
