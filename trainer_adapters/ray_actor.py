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
On Ray, calls run one at a time in submission order (weight-update announcements must stay in order),
except ``CONTROL_METHODS``, which run in their own concurrency group so that they answer while a
``generate`` is in progress.
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
                           "disable_log_stats", "max_logprobs", "logprobs_mode"})


def engine_options(model: str | None = None, **kwargs: Any) -> dict[str, Any]:
    """``Engine`` keyword arguments from our own names or vLLM's (``tensor_parallel_size``,
    ``gpu_memory_utilization``, ``max_model_len``, ``enable_prefix_caching``, ``enforce_eager``, ...)."""
    out: dict[str, Any] = {}
    if model is not None:
        out["model_path"] = str(model)
    for key, value in kwargs.items():
        if key in _VLLM_IGNORED:
            continue
        if key == "enable_prefix_caching":
            out["disable_radix_cache"] = not value
        elif key == "enforce_eager":
            out["disable_cuda_graph"] = bool(value)
        elif key in ("model", "pretrain", "model_path"):
            out["model_path"] = str(value)
        else:
            out[_VLLM_OPTIONS.get(key, key)] = value
    return out


# vLLM SamplingParams fields with no counterpart here: copying the rest silently would change the sampling
_VLLM_ONLY_SAMPLING = ("allowed_token_ids", "logit_bias", "bad_words", "truncate_prompt_tokens", "guided_decoding",
                       "structured_outputs", "logits_processors")


def to_sampling_params(params: Any) -> SamplingParams:
    """Our ``SamplingParams``, a dict of vLLM/SGLang field names, or a vLLM ``SamplingParams`` object
    (its fields that we share are copied; a vLLM-only field set away from its default is a ValueError)."""
    if params is None or isinstance(params, (SamplingParams, Mapping)):
        return SamplingParams.from_any(params)
    unsupported = [name for name in _VLLM_ONLY_SAMPLING if getattr(params, name, None) not in (None, [], {}, ())]
    if unsupported:
        raise ValueError(f"vLLM sampling parameters {unsupported} are not supported by this engine")
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
    return SamplingParams(**values)


class EngineActor:
    """Wraps one ``rollout.Engine``; the methods are OpenRLHF's ``LLMRayActor`` / ``WorkerWrap`` ones.

    ``EngineActor(model, seed=0, tensor_parallel_size=1, dtype="auto", device=None, **options)``;
    options are ``Engine`` options or vLLM engine arguments (see ``engine_options``).
    ``weight_sync_timeout`` (seconds) bounds the weight-update group's rendezvous and transfers.
    """

    CONTROL_METHODS = ("pause_generation", "resume_generation", "continue_generation",
                       "get_num_unfinished_requests", "get_weight_version", "get_weight_state", "ready",
                       "is_sleeping")

    def __init__(self, model: str | None = None, *args: Any, weight_sync_timeout: float | None = None,
                 **kwargs: Any) -> None:
        from rollout import Engine

        if args:
            raise ValueError("EngineActor takes the model path and keyword arguments only")
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

    def generate(self, prompt_token_ids: Sequence[Sequence[int]] | None = None, sampling_params: Any = None,
                 prompts: Any = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """vLLM's ``LLM.generate``: outputs in prompt order with ``.outputs[i].token_ids``, ``.text``,
        ``.logprobs[i][token_id].logprob``, ``.finish_reason``. ``sampling_params`` may be one or a
        list (one per prompt), each our ``SamplingParams``, a dict of vLLM names or a vLLM object."""
        if isinstance(sampling_params, (list, tuple)):
            sampling = [to_sampling_params(p) for p in sampling_params]
        else:
            sampling = to_sampling_params(sampling_params)
        if prompt_token_ids is not None and prompts is None:
            return self.engine.generate(prompt_token_ids=prompt_token_ids, sampling_params=sampling,
                                        use_tqdm=use_tqdm)
        return self.engine.generate(prompts, sampling, prompt_token_ids=prompt_token_ids, use_tqdm=use_tqdm)

    def chat(self, messages: Any, sampling_params: Any = None, use_tqdm: bool = False) -> list[RequestOutput]:
        return self.engine.chat(messages, to_sampling_params(sampling_params), use_tqdm=use_tqdm)

    def get_num_unfinished_requests(self) -> int:
        """Requests submitted to this engine and not finished yet (vLLM's name)."""
        return self.engine.get_num_unfinished_requests()

    # ---- weight sync: OpenRLHF's names ---------------------------------------------------------

    def init_process_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                           group_name: str, backend: str = "nccl", use_ray: bool = False,
                           timeout: float | None = None) -> bool:
        """Join the trainer's weight-update group: TP rank r joins as ``rank_offset + r`` (trainer = 0).
        Blocks until every member has joined. ``use_ray=True`` (ray.util.collective) is not supported;
        ``timeout`` defaults to the actor's ``weight_sync_timeout``."""
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

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> Any:
        return self.engine.update_weights_from_disk(model_path, weight_version)

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

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
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
