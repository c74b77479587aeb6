"""The engine's one frozen configuration object and the model facts read from config.json."""

from __future__ import annotations

import dataclasses
import importlib
import numbers
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from rollout.json_files import read_json_object
from rollout.sampling_defaults import SAMPLING_DEFAULTS

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Qwen3MoeForCausalLM", "MixtralForCausalLM")
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_WINDOWED_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM")  # sliding_window, when set, applies
_SWITCHED_WINDOW_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")  # only with
# use_sliding_window (off by default)
_LAYER_TYPED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")  # and then only on the layers that layer_types
# marks sliding_attention (Qwen3-MoE: on every layer)
_DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
ATTENTION_BACKENDS = ("auto", "torch_native", "flashinfer")  # auto: flashinfer on CUDA when installed
DECODE_ATTENTION_BACKENDS = ("auto", "flashinfer", "triton", "xqa")  # under flashinfer; auto: triton
XQA_PAGE_SIZES = (16, 32, 64, 128)  # the page sizes FlashInfer's XQA decode kernel is built for
QUANTIZATION_METHODS = ("fp8",)  # online: a checkpoint in the model dtype, quantized as it loads


@dataclass(frozen=True)
class ModelConfig:
    """Facts about a Llama-family checkpoint, read from its HF ``config.json``.

    Mixture-of-experts checkpoints (Qwen3-MoE, Mixtral) set ``num_experts`` > 0 (dense models: 0):
    ``num_experts_per_tok`` experts (top-k) of ``moe_intermediate_size`` each run per token on the layers in
    ``sparse_layers``; the others have the dense MLP of ``intermediate_size``. ``norm_topk_prob``: the
    top-k router probabilities are renormalized to sum to 1. ``moe_topk_weights_fp32``: the routing
    weights multiply the experts' outputs in float32 (Mixtral) rather than in the model dtype (Qwen3-MoE),
    as each model's transformers code does.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    hidden_act: str
    torch_dtype: str
    rope: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_topk_weights_fp32: bool = False
    sparse_layers: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_path(cls, model_path: str) -> "ModelConfig":
        path = os.path.join(model_path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"no config.json in model path {model_path!r}")
        raw = read_json_object(path)
        if not (raw.get("torch_dtype") or raw.get("dtype")):
            raw = {**raw, "torch_dtype": _weights_dtype(model_path)}
        return cls.from_dict(raw, _read_generation_eos(model_path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], extra_eos: tuple[int, ...] = ()) -> "ModelConfig":
        arch = _architecture(raw)
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
        _check_biases(arch, raw)
        raw = _with_architecture_defaults(arch, raw)
        num_heads = raw["num_attention_heads"]
        # transformers' attention: the config's head_dim (Qwen3's class default 128 when left out), else H / heads
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        window = _sliding_window(arch, raw)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        eos_ids = tuple(dict.fromkeys(eos_ids + tuple(extra_eos)))
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM",  # transformers' Qwen2 always has them, whatever attention_bias says
            qk_norm=arch in _QK_NORM_ARCHITECTURES,
            hidden_act=act,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            rope=_rope_params(raw),
            eos_token_ids=eos_ids,
            sliding_window=window,
            raw=raw,
            **_moe_fields(arch, raw),
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _moe_fields(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of ``ModelConfig`` (none for a dense architecture), decided as transformers decides
    them: Qwen3-MoE's layer ``i`` is sparse unless ``i`` is in ``mlp_only_layers`` or ``(i + 1)`` is not a
    multiple of ``decoder_sparse_step`` (``Qwen3MoeDecoderLayer``); every Mixtral layer is sparse, its
    experts are ``intermediate_size`` wide and its top-k weights always renormalized."""
    if arch not in ("Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        return {}
    # transformers writes Qwen3-MoE's num_experts as num_local_experts (its attribute_map) and reads either
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    top_k = int(raw.get("num_experts_per_tok") or 0)
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"{arch} needs num_experts >= 1 and 1 <= num_experts_per_tok <= num_experts, got "
                         f"{num_experts} and {top_k}")
    layers = range(raw["num_hidden_layers"])
    if arch == "MixtralForCausalLM":
        return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["intermediate_size"],
                    norm_topk_prob=True, moe_topk_weights_fp32=True, sparse_layers=tuple(layers))
    dense = set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step") or 1)
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["moe_intermediate_size"],
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)), moe_topk_weights_fp32=False,
                sparse_layers=tuple(i for i in layers if i not in dense and (i + 1) % step == 0))


_MLP_BIAS_ARCHITECTURES = ("LlamaForCausalLM",)  # whose transformers model reads mlp_bias
_ATTENTION_BIAS_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")  # attention_bias


def _check_biases(arch: str, raw: dict[str, Any]) -> None:
    """ValueError for projection biases the models here do not have, where transformers' model reads the flag:
    ``mlp_bias`` (Llama) and ``attention_bias`` (Llama, Qwen3, Qwen3-MoE: q/k/v and o_proj). The others ignore
    the flags, and so does the engine: Mistral's and Mixtral's projections never have biases, nor Qwen's MLPs,
    and Qwen2's q/k/v always do (served) and its o_proj never."""
    if raw.get("mlp_bias") and arch in _MLP_BIAS_ARCHITECTURES:
        raise ValueError(f"mlp_bias=true (biases on the MLP projections) is not supported for {arch}")
    if raw.get("attention_bias") and arch in _ATTENTION_BIAS_ARCHITECTURES:
        raise ValueError(f"attention_bias=true (biases on q/k/v/o_proj) is not supported for {arch}")


def _windowed(arch: str, raw: dict[str, Any]) -> bool:
    """Whether transformers applies the config's ``sliding_window``: always for Mistral and Mixtral, for Qwen only
    with ``use_sliding_window`` (default False, so a Qwen config carrying a window attends fully), never for Llama."""
    return arch in _WINDOWED_ARCHITECTURES or (arch in _SWITCHED_WINDOW_ARCHITECTURES
                                               and raw.get("use_sliding_window", False))


def _sliding_window(arch: str, raw: dict[str, Any]) -> int | None:
    """The attention window as transformers applies it (``_windowed``), or None. Qwen2 and Qwen3 apply it only on
    the layers their ``layer_types`` mark ``sliding_attention`` (by default those from ``max_window_layers`` on,
    28 in their classes): with none marked, the model attends fully, however long the context. With some, the
    window caps the context (``model_runner._context_len``), within which a windowed layer attends fully too."""
    if not _windowed(arch, raw):
        return None
    layer_types = raw.get("layer_types")
    if arch in _LAYER_TYPED_ARCHITECTURES and layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return raw.get("sliding_window")


_ARCHITECTURE_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                               "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


def _architecture(raw: dict[str, Any]) -> str:
    """The model class to run, chosen as transformers' ``AutoModelForCausalLM`` chooses it: by ``model_type`` (its
    config class), whatever ``architectures`` says (a Mistral labelled ``LlamaForCausalLM`` is a Mistral, its
    window applied; a Qwen3 labelled ``Qwen3ForSequenceClassification`` a Qwen3 causal LM). Only a config without
    ``model_type``, which transformers cannot load, falls back to ``architectures[0]``."""
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if model_type:
        if model_type not in _ARCHITECTURE_OF_MODEL_TYPE:
            raise ValueError(f"unsupported model_type {model_type!r} (architectures {archs}); supported: "
                             f"{', '.join(_ARCHITECTURE_OF_MODEL_TYPE)}")
        return _ARCHITECTURE_OF_MODEL_TYPE[model_type]
    arch = archs[0] if archs else "<missing>"
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


_DEFAULTED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "rms_norm_eps", "max_position_embeddings", "num_key_value_heads")
# whose config class has a head_dim (Qwen2's and Qwen3-MoE's have none: their configs never carry it, and asking
# for it would import transformers at every start)
_HEAD_DIM_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen3ForCausalLM")
# the experts' count is num_local_experts here, which Qwen3-MoE's num_experts stands for (its attribute_map)
_MOE_DEFAULTED_KEYS = {"Qwen3MoeForCausalLM": ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size"),
                       "MixtralForCausalLM": ("num_local_experts", "num_experts_per_tok")}
_TRANSFORMERS_IMPORT = threading.Lock()


def import_transformers() -> Any:
    """The ``transformers`` module, its first import done by one thread at a time. That import is not thread-safe:
    a thread's ``from transformers import AutoTokenizer`` while another thread imports the package fails with an
    ImportError (two engines started at once from two threads); once imported, concurrent imports are fine."""
    with _TRANSFORMERS_IMPORT:
        return importlib.import_module("transformers")


def _with_architecture_defaults(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with the keys a config.json may leave out that differ by architecture (the sizes, experts included:
    Mixtral's 8 of top-2, Qwen3-MoE's 128 of top-8, 768 wide; the norm epsilon, the context, the rope theta:
    Mixtral's 1e-5 and 1e6, Llama's 1e-6 and 1e4; the KV heads: Llama's as many as its attention heads,
    Mistral's 8; ``head_dim``: Qwen3's 128 whatever the hidden size, Llama's hidden size
    over heads, and none from the classes without the key (Qwen2, Qwen3-MoE: their attention takes hidden size
    over heads); where a window applies (``_windowed``), ``sliding_window``: Mistral's 4096, and for Qwen2 and
    Qwen3 the ``layer_types`` their ``max_window_layers`` gives) filled in with the values transformers' config
    class for its ``model_type`` gives this config, as transformers reads it. Configs that carry them all do not
    import transformers."""
    windowed = _windowed(arch, raw)
    keys = _DEFAULTED_KEYS + _MOE_DEFAULTED_KEYS.get(arch, ()) + (("sliding_window",) if windowed else ())
    keys += ("head_dim",) if arch in _HEAD_DIM_ARCHITECTURES else ()
    if windowed and arch in _LAYER_TYPED_ARCHITECTURES:
        keys += ("layer_types",)
    rope = _rope_dict(raw)
    if all(_has_key(raw, k) for k in keys) and ("rope_theta" in raw or "rope_theta" in rope):
        return raw
    CONFIG_MAPPING = import_transformers().CONFIG_MAPPING

    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        return raw
    hf = CONFIG_MAPPING[model_type](**{k: v for k, v in raw.items()
                                       if k not in ("architectures", "transformers_version")})
    filled = {k: getattr(hf, k) for k in keys if not _has_key(raw, k) and hasattr(hf, k)}
    theta = (hf.rope_parameters or {}).get("rope_theta")
    if "rope_theta" not in raw and "rope_theta" not in rope and theta is not None:
        filled["rope_theta"] = theta
    return {**raw, **filled}


def _has_key(raw: dict[str, Any], key: str) -> bool:
    return key in raw or (key == "num_local_experts" and "num_experts" in raw)


def _rope_dict(raw: dict[str, Any]) -> dict[str, Any]:
    """The config's rope dict as transformers 5 reads it (``convert_rope_params_to_dict``): a ``rope_scaling``
    (4.x's key, or one added to a 5.x config as Qwen's YaRN instructions say) replaces ``rope_parameters``
    whole, the ``rope_theta`` in it included."""
    return raw.get("rope_scaling") or raw.get("rope_parameters") or {}


def _rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """Normalize transformers 4.x (``rope_theta`` + ``rope_scaling``) and 5.x (``rope_parameters``): the dict of
    ``_rope_dict``, its ``rope_theta`` else the config's, and its ``rope_type``."""
    params = dict(_rope_dict(raw))
    if "rope_theta" not in params:
        params["rope_theta"] = raw.get("rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _weights_dtype(model_path: str) -> str | None:
    """The dtype transformers loads a checkpoint whose config.json names none in (``get_state_dict_dtype``): its
    first floating tensor's, float8 left out (bfloat16 weights run in bfloat16, not float32); None without
    safetensors weights."""
    from rollout.models.loader import read_safetensors_shapes

    try:
        dtypes = [dtype for dtype, _ in read_safetensors_shapes(model_path).values()]
    except ValueError:  # no weights (load_format="dummy")
        return None
    return next((d for d in dtypes if d in ("float32", "bfloat16", "float16", "float64")), None)


def _read_generation_eos(model_path: str) -> tuple[int, ...]:
    path = os.path.join(model_path, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    eos = read_json_object(path).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos if isinstance(eos, list) else [eos])


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine's processes need, passed once to each of them.

    Memory: on GPU the weights plus KV cache take ``mem_fraction_static`` of the device's memory; on
    CPU the KV cache takes ``cpu_kv_cache_gb``. ``max_total_tokens`` overrides both with an exact
    number of KV slots (tokens). ``disable_overlap_schedule`` turns off launching decode step N+1
    before step N's tokens reach the host (SGLang's flag name). ``kv_cache_dtype`` "auto" stores K/V
    in the model dtype; "fp8_e4m3" / "fp8_e5m2" store them as float8 with unit scale (SGLang's and
    vLLM's option): half the KV bytes read per decode step and twice the slots, at fp8 precision.
    ``decode_attention_backend`` (SGLang's name) picks the decode kernel under the flashinfer backend:
    "triton" (``rollout.kernels.decode_attention``; "auto" picks it: faster than FlashInfer 0.6.6's on
    H200 for bf16 and fp8 pools), "flashinfer", or "xqa" (FlashInfer's XQA kernel from TensorRT-LLM; needs
    ``page_size`` in ``XQA_PAGE_SIZES``; with a float8 pool on Hopper it also rounds q and the softmax
    weights to float8 and multiplies on float8 tensor cores, as vLLM's FA3 and TensorRT-LLM do).
    ``decode_balance_ratio`` (Triton decode): a decode step whose longest request holds at
    least this many times the mean cached tokens cuts each request into pieces by its length
    (``rollout.kernels.balanced_decode``), so one long request does not hold the step's attention up
    (default 4: at equal lengths the split kernel is up to 3% faster, with one request at 4x the mean or more
    the pieces are 1.2-2.9x faster on whole decode steps, bf16 and float8 pools, docs/rl_rollouts.md;
    0: every step; ``inf``: never).
    ``page_size`` (SGLang's name): KV slots are handed out in pages of that many tokens, each request's
    tokens filling its pages in order, and the prefix cache shares whole pages only (default 1: any
    prefix is shared).
    ``enable_memory_saver`` (SGLang's name; vLLM's ``enable_sleep_mode``) lets a colocated trainer take the
    engine's memory: ``Engine.sleep`` / ``release_memory_occupation`` (``rollout.model_executor.memory_saver``;
    on a GPU it needs torch-memory-saver, in the ``gpu`` extra).
    ``quantization`` "fp8" (SGLang's and vLLM's online fp8) stores the decoder layers' projection
    weights as float8_e4m3fn with per-row scales and quantizes their inputs per token
    (``rollout.layers.quantization``): half the weight bytes and fp8 tensor-core GEMMs, at fp8
    precision. Weight updates still send model-dtype tensors; the engine quantizes them as they land.
    ``enable_return_routed_experts`` (vLLM's and SGLang's name; mixture-of-experts models) keeps the experts
    each token was routed to beside its KV (``rollout.mem_cache.routed_experts``), so requests may ask for
    them (``SamplingParams.return_routed_experts``) for rollout routing replay.
    ``update_weights_in_flight`` (partial rollouts, as PipelineRL and AReaL run them): a weight update is
    applied at the next step boundary instead of waiting for every request in flight to finish; running
    requests pause while the update session is open and then continue on the new weights, keeping the KV
    their earlier tokens computed with the older weights. ``CompletionOutput.token_weight_versions`` says
    which weights sampled each token. Off by default: updates wait for the requests in flight (drain).
    ``enable_mixed_chunk`` (SGLang's name): a prefill step also carries one token of every running request
    (their decode), so a long prompt no longer stalls the running requests for a whole step; the step's
    prefill budget shrinks by the running count (to at least a quarter of ``max_prefill_tokens``). Mixed
    steps run eager (no CUDA graph) and read the running requests' last tokens from the host, so the step
    in flight is read first. Off by default until GPU measurements say where it wins.
    ``max_running_requests`` (1024, vLLM's default on large GPUs) and ``cuda_graph_max_bs`` (1024; SGLang's
    names): RL rollouts submit many samples at once, and GRPO rollouts on an H200 ran faster than with 256
    running: 1.35x (512) and 1.52x (1024, no retraction) on the Llama-3.1-8B shape, 1.14x and 1.35x on
    the Qwen3-0.6B shape (docs/rl_rollouts.md); batches up to 256 run exactly as before.
    ``schedule_conservativeness`` (SGLang's name): how much of their remaining output budget admission keeps
    free for the running requests (``rollout.scheduler.admission.NewTokenRatio``: 0.7 of it times this at
    first, decaying while nothing is retracted); lower admits more at once and retracts more when the KV
    pool is tight, 0 reserves one page per running request. Default 0.3, not SGLang's 1: on an H200 GRPO
    rollouts in a tight KV pool ran 5-9% faster than with 0 and than with 1, and as fast as both with a
    large pool (docs/rl_rollouts.md).
    ``disable_cascade_attn`` (vLLM's name): cascade decode attention is on by default. Running requests whose
    KV starts with the same cached prefix (GRPO's N samples of one prompt, through the radix cache) form
    groups, and the Triton decode kernel reads each group's prefix once for all its members instead of once
    per member (``rollout.kernels.decode_attention``), in steps where the groups' prefixes are 256+ tokens
    and save 20%+ of the KV reads (``rollout.scheduler.prefix_groups``); each CUDA graph size gets a cascade
    variant, captured the first time a step of that size has groups. Results are the same attention; other
    decode backends ignore the groups. GRPO rollouts on an H200: 2-4% faster with 200-800-token prompts,
    12-14% with 1,500-2,500 (docs/rl_rollouts.md).
    ``enable_piecewise_cuda_graph`` and ``piecewise_cuda_graph_max_tokens`` (SGLang's names): extend (prefill)
    steps of up to that many tokens (default ``max_prefill_tokens``) replay the layers between two attentions
    as CUDA graphs, captured at start-up for padded token counts, with the attention run eagerly between them
    (``rollout.model_executor.piecewise_graph_runner``), where supported (the fused CUDA path of a dense model
    on one TP rank, no fp8 weights or KV); ``disable_cuda_graph`` turns them off too. They cut a 16k-token
    prefill step's host time ~3x, so the prefill no longer waits for a busy host (a colocated trainer's
    processes); off by default, since on an idle host the output tok/s did not move on an H100 and their
    graphs hold device memory the KV cache could use (at 16,384 tokens 1.0 GiB for Qwen3-0.6B, 4.1 GiB for
    Llama-3.1-8B; docs/rl_rollouts.md), of which sleep cannot release the graphs' pool (1.8 GiB for the 8B at
    16,384 tokens, 0.5 GiB at 4,096: a colocated engine wants a smaller ``piecewise_cuda_graph_max_tokens``;
    docs/colocation.md).
    ``sampling_defaults`` (SGLang's name; vLLM's ``generation_config="auto"``): "model" (default) takes the
    sampling fields a request leaves unset from the model's ``generation_config.json``, "openai" keeps the
    library's defaults (``rollout.sampling_defaults`` says where they apply).
    ``max_logprobs`` (vLLM's engine argument, default 20): the most top logprobs a request may ask for
    (``logprobs``, ``prompt_logprobs``, the OpenAI ``top_logprobs`` / ``logprobs``, ``/generate``'s
    ``top_logprobs_num``); -1 allows the whole vocabulary. A request asking for more is refused with vLLM's message.
    """

    model_path: str
    tokenizer_path: str | None = None
    tp_size: int = 1
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    context_length: int | None = None
    max_running_requests: int = 1024
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.85
    cpu_kv_cache_gb: float = 2.0
    chunked_prefill_size: int = 8192
    max_prefill_tokens: int = 16384
    in_batch_prefix_threshold: int = 32
    disable_radix_cache: bool = False
    attention_backend: str = "auto"
    decode_attention_backend: str = "auto"
    dist_backend: str = "auto"
    log_interval_s: float = 5.0
    log_level: str = "WARNING"
    weight_version: str = "0"
    keep_weight_copy: bool = False
    load_format: str = "auto"
    disable_cuda_graph: bool = False
    disable_overlap_schedule: bool = False
    fused_kernels: bool = True
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    cuda_graph_max_bs: int = 1024
    page_size: int = 1
    skip_tokenizer_init: bool = False
    enable_memory_saver: bool = False
    enable_return_routed_experts: bool = False
    update_weights_in_flight: bool = False
    enable_mixed_chunk: bool = False
    schedule_conservativeness: float = 0.3
    disable_cascade_attn: bool = False
    decode_balance_ratio: float = 4.0
    enable_piecewise_cuda_graph: bool = False
    piecewise_cuda_graph_max_tokens: int | None = None
    sampling_defaults: str = "model"
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not isinstance(self.tp_size, numbers.Integral) or isinstance(self.tp_size, bool) or self.tp_size < 1:
            # checked here: a float (2.0 from a YAML or JSON config) failed in ``launch`` with a bare TypeError
            # after the IPC directory was made, and left it behind
            raise ValueError(f"tp_size must be an int >= 1, got {self.tp_size!r}")
        if self.chunked_prefill_size < 1 or self.max_prefill_tokens < 1:
            raise ValueError("chunked_prefill_size and max_prefill_tokens must be >= 1")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}")
        if self.decode_attention_backend not in DECODE_ATTENTION_BACKENDS:
            raise ValueError(f"unknown decode_attention_backend {self.decode_attention_backend!r}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.decode_attention_backend == "xqa" and self.page_size not in XQA_PAGE_SIZES:
            raise ValueError(f"decode_attention_backend 'xqa' needs page_size in {XQA_PAGE_SIZES}, got {self.page_size}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {self.load_format!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be None or one of {QUANTIZATION_METHODS}, got {self.quantization!r}")
        if self.dist_backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"unknown dist_backend {self.dist_backend!r}")
        if not self.decode_balance_ratio >= 0:
            raise ValueError(f"decode_balance_ratio must be >= 0, got {self.decode_balance_ratio}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {self.context_length}")
        if not self.schedule_conservativeness >= 0:
            raise ValueError(f"schedule_conservativeness must be >= 0, got {self.schedule_conservativeness}")
        if not isinstance(self.max_logprobs, numbers.Integral) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an int >= -1 (-1: the whole vocabulary), got {self.max_logprobs!r}")
        if self.sampling_defaults not in SAMPLING_DEFAULTS:
            raise ValueError(f"sampling_defaults must be one of {SAMPLING_DEFAULTS}, got {self.sampling_defaults!r}")
        if self.piecewise_cuda_graph_max_tokens is not None and self.piecewise_cuda_graph_max_tokens < 1:
            raise ValueError(f"piecewise_cuda_graph_max_tokens must be >= 1, "
                             f"got {self.piecewise_cuda_graph_max_tokens}")

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_dist_backend(self) -> str:
        if self.dist_backend != "auto":
            return self.dist_backend
        return "nccl" if self.resolved_device.startswith("cuda") else "gloo"

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


def resolve_torch_dtype(config: EngineConfig, model: ModelConfig):
    """The torch dtype weights and activations use: the config's, or the checkpoint's for "auto"."""
    import torch

    name = config.dtype if config.dtype != "auto" else model.torch_dtype.replace("torch.", "")
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "float": torch.float32, "half": torch.float16}
    if name not in table:
        raise ValueError(f"unsupported dtype {name!r}")
    return table[name]


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype):
    """The torch dtype of a KV cache named ``kv_cache_dtype`` (one of ``KV_CACHE_DTYPES``): the model
    dtype for "auto", else the named float8 type."""
    import torch

    return {"auto": model_dtype, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
