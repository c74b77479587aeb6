"""Per-request sampling parameters, with the names vLLM and SGLang users already type."""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

# fields (and aliases) whose None is a value, not "use the default": max tokens None runs to the context's end
_NONE_MEANS_SOMETHING = ("seed", "logprobs", "prompt_logprobs", "max_tokens", "max_new_tokens")
_ALIASES = {
    "max_tokens": "max_new_tokens",                  # vLLM
    "min_tokens": "min_new_tokens",                  # vLLM
    "sampling_seed": "seed",                         # SGLang
    "no_stop_trim": "include_stop_str_in_output",    # SGLang: keep the matched stop string / token in the text
}
_LOGPROBS_MODES = ("raw", "processed")
# SGLang's sampling parameters this engine does not implement, and what they do there: a clear "not supported"
# naming the parameter rather than "unknown sampling parameter" (a null value is the default and is accepted)
_UNSUPPORTED = {"regex": "constrained decoding", "json_schema": "constrained decoding",
                "ebnf": "constrained decoding", "structural_tag": "constrained decoding",
                "stop_regex": "regular-expression stop conditions", "logit_bias": "logit biases",
                "custom_params": "custom logit processors", "stream_interval": "per-request stream intervals"}
# the most samples one request may ask for (vLLM's VLLM_MAX_N_SEQUENCES default): each sample is a sequence of its
# own in the front end and the scheduler (a few KB each before any KV), so n=10**7 took tens of GB and hours
# of submission work before a token was sampled, and the server died of it
MAX_N = 16384
# the most stop strings one request may give (TGI's max_stop_sequences, OpenAI's 4, made roomier): every one is
# searched for after every token of every sample, in the scheduler and in the detokenizer that all requests share,
# so 20,000 of them (a 400 KB body) slowed a tiny request beside a 64-sample one from 0.08 s to 5 s, and more
# stalled the engine
MAX_STOP_STRINGS = 64
# temperatures below this sample greedily (vLLM's _SAMPLING_EPS): logits / T would overflow float32 near 1e-38
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(init=False)
class SamplingParams:
    """How to sample one request.

    ``temperature`` below 1e-5 (0 included) means greedy, as in vLLM. ``top_k`` of 0 or -1 means off.
    ``logprobs`` is None (off),
    0 (the sampled token's logprob only) or k > 0 (also the top-k alternatives). Logprobs come from the
    model's raw distribution (``logprobs_mode="raw"``, the default) or from the distribution actually
    sampled from after penalties, temperature, top-k/top-p/min-p (``"processed"``).
    ``n`` (1 to ``MAX_N``, 16384 as vLLM's default ``VLLM_MAX_N_SEQUENCES``) samples of the prompt.
    ``stop``: at most ``MAX_STOP_STRINGS`` (64) distinct strings, each searched for after every token.
    ``seed`` makes the sample depend only on (seed, sample index, token position), whatever else
    shares the batch; -1 means no seed (None), as in vLLM. ``max_tokens``/``min_tokens`` are accepted as
    aliases (vLLM's names), and SGLang's ``sampling_seed`` (``seed``) and ``no_stop_trim``
    (``include_stop_str_in_output``).
    ``prompt_logprobs`` (vLLM's name) is None (off) or k >= 0: the logprob of every prompt token given the
    ones before it (raw, like ``logprobs``), with the top-k alternatives, in ``RequestOutput.prompt_logprobs``;
    ``logprob_start_len`` (SGLang's name) starts them later: positions up to and including it get None.
    ``return_routed_experts`` (SGLang's and vLLM's name; MoE models on an engine started with
    ``enable_return_routed_experts``) returns, in ``CompletionOutput.routed_experts``, the experts every
    token that went through the model was routed to: int32 [prompt + completion - 1 - routed_experts_start_len,
    num_hidden_layers, top_k], from position ``routed_experts_start_len`` (0 to the prompt length) on.
    ``detokenize=False`` (vLLM's) leaves the text empty and ``Logprob.decoded_token`` None (token ids only: no
    detokenizer work for the request); stop strings need the text, so they are a ValueError with it.
    SGLang's parameters this engine does not implement (``regex``, ``json_schema``, ``ebnf``, ``structural_tag``,
    ``stop_regex``, ``logit_bias``, ``custom_params``, ``stream_interval``) are a ValueError "<name> is not supported".
    """

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None
    logprobs_mode: str = "raw"
    prompt_logprobs: int | None = None
    logprob_start_len: int = 0
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    detokenize: bool = True

    def __init__(self, **kwargs: Any) -> None:
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        for f in dataclasses.fields(SamplingParams):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            object.__setattr__(self, f.name, default)
        seen: dict[str, str] = {}
        for key, value in kwargs.items():
            target = _ALIASES.get(key, key)
            if key in _UNSUPPORTED:
                raise ValueError(f"{key} is not supported: this engine has no {_UNSUPPORTED[key]}")
            if target not in names:
                raise ValueError(f"unknown sampling parameter {key!r}")
            if target in seen and seen[target] != key:
                raise ValueError(f"sampling parameters {seen[target]!r} and {key!r} name the same setting")
            seen[target] = key
            setattr(self, target, value)
        try:
            self._normalize()
            self.verify()
        except ValueError as e:  # name the field as the caller typed it (max_tokens, not max_new_tokens)
            message = str(e)
            for target, key in seen.items():  # every mention: "min_tokens (5) must be <= max_tokens (3)"
                if key != target:
                    message = re.sub(rf"\b{target}\b", key, message)
            raise ValueError(message) from None

    @classmethod
    def from_any(cls, params: "SamplingParams | Mapping[str, Any] | None") -> "SamplingParams":
        """Accept our own object, a plain dict of vLLM/SGLang field names, or None (defaults). The result is
        always a new, checked object: a caller's SamplingParams is copied (as vLLM clones it at submission), so
        setting its fields later (``params.logprobs = None`` while its request runs, as a shared object is
        updated between rollouts) changes no request already given it, and the caller's object is left as it was."""
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):  # checked again: its fields may have been set since it was made
            copied = object.__new__(cls)  # a shallow copy; ``_normalize`` makes the lists anew
            copied.__dict__.update(params.__dict__)
            params = copied
            params._normalize()
            params.verify()
            return params
        if isinstance(params, Mapping):
            return cls(**{k: v for k, v in params.items() if v is not None or k in _NONE_MEANS_SOMETHING})
        raise ValueError(f"sampling_params must be SamplingParams or a dict, got {type(params).__name__}")

    # vLLM's / SGLang's names, readable and settable (``params.max_tokens = 64``, as veRL's update_sampling_params does)
    max_tokens = property(lambda self: self.max_new_tokens, lambda self, v: setattr(self, "max_new_tokens", v))
    min_tokens = property(lambda self: self.min_new_tokens, lambda self, v: setattr(self, "min_new_tokens", v))
    sampling_seed = property(lambda self: self.seed, lambda self, v: setattr(self, "seed", v))
    no_stop_trim = property(lambda self: self.include_stop_str_in_output,
                            lambda self, v: setattr(self, "include_stop_str_in_output", v))

    def __setattr__(self, name: str, value: Any) -> None:
        """Only parameters may be set (a misspelt one was kept as an attribute nobody reads); a set value is
        checked when the params are used (``from_any``)."""
        if name not in _FIELD_NAMES and not isinstance(getattr(type(self), name, None), property):
            raise AttributeError(f"unknown sampling parameter {name!r}")
        object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def uses_token_history(self) -> bool:
        """Sampling depends on the tokens seen so far (repetition, frequency or presence penalty)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def _normalize(self) -> None:
        self.stop = _as_list(self.stop, "stop", str)
        self.stop_token_ids = _as_list(self.stop_token_ids, "stop_token_ids", int)
        if self.top_k is None or (self.top_k == 0 and not isinstance(self.top_k, bool)):
            self.top_k = -1
        if _is_int(self.seed) and self.seed == -1:  # vLLM's "no seed": a fixed seed gave every call the same samples
            self.seed = None

    def verify(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if self.max_new_tokens is not None:  # None: until the context ends (vLLM's max_tokens=None)
            _check_int(self, "max_new_tokens", lo=0)
        _check_int(self, "min_new_tokens", lo=0)
        _check_int(self, "n", lo=1, hi=MAX_N)
        _check_int(self, "top_k", lo=-1)
        _check_float(self, "temperature", lo=0.0)
        _check_float(self, "top_p", lo=0.0, hi=1.0, lo_open=True)
        _check_float(self, "min_p", lo=0.0, hi=1.0)
        _check_float(self, "repetition_penalty", lo=0.0, lo_open=True)
        _check_float(self, "frequency_penalty", lo=-2.0, hi=2.0)
        _check_float(self, "presence_penalty", lo=-2.0, hi=2.0)
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens ({self.max_new_tokens})")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.seed is not None:  # vLLM's range (a 64-bit seed): larger ones aliased smaller ones silently
            _check_int(self, "seed", lo=-2**63, hi=2**63 - 1)
        if self.logprobs is not None:
            _check_int(self, "logprobs", lo=0)  # at most the engine's max_logprobs (checked at submission)
        if self.prompt_logprobs is not None:
            _check_int(self, "prompt_logprobs", lo=0)
        _check_int(self, "logprob_start_len", lo=0)
        if self.logprobs_mode not in _LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {_LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        self.stop = list(dict.fromkeys(self.stop))  # each once, in the given order (the first listed wins)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} distinct strings, got {len(self.stop)}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        # each id once (in the given order): the scheduler's finish check and min_tokens' ban went through every
        # entry for every token of every sample, so 200,000 copies of one id wedged the engine
        self.stop_token_ids = list(dict.fromkeys(int(t) for t in self.stop_token_ids))
        _check_int(self, "routed_experts_start_len", lo=0)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                     "spaces_between_special_tokens", "return_routed_experts", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:  # vLLM's check
            raise ValueError("stop strings are only supported when detokenize is True")

    def clone(self, **changes: Any) -> "SamplingParams":
        """A copy with ``changes``, by any accepted name (``clone(max_tokens=8)``: vLLM's and SGLang's aliases too;
        each alias was passed beside its own field and refused as naming the same setting twice)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        seen: dict[str, str] = {}
        for key, value in changes.items():
            target = _ALIASES.get(key, key)
            if target in seen:
                raise ValueError(f"sampling parameters {seen[target]!r} and {key!r} name the same setting")
            seen[target] = key
            values[target] = value
        return SamplingParams(**values)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _is_int(v: Any) -> bool:
    """An integer that is not a bool: Python's, or numpy's (``numbers.Integral``), as vLLM takes them."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_int(p: SamplingParams, name: str, lo: int | None = None, hi: int | None = None) -> None:
    """Field ``name`` is an integer in [lo, hi]; stored as a Python int (a numpy integer is converted)."""
    v = getattr(p, name)
    if not _is_int(v):
        raise ValueError(f"{name} must be an int, got {v!r}")
    v = int(v)
    setattr(p, name, v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")


def _as_list(value: Any, name: str, kind: type) -> list[Any]:
    """``value`` as a list: None is empty, one string (for ``kind`` str, as OpenAI's ``stop``) is a list of
    one; anything else but a list or tuple is a ValueError naming ``name`` (``verify`` checks the items)."""
    if value is None:
        return []
    if kind is str and isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)):
        what = "a string or a list of strings" if kind is str else "a list of ints"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return list(value)


def _check_float(p: SamplingParams, name: str, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False) -> None:
    v = getattr(p, name)
    if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    v = float(v)
    setattr(p, name, v)
    bad_lo = lo is not None and (v <= lo if lo_open else v < lo)
    if bad_lo or (hi is not None and v > hi):
        left = "(" if lo_open else "["
        raise ValueError(f"{name} must be in {left}{lo}, {hi if hi is not None else 'inf'}], got {v}")
