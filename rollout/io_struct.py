"""Messages between the TokenizerManager, the Schedulers and the Detokenizer (pickled over ZeroMQ)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout.sampling_params import SamplingParams


@dataclass
class GenerateReq:
    """One sequence to generate (one of the ``n`` samples of a user request)."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    seed: int
    stream: bool = False
    return_prompt_logprobs: bool = False  # compute ``sampling.prompt_logprobs`` (the first of n samples only)


@dataclass
class AbortReq:
    rid: str


@dataclass
class ControlReq:
    """A call that every TP rank runs (``op`` names a ``Scheduler.handle_<op>`` method)."""

    cid: int
    op: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class ControlReply:
    cid: int
    ok: bool
    result: Any = None
    error: str | None = None
    error_type: str = "RuntimeError"


@dataclass
class ShutdownReq:
    pass


@dataclass
class ExpireUpdateSession:
    """Rank 0 found the open weight-update session abandoned (no update call within its group's timeout);
    sent to every TP rank with the received messages, so all ranks act on it at the same point."""


@dataclass
class FinishReason:
    """``type`` is "stop", "length" or "abort"; ``matched`` the stop token id or stop string."""

    type: str
    matched: int | str | None = None
    message: str | None = None
    error_type: str = "ValueError"


@dataclass
class DecodeSpec:
    """How the detokenizer renders one request's text."""

    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    stop: list[str]
    include_stop_str_in_output: bool
    prompt_tail: list[int]


@dataclass
class PromptLogprobsOut:
    """A request's prompt logprobs: entry ``i`` is for prompt position ``first + i`` (the logprob of that
    token given the ones before it, its rank, and with k > 0 the top-k (token id, logprob) pairs)."""

    first: int
    token_logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]] | None


@dataclass
class TokenOut:
    """A request's new tokens since its last message (all of them, at finish, for non-streaming)."""

    rid: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    ranks: list[int] | None = None
    finished: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    weight_version: str = ""
    spec: DecodeSpec | None = None
    prompt_logprobs: PromptLogprobsOut | None = None
    text: str = ""


@dataclass
class BatchTokenOut:
    outs: list[TokenOut]


@dataclass
class SchedulerError:
    """The scheduler hit an unrecoverable error; the engine is unusable."""

    message: str
