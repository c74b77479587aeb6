"""``EngineActor``: one rollout ``Engine`` behind OpenRLHF's engine-actor methods.

OpenRLHF's trainer talks to its vLLM engines through a Ray actor (``LLMRayActor``) whose methods
forward to ``WorkerWrap`` on every TP worker. This class has the same method names and signatures,
so that call pattern works unchanged::

    refs = [e.init_process_group.remote(addr, port, i * tp + 1, world, "openrlhf", backend="nccl")
            for i, e in enumerate(engines)]
    group = weight_sync.init_process_group(addr, port, 0, world, "openrlhf", backend="nccl")
    ray.get(refs)
    for i, (name, p) in enumerate(model.named_parameters()):
        refs = [e.update_weight.remote(name, dtype=p.dtype, shape=p.shape, empty_cache=i == last) for e in engines]
        torch.distributed.broadcast(p.data, 0, group=group)
        ray.get(refs)

The class is plain Python (Ray is imported only by ``placement.create_engines``, which wraps it with
``ray.remote``), so it can also be used directly, or through ``handles.LocalActor`` without Ray.
On Ray, weight-update and other calls run one at a time in submission order (weight-update announcements
must stay in order); ``GENERATE_METHODS`` (``generate``, ``chat``) run in a concurrency group of their own,
so a rollout worker's ``generate`` (held while generation is paused) never holds up a weight update, and
``CONTROL_METHODS`` run in a third group, so that they answer while a ``generate`` or an update is in
progress.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from rollout.outputs import RequestOutput
from rollout.sampling_params import SamplingParams

# vLLM engine arguments (what OpenRLHF passes to LLMRayActor) → Engine options
_VLLM_OPTIONS = {
    "tensor_parallel_size": "tp_size",
    "gpu_memory_utilization": "mem_fraction_static",
    "max_model_len": "context_length",
    "max_num_seqs": "max_running_requests",
    "max_num_batched_tokens": "chunked_prefill_size",
    "tokenizer": "tokenizer_path",
    "enable_sleep_mode": "enable_memory_saver",
}
# vLLM arguments with no meaning here (Ray placement, vLLM internals): accepted and ignored
_VLLM_IGNORED = frozenset({"trust_remote_code", "distributed_executor_backend", "worker_cls",
                           "worker_extension_cls", "bundle_indices", "num_gpus",
                           "full_determinism", "num_actors", "enable_chunked_prefill", "swap_space",
                           "disable_log_stats"})
# vLLM engine arguments where None means "the default" (OpenRLHF passes gpu_memory_utilization=None)
_VLLM_NONE_IS_DEFAULT = frozenset(_VLLM_OPTIONS) | {"enable_prefix_caching", "enforce_eager", "generation_config",
                                                    "max_logprobs"}
# vLLM's generation_config → our sampling_defaults
_VLLM_GENERATION_CONFIG = {"auto": "model", "vllm": "openai"}
# vLLM's engine-level logprobs_mode → our per-request SamplingParams.logprobs_mode
_VLLM_LOGPROBS_MODES = {"raw_logprobs": "raw", "processed_logprobs": "processed", "raw": "raw",
                        "processed": "processed"}


def engine_options(model: str | None = None, **kwargs: Any) -> dict[str, Any]:
    """``Engine`` keyword arguments from our own names or vLLM's (``tensor_parallel_size``,
    ``gpu_memory_utilization``, ``max_model_len``, ``enable_prefix_caching``, ``enforce_eager``, ...). A vLLM
    argument given as None keeps the engine's default. vLLM's ``logprobs_mode`` is not an engine option here
    (it is per request: ``SamplingParams.logprobs_mode``; ``EngineActor`` turns it into the requests' default)."""
    out: dict[str, Any] = {}
    if model is not None:
        out["model_path"] = str(model)
    for key, value in kwargs.items():
        if key in _VLLM_IGNORED or (value is None and key in _VLLM_NONE_IS_DEFAULT):
            continue
        if key == "enable_prefix_caching":
            out["disable_radix_cache"] = not value
        elif key == "enforce_eager":
            out["disable_cuda_graph"] = bool(value)
        elif key == "generation_config":
            out["sampling_defaults"] = _sampling_defaults(value)
        elif key in ("model", "pretrain", "model_path"):
            out["model_path"] = str(value)
        else:
            out[_VLLM_OPTIONS.get(key, key)] = value
    return out


def _sampling_defaults(generation_config: Any) -> str:
    """Our ``sampling_defaults`` for vLLM's ``generation_config``: "auto" (the model's file) or "vllm" (the library's
    defaults); vLLM's third form, another directory to read the file from, is a ValueError."""
    if generation_config in _VLLM_GENERATION_CONFIG:
        return _VLLM_GENERATION_CONFIG[generation_config]
    raise ValueError(f"generation_config={generation_config!r} is not supported: use 'auto' (the model's "
                     "generation_config.json) or 'vllm' (the library's defaults)")


# vLLM SamplingParams fields with no counterpart here: copying the rest silently would change the sampling
_VLLM_ONLY_SAMPLING = ("allowed_token_ids", "logit_bias", "bad_words", "truncate_prompt_tokens", "guided_decoding",
                       "structured_outputs", "logits_processors")


def logprobs_mode_default(mode: str | None) -> str | None:
    """Our per-request ``logprobs_mode`` ("raw" / "processed") for vLLM's engine-level one
    ("raw_logprobs" / "processed_logprobs"; ours are accepted as they are). vLLM's logits modes are a
    ValueError: the engine returns logprobs only."""
    if mode is None:
        return None
    if mode in _VLLM_LOGPROBS_MODES:
        return _VLLM_LOGPROBS_MODES[mode]
    if mode in ("raw_logits", "processed_logits"):
        raise ValueError(f"logprobs_mode={mode!r} (logits instead of logprobs) is not supported: this engine "
                         "returns logprobs; use 'raw_logprobs' or 'processed_logprobs'")
    raise ValueError(f"unknown logprobs_mode {mode!r}: use 'raw_logprobs' or 'processed_logprobs'")


def to_sampling_params(params: Any, logprobs_mode: str | None = None) -> SamplingParams:
    """Our ``SamplingParams``, a dict of vLLM/SGLang field names, or a vLLM ``SamplingParams`` object
    (its fields that we share are copied; a vLLM-only field set away from its default is a ValueError).
    ``logprobs_mode`` ("raw" / "processed") is the default for a dict, a vLLM object or None that names no
    mode of its own; our ``SamplingParams`` always names one and is used with its own values (a copy)."""
    if logprobs_mode is not None and not isinstance(params, SamplingParams):
        params = _with_logprobs_mode(params, logprobs_mode)
    if params is None or isinstance(params, (SamplingParams, Mapping)):
        return SamplingParams.from_any(params)
    unsupported = [name for name in _VLLM_ONLY_SAMPLING if getattr(params, name, None) not in (None, [], {}, ())]
    if unsupported:
        raise ValueError(f"vLLM sampling parameters {unsupported} are not supported by this engine")
    real_n = _vllm_real_n(params)
    fields = SamplingParams.__dataclass_fields__
    names = [f for f in fields if f != "max_new_tokens" and f != "min_new_tokens"] + ["max_tokens", "min_tokens"]
    values = {}
    for name in names:
        if hasattr(params, name):
            value = getattr(params, name)
            if value is not None or name in ("seed", "logprobs", "max_tokens"):  # max_tokens None: to the context end
                values[name] = list(value) if isinstance(value, (set, tuple)) else value
    if not values:
        raise ValueError(f"sampling_params must be SamplingParams or a dict, got {type(params).__name__}")
    if values.get("top_k") == 0:
        values["top_k"] = -1
    if real_n is not None:
        values["n"] = real_n
    return SamplingParams(**values)


def _vllm_real_n(params: Any) -> int | None:
    """The ``n`` a vLLM SamplingParams object asks for: its ``__post_init__`` moves ``best_of`` into ``n`` and keeps
    the caller's ``n`` in ``_real_n``; copying ``n`` returned ``best_of`` samples where vLLM returns the best ``n``
    of them (V1 refuses). ValueError for ``best_of`` beyond that ``n`` (no best-of selection here)."""
    best_of = getattr(params, "best_of", None)
    real_n = getattr(params, "_real_n", None) or getattr(params, "n", None)
    if best_of is not None and best_of != real_n:
        raise ValueError(f"vLLM sampling parameter best_of={best_of} (n={real_n}) is not supported by this engine: "
                         "it returns every one of n samples, with no best-of selection")
    return real_n


def _with_logprobs_mode(params: Any, mode: str) -> Any:
    """``params`` (None, a dict or a vLLM object) with ``logprobs_mode=mode`` unless it names one itself."""
    if params is None:
        return {"logprobs_mode": mode}
    if isinstance(params, Mapping):
        return params if params.get("logprobs_mode") is not None else {**params, "logprobs_mode": mode}
    if getattr(params, "logprobs_mode", None) is not None:
        return params
    sampling = to_sampling_params(params)
    return sampling.clone(logprobs_mode=mode)


class EngineActor:
    """Wraps one ``rollout.Engine``; the methods are OpenRLHF's ``LLMRayActor`` / ``WorkerWrap`` ones.

    ``EngineActor(model, seed=0, tensor_parallel_size=1, dtype="auto", device=None, **options)``;
    options are ``Engine`` options or vLLM engine arguments (see ``engine_options``).
    ``weight_sync_timeout`` (seconds) bounds the weight-update group's rendezvous and transfers.
    ``logprobs_mode`` (vLLM's engine argument: "raw_logprobs", the default, or "processed_logprobs", which
    OpenRLHF passes for its importance-sampling correction) is the default of every request that does not
    name a ``logprobs_mode`` of its own.
    """

    CONTROL_METHODS = ("pause_generation", "resume_generation", "continue_generation",
                       "get_num_unfinished_requests", "get_weight_version", "get_weight_state", "ready",
                       "is_sleeping")
    # request-serving calls: they may wait a long time (a paused engine holds them), so they run apart from
    # the ordered weight-update calls
    GENERATE_METHODS = ("generate", "chat")

    def __init__(self, model: str | None = None, *args: Any, weight_sync_timeout: float | None = None,
                 logprobs_mode: str | None = None, **kwargs: Any) -> None:
        from rollout import Engine

        if args:
            raise ValueError("EngineActor takes the model path and keyword arguments only")
        self.logprobs_mode = logprobs_mode_default(logprobs_mode)
        options = engine_options(model, **kwargs)
        path = options.pop("model_path", None)
        if not path:
            raise ValueError("EngineActor needs a model path")
        self.weight_sync_timeout = weight_sync_timeout
        self.engine = Engine(path, **options)
        self.device = self.engine.config.resolved_device
        self._gpu_uuid: str | None = None

    def ready(self) -> bool:
        """True once the engine is up (the constructor waited for it): use to wait for actors to start."""
        return True

    # ---- generation (vLLM-shaped outputs) -----------------------------------------------------

    def generate(self, prompts: Any = None, sampling_params: Any = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None, use_tqdm: bool = False
                 ) -> list[RequestOutput]:
        """vLLM's ``LLM.generate``: ``prompts`` (first, as in vLLM) are strings, token-id lists or vLLM
        ``TokensPrompt`` dicts (``{"prompt_token_ids": [...]}``); the older ``prompt_token_ids=`` keyword
        is accepted too. Outputs in prompt order with ``.outputs[i].token_ids``, ``.text``,
        ``.logprobs[i][token_id].logprob``, ``.finish_reason``. ``sampling_params`` may be one or a
        list (one per prompt), each our ``SamplingParams``, a dict of vLLM names or a vLLM object."""
        return self.engine.generate(prompts, self._sampling(sampling_params), prompt_token_ids=prompt_token_ids,
                                    use_tqdm=use_tqdm)

    def chat(self, messages: Any, sampling_params: Any = None, use_tqdm: bool = False, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation or a list of them, with its template options
        (``chat_template_kwargs={"enable_thinking": False}``, ``tools``, ``continue_final_message``, ...);
        ``sampling_params`` as in ``generate``."""
        return self.engine.chat(messages, self._sampling(sampling_params), use_tqdm=use_tqdm,
                                chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message, tools=tools,
                                chat_template_kwargs=chat_template_kwargs)

    def _sampling(self, params: Any) -> SamplingParams | list[SamplingParams]:
        if isinstance(params, (list, tuple)):
            return [self._one_sampling(p) for p in params]
        return self._one_sampling(params)

    def _one_sampling(self, params: Any) -> SamplingParams:
        """None takes the engine's defaults (the model's generation_config.json values, as vLLM's ``LLM.generate``
        with ``generation_config="auto"``), under the actor's ``logprobs_mode``."""
        return to_sampling_params(dict(self.engine.sampling_defaults) if params is None else params,
                                  self.logprobs_mode)

    def get_num_unfinished_requests(self) -> int:
        """Requests submitted to this engine and not finished yet (vLLM's name)."""
        return self.engine.get_num_unfinished_requests()

    # ---- weight sync: OpenRLHF's names ---------------------------------------------------------

    def init_process_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                           group_name: str, backend: str = "nccl", use_ray: bool = False,
                           timeout: float | None = None) -> bool:
        """Join the trainer's weight-update group: TP rank r joins as ``rank_offset + r`` (trainer = 0, so
        ``rank_offset >= 1`` and ``rank_offset + tensor_parallel_size <= world_size``, else ValueError).
        Blocks until every member has joined. ``use_ray=True`` (ray.util.collective) is not supported;
        ``timeout`` defaults to the actor's ``weight_sync_timeout``."""
        _check_ranks(rank_offset, world_size, self.engine.config.tp_size)
        if use_ray:
            raise ValueError("use_ray=True (a ray.util.collective group) is not supported: the engine joins a "
                             "torch.distributed group; call init_process_group with use_ray=False")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"unsupported weight-update backend {backend!r}: use 'nccl' (GPU) or 'gloo' (CPU)")
        if backend == "nccl" and not self.device.startswith("cuda"):
            raise ValueError(f"backend 'nccl' needs a GPU engine; this engine runs on {self.device!r}: use 'gloo'")
        return self.engine.init_process_group(master_address, master_port, rank_offset, world_size, group_name,
                                              backend=backend,
                                              timeout=timeout if timeout is not None else self.weight_sync_timeout)

    def update_weight(self, name: str, dtype: Any, shape: Any, empty_cache: bool = False) -> Any:
        """Receive one tensor broadcast by rank 0 and load it; ``empty_cache=True`` (OpenRLHF sets it on
        the last parameter) completes the update (prefix cache flushed, weight version bumped)."""
        return self.engine.update_weight(name, dtype, list(shape), empty_cache=empty_cache)

    def update_weight_cuda_ipc(self, name: str, dtype: Any, shape: Any, ipc_handles: Mapping[str, Any],
                               empty_cache: bool = False) -> Any:
        """Colocated trainer: ``ipc_handles`` maps a GPU's UUID (``trainer_adapters.get_physical_gpu_id``)
        to ``torch.multiprocessing.reductions.reduce_tensor(weight)`` made on that GPU; the engine opens
        the handle for its own GPU and loads the tensor without a copy through the host."""
        if not self.device.startswith("cuda"):
            raise ValueError(f"update_weight_cuda_ipc needs a GPU engine; this engine runs on {self.device!r}")
        uuid = self._engine_gpu_uuid()
        if uuid not in ipc_handles:
            raise ValueError(f"no IPC handle for this engine's GPU {uuid} (handles for {sorted(ipc_handles)}): "
                             "the trainer rank holding the weight must share the engine's GPU")
        return self.engine.update_weight_cuda_ipc(name, dtype, list(shape), ipc_handles[uuid],
                                                  empty_cache=empty_cache)

    def update_weights_from_tensor(self, named_tensors: Any, weight_version: str | None = None,
                                   flush_cache: bool = True, check_finite: bool = False,
                                   load_format: str | None = None) -> Any:
        """``Engine.update_weights_from_tensor`` (SGLang's colocated call, what ``push_colocated`` sends):
        load (name, tensor) pairs; ``flush_cache=True`` completes the update. ``load_format`` is SGLang's
        keyword (verl passes it): None or "direct", else ValueError. Through Ray the tensors are
        serialized into this actor's process, then shared with the engine (CUDA IPC on GPU, shared memory on
        CPU); through ``LocalActor`` they are shared as they are."""
        return self.engine.update_weights_from_tensor(named_tensors, weight_version=weight_version,
                                                      flush_cache=flush_cache, check_finite=check_finite,
                                                      load_format=load_format)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    flush_cache = reset_prefix_cache

    def pause_generation(self, mode: str = "abort") -> Any:
        """Hold new requests; in-flight ones are aborted (default, as vLLM), ``retract``ed or kept ``in_place``."""
        return self.engine.pause_generation(mode)

    def resume_generation(self) -> Any:
        return self.engine.continue_generation()

    continue_generation = resume_generation

    # ---- weight sync: SGLang's bucketed update and checks --------------------------------------

    def update_weights_from_distributed(self, names: list[str], dtypes: list[Any], shapes: list[Any],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: str | None = None, load_format: str | None = None,
                                        check_finite: bool = False) -> Any:
        """Many tensors in one call; ``load_format="flattened_bucket"`` receives one flat buffer."""
        return self.engine.update_weights_from_distributed(
            names, dtypes, [list(s) for s in shapes], group_name=group_name, flush_cache=flush_cache,
            weight_version=weight_version, load_format=load_format, check_finite=check_finite)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                 load_format: str | None = None) -> Any:
        return self.engine.update_weights_from_disk(model_path, weight_version, load_format=load_format)

    def rollback_weights(self) -> Any:
        return self.engine.rollback_weights()

    # ---- colocation (OpenRLHF's hybrid engine: vllm_enable_sleep) ------------------------------

    def sleep(self, level: int = 1) -> dict[str, Any]:
        """OpenRLHF's call: give the memory back to the trainer (level 1 keeps the weights in host memory)."""
        return self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self.engine.wake_up(tags)

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self.engine.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self.engine.resume_memory_occupation(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def destroy_process_group(self, group_name: str = "weight_update_group") -> bool:
        return self.engine.destroy_process_group(group_name)

    def get_weight_version(self) -> str:
        return self.engine.get_weight_version()

    def update_weight_version(self, weight_version: str) -> str:
        return self.engine.update_weight_version(weight_version)

    def get_weight_state(self) -> dict[str, Any]:
        return self.engine.get_weight_state()

    def weights_fingerprint(self) -> str:
        return self.engine.weights_fingerprint()

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        return self.engine.get_weights_by_name(name, truncate_size)

    # ---- lifecycle ----------------------------------------------------------------------------

    def get_node_ip(self) -> str:
        """This actor's node address (for a trainer choosing ``master_address`` across nodes)."""
        try:
            import ray

            return ray.util.get_node_ip_address()
        except ImportError:
            import socket

            return socket.gethostbyname(socket.gethostname())

    def shutdown(self) -> None:
        self.engine.shutdown()

    def _engine_gpu_uuid(self) -> str:
        if self._gpu_uuid is None:
            import torch

            index = torch.device(self.device).index or 0
            self._gpu_uuid = str(torch.cuda.get_device_properties(index).uuid)
        return self._gpu_uuid


def _check_ranks(rank_offset: int, world_size: int, tp_size: int) -> None:
    """The engine's TP ranks ``rank_offset .. rank_offset + tp_size - 1`` must fit a group whose rank 0 is
    the trainer."""
    if rank_offset < 1:
        raise ValueError(f"rank_offset must be >= 1 (the trainer is rank 0 of the weight-update group; engine i "
                         f"of TP size t joins as i * t + 1), got {rank_offset}")
    if rank_offset + tp_size > world_size:
        raise ValueError(f"world_size {world_size} is too small: this engine's {tp_size} TP rank(s) join as ranks "
                         f"{rank_offset}..{rank_offset + tp_size - 1} of a group whose rank 0 is the trainer")
