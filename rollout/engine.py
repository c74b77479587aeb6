"""The Python rollout API: ``Engine(model_path).generate(prompts, SamplingParams(...))``.

Generation goes through the ``TokenizerManager`` (``engine_inputs`` normalizes the arguments,
``engine_outputs`` waits or streams); every control and weight-update call sends one typed request from
``rollout.io_struct`` to the schedulers, where ``Scheduler.control_handlers`` maps its type to the code
that runs it (``rollout.weights.sync.WeightSync`` for weights).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from types import MappingProxyType
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence

from rollout import engine_outputs
from rollout.config import EngineConfig, ModelConfig, import_transformers
from rollout.dtypes import dtype_name
from rollout.engine_inputs import (ChatTemplateOptions, PromptItem, abort_ids, chat_prompt, chat_prompt_ids,
                                   check_sleep_level, check_wake_tags, conversations, normalize)
from rollout.io_struct import (BenchmarkReceiveReq, ContinueGenerationReq, ControlReq, DestroyProcessGroupReq,
                               FlushCacheReq, GetLoadReq, GetMemoryStateReq, GetStepStatsReq, GetWeightsByNameReq,
                               GetWeightStateReq, GetWeightVersionReq, InitProcessGroupReq, PauseGenerationReq,
                               ReleaseMemoryOccupationReq, ResumeMemoryOccupationReq, RollbackWeightsReq,
                               StartProfileReq, StopProfileReq, UpdateWeightReq, UpdateWeightsFromDiskReq,
                               UpdateWeightsFromDistributedReq, UpdateWeightsFromTensorReq, UpdateWeightVersionReq,
                               WeightsFingerprintReq)
from rollout.launcher import launch
from rollout.outputs import RequestOutput
from rollout.sampling_defaults import read_sampling_defaults
from rollout.sampling_params import SamplingParams
from rollout.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)


class Engine:
    """A generation engine: scheduler subprocess(es) per TP rank, a detokenizer, and this front end.

    ``Engine(model_path, tp_size=1, dtype="auto", device=None, **options)``; options are the fields of
    ``EngineConfig``. Use as a context manager or call ``shutdown()``; children also stop at interpreter
    exit and when this process dies. ``start_cancelled``: polled while the subprocesses start; once it returns
    True the start is abandoned (``rollout.launcher.StartCancelled``), nothing left behind (the HTTP server stopping
    while its engine loads). Implements ``rollout.engine_handle.EngineHandle``.
    """

    def __init__(self, model_path: str | None = None, *, model: str | None = None, tp_size: int = 1,
                 dtype: str = "auto", device: str | None = None, start_cancelled: Callable[[], bool] | None = None,
                 **options: Any) -> None:
        path = model_path or model
        if not path:
            raise ValueError("Engine needs a model path")
        unknown = set(options) - EngineConfig.field_names()
        if unknown:
            raise ValueError(f"unknown engine options: {sorted(unknown)}")
        self.config = EngineConfig(model_path=str(path), tp_size=tp_size, dtype=dtype, device=device or "auto",
                                   **options)
        self.model_config = ModelConfig.from_path(self.config.model_path)
        limit = self.model_config.max_position_embeddings
        if self.config.context_length is not None and self.config.context_length > limit:  # SGLang and vLLM refuse too
            raise ValueError(f"context_length {self.config.context_length} is longer than the model's "
                             f"max_position_embeddings ({limit})")
        if self.config.max_logprobs > self.model_config.vocab_size:  # vLLM refuses it too
            raise ValueError(f"max_logprobs ({self.config.max_logprobs}) is greater than the vocabulary size "
                             f"({self.model_config.vocab_size})")
        self.sampling_defaults = _model_sampling_defaults(self.config)
        self.tokenizer = None if self.config.skip_tokenizer_init else _load_tokenizer(self.config)
        self._procs = launch(self.config, self.tokenizer, start_cancelled)
        self.tokenizer_manager = TokenizerManager(self.config, self._procs.paths, self.model_config,
                                                  self.tokenizer, self._procs.context_len, self._procs.alive)
        self._closed = False
        self._ipc_handles: Any = None  # IpcHandleCache: what the engine ranks have mapped (ipc_protocol)
        self._finalizer = weakref.finalize(self, _shutdown, self.tokenizer_manager, self._procs)
        atexit.register(self._finalizer)

    # ---- generation ---------------------------------------------------------------------------

    def generate(self, prompts: Any = None, sampling_params: Any = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None, *, request_id: Any = None,
                 stream: bool = False, use_tqdm: bool = True) -> list[RequestOutput] | Iterator[RequestOutput]:
        """Generate for a batch (or one) of prompts: strings, token-id lists, or chat message lists.

        ``sampling_params`` is one SamplingParams/dict for all prompts or one per prompt. Returns a list of
        RequestOutput in prompt order; with ``stream=True`` an iterator of delta chunks (each chunk holds
        the tokens and text new since that request's previous chunk) in arrival order, whose ``close()`` (or
        dropping it, iterated or not) aborts the requests still running. Invalid input raises ValueError
        before anything is sent.
        """
        items = self._inputs(prompts, prompt_token_ids, sampling_params, request_id)
        if stream:
            return engine_outputs.stream(self.tokenizer_manager, items, owner=self)  # keeps the engine alive
        return engine_outputs.run_batch(self.tokenizer_manager, items, use_tqdm)

    async def async_generate(self, prompts: Any = None, sampling_params: Any = None,
                             prompt_token_ids: Sequence[Sequence[int]] | None = None, *, request_id: Any = None,
                             stream: bool = False) -> list[RequestOutput] | AsyncIterator[RequestOutput]:
        """``generate`` for asyncio callers (any event loop); with ``stream=True`` an async iterator."""
        items = self._inputs(prompts, prompt_token_ids, sampling_params, request_id)
        if stream:
            return engine_outputs.astream(self.tokenizer_manager, items, owner=self)
        return await engine_outputs.run_batch_async(self.tokenizer_manager, items)

    def chat(self, messages: Any, sampling_params: Any = None, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
             **kwargs: Any) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {role, content}) or a list of them; the template
        options are vLLM's ``LLM.chat`` ones (e.g. ``chat_template_kwargs={"enable_thinking": False}``, ``tools``
        for the template's tool list). A content may be a string or a list of OpenAI text parts."""
        options = ChatTemplateOptions(chat_template, add_generation_prompt, continue_final_message,
                                      dict(chat_template_kwargs or {}), tools)
        convs = conversations(messages)
        prompts = [dict(zip(("prompt", "prompt_token_ids"), chat_prompt(self.tokenizer, c, options))) for c in convs]
        return self.generate(prompts, sampling_params, **kwargs)  # RequestOutput.prompt: the rendered text, as vLLM

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            options: ChatTemplateOptions = ChatTemplateOptions()) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages, options)

    def get_tokenizer(self) -> Any:
        """vLLM's ``LLM.get_tokenizer()``: the Hugging Face tokenizer this engine encodes and decodes with; a
        ValueError for an engine started with ``skip_tokenizer_init`` (vLLM's message)."""
        if self.tokenizer is None:
            raise ValueError("Unable to get tokenizer because skip_tokenizer_init is True")
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the SamplingParams a request gets when it passes none, a new object each call: the library's
        defaults with the model's ``generation_config.json`` values over them (``sampling_defaults="model"``,
        the default; ``self.sampling_defaults`` holds those values), or the library's alone ("openai")."""
        return SamplingParams.from_any(self.sampling_defaults)

    def abort(self, request_id: str | Iterable[str]) -> bool:
        """Abort a request (all its samples) or, by its id ``<request_id>#<i>``, one sample of a request with
        n > 1; its outputs end with finish reason "abort". Several ids at once as vLLM's ``abort_request`` takes
        them (a list). False when nothing live has any of the ids."""
        return any([self.tokenizer_manager.abort(rid) for rid in abort_ids(request_id)])

    def get_num_unfinished_requests(self) -> int:
        """Requests submitted and not finished yet (vLLM's name; a request of ``n`` samples counts once)."""
        return sum(not state.finished for state in list(self.tokenizer_manager.states.values()))

    def _inputs(self, prompts: Any, prompt_token_ids: Any, sampling_params: Any, request_id: Any
                ) -> list[PromptItem]:
        """Every prompt tokenized and validated before anything is sent."""
        if self._closed:
            raise RuntimeError("the engine has been shut down")
        tm = self.tokenizer_manager
        items = [(text, ids if ids is not None else tm.tokenize(text), p, rid) for text, ids, p, rid in
                 normalize(prompts, prompt_token_ids, sampling_params, request_id,
                           lambda messages: chat_prompt(self.tokenizer, messages), self.sampling_defaults)]
        for _, ids, p, _ in items:
            tm.validate(ids, p)
        return items

    # ---- control ------------------------------------------------------------------------------

    def flush_cache(self) -> bool:
        """Drop the prefix cache (False if running requests still hold entries); also completes an
        open per-tensor weight update."""
        return self._call(FlushCacheReq())

    reset_prefix_cache = flush_cache

    def pause_generation(self, mode: str = "abort") -> Any:
        """Hold new requests; ``abort`` in-flight ones, ``retract`` them (re-run later) or keep them ``in_place``.

        With ``abort`` it returns once every request submitted before the call has its final output (finish
        reason "abort" with what it generated so far), as SGLang's and vLLM's pause return only when no request
        is left in flight: ``get_num_unfinished_requests()`` is then 0 and the callers' ``generate`` calls
        have returned."""
        live = self.tokenizer_manager.unfinished() if mode == "abort" else []
        result = self._call(PauseGenerationReq(mode=mode))
        self.tokenizer_manager.wait_finished(live)
        return result

    def continue_generation(self) -> Any:
        return self._call(ContinueGenerationReq())

    resume_generation = continue_generation

    def get_server_info(self) -> dict[str, Any]:
        return {"context_len": self._procs.context_len, "max_total_tokens": self._procs.num_slots, **self.get_load()}

    def get_load(self, async_op: bool = False) -> Any:
        """Scheduler counters: running, waiting, kv_used, kv_total, retractions, cached_tokens, prefill_tokens,
        gen_tokens, weight_version. ``async_op=True`` returns a Future, so a caller (the /metrics endpoint)
        can stop waiting while the scheduler is busy, e.g. receiving weights."""
        return self._call(GetLoadReq(), async_op)

    def get_step_stats(self, reset: bool = False) -> dict[str, Any]:
        """Scheduler timings (decode steps by batch size, prefill totals, decode steps per CUDA graph variant in
        ``graph_replays``); ``reset`` starts a new window."""
        return self._call(GetStepStatsReq(reset=reset))

    def start_profile(self, output_dir: str | None = None, start_step: int | None = None,
                      num_steps: int | None = None, activities: list[str] | None = None, with_stack: bool = False,
                      record_shapes: bool = False, profile_id: str | None = None) -> dict[str, Any]:
        """SGLang's call: record a torch.profiler trace of the schedulers' steps, one file per TP rank
        (``{output_dir}/{profile_id}-TP-{rank}.trace.json.gz``; ``output_dir`` defaults to
        ``$ROLLOUT_TORCH_PROFILER_DIR`` or /tmp, ``profile_id`` to the time in seconds). It starts at scheduler
        step ``start_step`` (``get_step_stats()["launched_steps"]`` counts them; None: the next step) and ends
        after ``num_steps`` steps or at ``stop_profile``. ``activities``: "CPU", "GPU" (default: both on CUDA). Returns
        ``{"traces": [paths], "start_step": n}``."""
        output_dir = os.path.abspath(output_dir or os.environ.get("ROLLOUT_TORCH_PROFILER_DIR") or "/tmp")
        return self._call(StartProfileReq(output_dir=output_dir, start_step=start_step, num_steps=num_steps,
                                          activities=activities, with_stack=with_stack, record_shapes=record_shapes,
                                          profile_id=profile_id or f"{time.time():.0f}"))  # one name for all ranks

    def stop_profile(self) -> dict[str, Any]:
        """End the profile now and write the traces -> ``{"trace": rank 0's path, "steps": steps recorded}``."""
        return self._call(StopProfileReq())

    # ---- colocation: sleep / wake_up (docs/colocation.md; needs enable_memory_saver=True) -------

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """SGLang's call: release the memory of ``tags`` ("weights", "kv_cache", "cuda_graph"; None: all) once no
        request is in flight. Released weights are not kept: push new ones after resuming them."""
        return self._call(ReleaseMemoryOccupationReq(tags=tags))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """SGLang's call: take back the memory of ``tags`` (None: every released tag), at the same addresses."""
        return self._call(ResumeMemoryOccupationReq(tags=tags))

    def sleep(self, level: int = 1) -> dict[str, Any]:
        """vLLM's call: level 1 keeps the weights in host memory and drops the KV cache; level 2 drops both (the
        trainer pushes new weights after ``wake_up(tags=["weights"])``). Requests sent while asleep fail. As in
        vLLM, sleeping again is a warning and does nothing (SGLang's ``release_memory_occupation`` refuses)."""
        check_sleep_level(level)
        state = self._call(GetMemoryStateReq())
        if state["sleeping"]:
            logger.warning("the engine is already sleeping (released: %s): sleep() does nothing", state["released"])
            return state
        return self._call(ReleaseMemoryOccupationReq(tags=None, keep_weights=level == 1))

    def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        """vLLM's call: resume ``tags`` ("weights", "kv_cache"; None: everything released). As in vLLM, waking an
        awake engine, or naming a tag that is not asleep, is a warning and does nothing (SGLang's
        ``resume_memory_occupation`` refuses); unknown tags and an empty list are a ValueError."""
        check_wake_tags(tags)
        state = self._call(GetMemoryStateReq())
        if all(t in _WAKE_TAGS for t in tags or ()):  # unknown tags: resume_memory_occupation's ValueError
            awake = [t for t in tags or () if t not in state["released"]]
            if not state["sleeping"] or awake:
                logger.warning("wake_up(%s): not asleep (released: %s); nothing to do", tags, state["released"])
                return state
        return self.resume_memory_occupation(tags)

    def is_sleeping(self) -> bool:
        return self._call(GetMemoryStateReq())["sleeping"]

    # ---- weight sync (docs/weight_sync.md) ------------------------------------------------------

    def init_process_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                           group_name: str = "weight_update_group", backend: str = "nccl",
                           timeout: float | None = None, async_op: bool = False) -> Any:
        """Join a weight-update group: TP rank r joins as ``rank_offset + r`` (the trainer is rank 0).

        Blocks until the trainer joins too, so a trainer holding this engine in its own process passes
        ``async_op=True`` (a Future is returned), then calls ``weight_sync.init_process_group``.
        """
        return self._call(InitProcessGroupReq(master_address=master_address, master_port=master_port,
                                              rank_offset=rank_offset, world_size=world_size, group_name=group_name,
                                              backend=backend, timeout=timeout), async_op)

    def destroy_process_group(self, group_name: str = "weight_update_group", async_op: bool = False) -> Any:
        """Leave a weight-update group. On NCCL this waits for the other members to leave too, so a
        trainer holding the engine in-process passes ``async_op=True`` and then destroys its side."""
        return self._call(DestroyProcessGroupReq(group_name=group_name), async_op)

    init_weights_update_group = init_process_group        # SGLang's Engine names (same arguments, same order)
    destroy_weights_update_group = destroy_process_group

    def update_weight(self, name: str, dtype: Any, shape: Any, empty_cache: bool = False,
                      async_op: bool = False) -> Any:
        """OpenRLHF's per-tensor update: receive one broadcast from rank 0 and load it in place.

        ``empty_cache=True`` (OpenRLHF passes it with the last parameter) completes the update: the
        prefix cache is flushed and the weight version bumped. Until then new requests are held.
        """
        return self._call(UpdateWeightReq(name=name, dtype=dtype_name(dtype), shape=list(shape),
                                          empty_cache=empty_cache), async_op)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[Any], shapes: list[Any],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: str | None = None, load_format: str | None = None,
                                        check_finite: bool = False, async_op: bool = False) -> Any:
        """SGLang's bucketed update: receive ``names`` broadcast by rank 0 (one flat buffer with
        ``load_format="flattened_bucket"``) and load them. ``flush_cache=True`` completes the update."""
        return self._call(UpdateWeightsFromDistributedReq(
            names=list(names), dtypes=[dtype_name(d) for d in dtypes], shapes=[list(s) for s in shapes],
            group_name=group_name, flush_cache=flush_cache, weight_version=weight_version, load_format=load_format,
            check_finite=check_finite), async_op)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                 async_op: bool = False, *, load_format: str | None = None) -> Any:
        """Reload every parameter from a checkpoint directory (validated against its headers first).
        ``load_format``: SGLang's keyword; None, "auto" and "safetensors" read the safetensors files."""
        if load_format not in (None, "auto", "safetensors"):
            raise ValueError(f"unsupported load_format {load_format!r} (use None, 'auto' or 'safetensors')")
        return self._call(UpdateWeightsFromDiskReq(model_path=str(model_path), weight_version=weight_version),
                          async_op)

    def update_weights_from_tensor(self, named_tensors: Any, weight_version: str | None = None,
                                   flush_cache: bool = True, check_finite: bool = False,
                                   async_op: bool = False, *, load_format: str | None = None) -> Any:
        """Load tensors from a colocated trainer: CUDA IPC handles on GPU, one shared-memory buffer on CPU.
        ``load_format``: SGLang's keyword; None and "direct" load the (name, tensor) pairs as given."""
        if load_format not in (None, "direct"):
            raise ValueError(f"unsupported load_format {load_format!r}: pass (name, tensor) pairs with None or "
                             "'direct' (a flattened bucket goes through update_weights_from_distributed)")
        from rollout.weights.ipc_protocol import IpcHandleCache
        from rollout.weights.shared_tensors import share

        named = list(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
        self._ipc_handles = self._ipc_handles or IpcHandleCache(receivers=self.config.tp_size)
        specs, payload, done = share(named, self._ipc_handles, ends_push=flush_cache or weight_version is not None)
        try:
            fut = self._call(UpdateWeightsFromTensorReq(specs=specs, payload=payload, flush_cache=flush_cache,
                                                        weight_version=weight_version, check_finite=check_finite), True)
        except BaseException:
            done(False)  # not sent (the engine is shut down or dead): free the shared segment now
            raise
        released = threading.Event()

        def release(f: Any) -> None:
            try:
                done(not f.cancelled() and f.exception() is None)
            finally:
                released.set()

        fut.add_done_callback(release)  # runs in the receiver thread, once the engine has replied
        if async_op:
            return fut
        try:
            return fut.result()
        finally:
            if fut.done():
                released.wait()  # a returning call has freed what it shared

    def update_weight_cuda_ipc(self, name: str, dtype: Any, shape: Any, ipc_handle: Any, empty_cache: bool = False,
                               async_op: bool = False) -> Any:
        """Load one tensor that a colocated trainer shares by CUDA IPC, without a copy through the host.

        ``ipc_handle`` is ``torch.multiprocessing.reductions.reduce_tensor(t)`` of a tensor on this
        engine's GPU (OpenRLHF's ``update_weight_cuda_ipc`` picks it by GPU UUID); its device index is
        replaced by this engine's (``ipc_args_on_device``). The trainer keeps ``t`` alive until the call
        returns. ``empty_cache=True`` completes the update, as in ``update_weight``.
        """
        import torch

        from rollout.weights.shared_tensors import ipc_args_on_device

        args = ipc_args_on_device(ipc_handle, torch.device(self.config.resolved_device).index or 0)
        return self._call(UpdateWeightsFromTensorReq(specs=[(name, dtype_name(dtype), list(shape))],
                                                     payload=("cuda_ipc", [args]), flush_cache=empty_cache), async_op)

    def rollback_weights(self) -> Any:
        """Restore the copy kept at the start of the last update (needs ``keep_weight_copy=True``)."""
        return self._call(RollbackWeightsReq())

    def update_weight_version(self, weight_version: str) -> str:
        return self._call(UpdateWeightVersionReq(weight_version=str(weight_version)))

    def get_weight_version(self) -> str:
        return self._call(GetWeightVersionReq())

    def get_weight_state(self) -> dict[str, Any]:
        """{"state": consistent | updating | inconsistent, "reason", "updated", "total", ...}."""
        return self._call(GetWeightStateReq())

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first ``truncate_size`` rows of an HF-named parameter (values of a 1-D one), gathered over TP ranks:
        SGLang's ``param.tolist()[:truncate_size]``, transformers' ``get_parameter(name)[:truncate_size]``."""
        if not isinstance(name, str):  # the scheduler failed on it (AttributeError): a RuntimeError, not the caller's
            raise ValueError(f"name must be a parameter name (a string), got {name!r}")
        return self._call(GetWeightsByNameReq(name=name, truncate_size=truncate_size))

    def weights_fingerprint(self) -> str:
        """Fingerprint of the served weights in HF naming and layout; equals ``weight_sync.fingerprint``
        of the trainer's model (cast to the engine's dtype) exactly when the weights are equal."""
        return self._call(WeightsFingerprintReq())

    def benchmark_receive(self, nbytes: int, num_chunks: int, group_name: str = "weight_update_group",
                          async_op: bool = False) -> Any:
        """Receive raw broadcasts without loading them: the transport ceiling for the weight-sync benchmark."""
        return self._call(BenchmarkReceiveReq(nbytes=nbytes, num_chunks=num_chunks, group_name=group_name), async_op)

    def _call(self, req: ControlReq, async_op: bool = False) -> Any:
        fut = self.tokenizer_manager.control_async(req)
        return fut if async_op else fut.result()

    # ---- lifecycle ----------------------------------------------------------------------------

    @property
    def context_len(self) -> int:
        return self._procs.context_len

    def shutdown(self) -> None:
        """Stop every subprocess and release the IPC directory (idempotent)."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


_WAKE_TAGS = ("weights", "kv_cache", "cuda_graph")  # rollout.model_executor.memory_saver.TAGS (not imported here: torch)


def _model_sampling_defaults(config: EngineConfig) -> Mapping[str, Any]:
    """The model's sampling defaults (read-only) under ``sampling_defaults="model"``, else {}; ValueError at start
    when ``generation_config.json`` holds a value SamplingParams refuses (rather than at every request)."""
    if config.sampling_defaults != "model":
        return MappingProxyType({})
    values = read_sampling_defaults(config.model_path)
    try:
        SamplingParams.from_any(values)
    except ValueError as e:
        raise ValueError(f"generation_config.json in {config.model_path!r}: {e} (sampling_defaults='openai' "
                         "ignores the file's sampling values)") from None
    return MappingProxyType(values)


def _load_tokenizer(config: EngineConfig) -> Any:
    AutoTokenizer = import_transformers().AutoTokenizer  # two engines may start at once, from two threads

    try:
        return AutoTokenizer.from_pretrained(config.tokenizer_path or config.model_path)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"could not load a tokenizer from {config.tokenizer_path or config.model_path!r}: {e}")


def _shutdown(tokenizer_manager: TokenizerManager, procs: Any) -> None:
    try:
        tokenizer_manager.close()
    finally:  # the children are stopped and reaped, and the IPC directory removed, whatever close raised
        procs.stop()
