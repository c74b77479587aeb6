"""Request bodies of every endpoint, as pydantic models.

Every model forbids unknown fields and is strict about types, so a typo or a wrong type gets a 400 that
names the field instead of being ignored or coerced. Field names follow OpenAI (``/v1/*``) and SGLang
(``/generate``, ``/tokenize``, the RL control endpoints); vLLM's sampling extras are accepted on the
OpenAI endpoints (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ...).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout.engine_inputs import ChatTemplateOptions


class Body(BaseModel):
    """Base of every request body: unknown fields and wrong types are errors."""

    model_config = ConfigDict(extra="forbid", strict=True)


# ---- OpenAI ---------------------------------------------------------------------------------------


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's and SGLang's: every chunk carries its choice's usage so far


class SamplingExtras(Body):
    """vLLM's extra sampling fields (pass them with the openai client's ``extra_body``)."""

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logprobs_mode: Literal["raw", "processed"] | None = None
    request_id: str | None = None
    return_token_ids: bool = False
    return_routed_experts: bool | None = None       # SGLang's extra field (MoE routing replay)
    routed_experts_start_len: int | None = Field(default=None, ge=0)


class OpenAICommon(SamplingExtras):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(OpenAICommon):
    """``POST /v1/completions``: ``prompt`` is text, a list of texts, token ids, or a list of token-id lists."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0)  # <= the engine's max_logprobs
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as the chat template gets it: text parts joined by newlines (vLLM's rendering)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""

    def template_input(self) -> dict[str, Any]:
        """The message as the chat template gets it: ``role``, ``content`` (``text()``) and ``name`` if given."""
        return {"role": self.role, "content": self.text(), **({"name": self.name} if self.name else {})}


class ChatTemplateFields(Body):
    """vLLM's chat template options (chat completions, and ``/tokenize`` with ``messages``)."""

    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def template_options(self) -> ChatTemplateOptions:
        return ChatTemplateOptions(self.chat_template, self.add_generation_prompt, self.continue_final_message,
                                   dict(self.chat_template_kwargs or {}))


class ChatCompletionRequest(OpenAICommon, ChatTemplateFields):
    """``POST /v1/chat/completions``; the prompt is the model's chat template applied to ``messages``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)  # <= the engine's max_logprobs
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: Any = None
    parallel_tool_calls: bool | None = None


# ---- SGLang native --------------------------------------------------------------------------------

_TopK = Annotated[int, Field(ge=0)]
_StartLen = Annotated[int, Field(ge=-1)]


class GenerateRequest(Body):
    """``POST /generate`` (SGLang): ``text`` or ``input_ids`` (one prompt or a batch) and ``sampling_params``
    (SGLang/vLLM names: ``max_new_tokens``, ``temperature``, ``stop``, ...)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] = False                  # each of the three: one value, or one per prompt
    top_logprobs_num: _TopK | list[_TopK] = 0                   # <= the engine's max_logprobs
    logprob_start_len: _StartLen | list[_StartLen] = -1
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = Field(default=0, ge=0)
    stream: bool = False
    rid: str | list[str] | None = None


class TokenizeRequest(ChatTemplateFields):
    """``POST /tokenize``: ``prompt`` (text or texts) or chat ``messages``, rendered as chat completions render
    them (the same message fields and chat template options, vLLM's ``TokenizeChatRequest``)."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    tools: list[Any] | None = None  # rendered by the chat template with ``messages`` (vLLM's TokenizeChatRequest)


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]
    skip_special_tokens: bool = True


# ---- RL control (SGLang's names) ------------------------------------------------------------------


class InitWeightsUpdateGroupRequest(Body):
    master_address: str
    master_port: int = Field(gt=0, lt=65536)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["nccl", "gloo"] = "nccl"
    timeout: float | None = Field(default=None, gt=0)


class UpdateWeightsFromDistributedRequest(Body):
    """Announce tensors that trainer rank 0 broadcasts next (``load_format="flattened_bucket"``: one flat
    uint8 buffer). ``group_name`` null means the group joined last."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str | None = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    check_finite: bool = False


class UpdateWeightsFromDiskRequest(Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None


class DestroyWeightsUpdateGroupRequest(Body):
    group_name: str = "weight_update_group"


class GetWeightsByNameRequest(Body):
    name: str
    truncate_size: int = Field(default=100, ge=1)


class MemoryOccupationRequest(Body):
    """``tags``: a list of "weights", "kv_cache", "cuda_graph" (null: all)."""

    tags: list[str] | None = None


class PauseGenerationRequest(Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class StartProfileRequest(Body):
    """SGLang's ``/start_profile`` fields (``Engine.start_profile``)."""

    output_dir: str | None = None
    start_step: int | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    with_stack: bool = False
    record_shapes: bool = False
    profile_id: str | None = None


class EmptyRequest(Body):
    """A control call with no arguments (the body may be omitted)."""


class UpdateWeightVersionRequest(Body):
    new_version: str
    abort_all_requests: bool = False


class AbortRequest(Body):
    rid: str = ""
    abort_all: bool = False
