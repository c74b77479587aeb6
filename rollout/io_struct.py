"""Messages between the TokenizerManager, the Schedulers and the Detokenizer (pickled over ZeroMQ)."""

from __future__ import annotations

from dataclasses import dataclass
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
    # the front end's tokenizer's EOS, an end of sequence beside the model's (vLLM's and SGLang's rule)
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class BatchGenerateReq:
    """The sequences of several requests submitted at once, in one message (SGLang sends a batch the same way):
    the scheduler adds them in order, so a batch's first prefill step can take all of it."""

    reqs: list[GenerateReq]


@dataclass
class AbortReq:
    rid: str


@dataclass(kw_only=True)
class ControlReq:
    """A call that every TP rank runs, answered by one ``ControlReply`` with the same ``cid`` (the
    TokenizerManager numbers them). Each operation is a subclass; ``Scheduler.control_handlers`` maps it to
    the method that runs it. Subclasses of ``ReadOnlyReq`` may run while a step is in flight; subclasses of
    ``ExclusiveReq`` (among them ``WeightUpdateReq``, the calls that write the weights) wait until no request
    is in flight (or generation is paused in place) while new requests are held."""

    cid: int = -1


class ReadOnlyReq(ControlReq):
    """A control call that only reads scheduler state."""


class ExclusiveReq(ControlReq):
    """A control call that runs only when no request is in flight (or generation is paused in place; weight
    updates also at the next step boundary under ``update_weights_in_flight``): new requests are held until
    it has run."""


class WeightUpdateReq(ExclusiveReq):
    """A control call that writes the weights."""


@dataclass(kw_only=True)
class GetLoadReq(ReadOnlyReq):
    pass


@dataclass(kw_only=True)
class GetStepStatsReq(ReadOnlyReq):
    reset: bool = False


@dataclass(kw_only=True)
class GetWeightVersionReq(ReadOnlyReq):
    pass


@dataclass(kw_only=True)
class GetWeightStateReq(ReadOnlyReq):
    pass


@dataclass(kw_only=True)
class FlushCacheReq(ControlReq):
    pass


@dataclass(kw_only=True)
class PauseGenerationReq(ControlReq):
    mode: str = "abort"


@dataclass(kw_only=True)
class ContinueGenerationReq(ControlReq):
    pass


@dataclass(kw_only=True)
class UpdateWeightVersionReq(ControlReq):
    weight_version: str


@dataclass(kw_only=True)
class GetWeightsByNameReq(ControlReq):
    name: str
    truncate_size: int = 100


@dataclass(kw_only=True)
class WeightsFingerprintReq(ControlReq):
    pass


@dataclass(kw_only=True)
class InitProcessGroupReq(ControlReq):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str = "nccl"
    timeout: float | None = None


@dataclass(kw_only=True)
class DestroyProcessGroupReq(ControlReq):
    group_name: str


@dataclass(kw_only=True)
class BenchmarkReceiveReq(ControlReq):
    nbytes: int
    num_chunks: int
    group_name: str | None = None


@dataclass(kw_only=True)
class UpdateWeightReq(WeightUpdateReq):
    """OpenRLHF's per-tensor update: one tensor broadcast by trainer rank 0."""

    name: str
    dtype: str
    shape: list[int]
    empty_cache: bool = False
    group_name: str | None = None


@dataclass(kw_only=True)
class UpdateWeightsFromDistributedReq(WeightUpdateReq):
    """SGLang's bucketed update (``load_format="flattened_bucket"``: one flat buffer)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str | None = None
    flush_cache: bool = True
    weight_version: str | None = None
    load_format: str | None = None
    check_finite: bool = False


@dataclass(kw_only=True)
class UpdateWeightsFromTensorReq(WeightUpdateReq):
    """Tensors from a colocated trainer: ``payload`` is ``("cuda_ipc", [rebuild args])`` or ``("shm", name)``
    (``rollout.weights.shared_tensors``); ``specs`` (name, dtype, shape) in payload order."""

    specs: list[tuple[str, str, list[int]]]
    payload: Any
    flush_cache: bool = True
    weight_version: str | None = None
    check_finite: bool = False


@dataclass(kw_only=True)
class UpdateWeightsFromDiskReq(WeightUpdateReq):
    model_path: str
    weight_version: str | None = None


@dataclass(kw_only=True)
class RollbackWeightsReq(WeightUpdateReq):
    pass


@dataclass(kw_only=True)
class ReleaseMemoryOccupationReq(ExclusiveReq):
    """Release the memory of ``tags`` (None: all of ``rollout.model_executor.memory_saver.TAGS``); the weights'
    contents are kept in host memory only with ``keep_weights`` (``sleep(level=1)``)."""

    tags: list[str] | None = None
    keep_weights: bool = False


@dataclass(kw_only=True)
class ResumeMemoryOccupationReq(ExclusiveReq):
    tags: list[str] | None = None


@dataclass(kw_only=True)
class GetMemoryStateReq(ReadOnlyReq):
    pass


@dataclass(kw_only=True)
class StartProfileReq(ReadOnlyReq):
    """SGLang's ``start_profile`` fields: a torch.profiler trace of this rank's steps (it only adds recording,
    so it may start while a step is in flight). ``start_step`` is the scheduler's step count to start at (at
    once when None or already past); ``num_steps`` stops it by itself after that many steps (None: at
    ``StopProfileReq``). ``profile_id`` names every rank's trace (the Engine picks it, so the ranks agree)."""

    output_dir: str
    profile_id: str
    start_step: int | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    with_stack: bool = False
    record_shapes: bool = False


@dataclass(kw_only=True)
class StopProfileReq(ReadOnlyReq):
    pass


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
    """``type`` is "stop", "length" or "abort"; ``matched`` the stop token id (EOS too) or stop string; ``eos``:
    it was the tokenizer's EOS (vLLM's primary EOS, whose stop_reason is None)."""

    type: str
    matched: int | str | None = None
    message: str | None = None
    error_type: str = "ValueError"
    eos: bool = False


@dataclass
class DecodeSpec:
    """How the detokenizer renders one request's text."""

    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    stop: list[str]
    include_stop_str_in_output: bool
    prompt_tail: list[int]
    min_new_tokens: int = 0
    detokenize: bool = True  # False: no text at all (the detokenizer passes the ids through)


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
    token_weight_versions: list[str] | None = None  # per token: the weight version that sampled it
    finished: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    weight_version: str = ""
    spec: DecodeSpec | None = None
    prompt_logprobs: PromptLogprobsOut | None = None
    routed_experts: Any = None  # at finish, with return_routed_experts: int32 ndarray [tokens, layers, top_k]
    text: str = ""


@dataclass
class BatchTokenOut:
    outs: list[TokenOut]


@dataclass
class SchedulerError:
    """The scheduler hit an unrecoverable error; the engine is unusable."""

    message: str
