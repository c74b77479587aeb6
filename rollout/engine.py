"""The Python rollout API: ``Engine(model_path).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import asyncio
import atexit
import queue
import time
import weakref
from typing import Any, AsyncIterator, Iterator, Sequence

from rollout.config import EngineConfig, ModelConfig
from rollout.launcher import launch
from rollout.outputs import RequestOutput
from rollout.sampling_params import SamplingParams
from rollout.tokenizer_manager import ReqState, TokenizerManager

PromptInput = Any


class Engine:
    """A generation engine: scheduler subprocess(es) per TP rank, a detokenizer, and this front end.

    ``Engine(model_path, tp_size=1, dtype="auto", device=None, **options)``; options are the fields of
    ``EngineConfig``. Use as a context manager or call ``shutdown()``; children also stop at interpreter
    exit and when this process dies.
    """

    def __init__(self, model_path: str | None = None, *, model: str | None = None, tp_size: int = 1,
                 dtype: str = "auto", device: str | None = None, **options: Any) -> None:
        path = model_path or model
        if not path:
            raise ValueError("Engine needs a model path")
        unknown = set(options) - EngineConfig.field_names()
        if unknown:
            raise ValueError(f"unknown engine options: {sorted(unknown)}")
        self.config = EngineConfig(model_path=str(path), tp_size=tp_size, dtype=dtype, device=device or "auto",
                                   **options)
        self.model_config = ModelConfig.from_path(self.config.model_path)
        self.tokenizer = None if self.config.skip_tokenizer_init else _load_tokenizer(self.config)
        self._procs = launch(self.config)
        self.tokenizer_manager = TokenizerManager(self.config, self._procs.paths, self.model_config,
                                                  self.tokenizer, self._procs.context_len, self._procs.alive)
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self.tokenizer_manager, self._procs)
        atexit.register(self._finalizer)

    # ---- generation ---------------------------------------------------------------------------

    def generate(self, prompts: PromptInput = None, sampling_params: Any = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None, *, request_id: Any = None,
                 stream: bool = False, use_tqdm: bool = True) -> list[RequestOutput] | Iterator[RequestOutput]:
        """Generate for a batch (or one) of prompts: strings, token-id lists, or chat message lists.

        ``sampling_params`` is one SamplingParams/dict for all prompts or one per prompt. Returns a list of
        RequestOutput in prompt order; with ``stream=True`` an iterator of delta chunks (each chunk holds
        the tokens and text new since that request's previous chunk) in arrival order.
        Invalid input raises ValueError before anything is sent.
        """
        items = self._normalize(prompts, prompt_token_ids, sampling_params, request_id)
        if stream:
            return self._stream(items)
        return self._run_batch(items, use_tqdm)

    def chat(self, messages: Any, sampling_params: Any = None, **kwargs: Any) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {role, content}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([self.apply_chat_template(c) for c in convs], sampling_params, **kwargs)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    async def async_generate(self, prompts: PromptInput = None, sampling_params: Any = None,
                             prompt_token_ids: Sequence[Sequence[int]] | None = None, *, request_id: Any = None,
                             stream: bool = False) -> list[RequestOutput] | AsyncIterator[RequestOutput]:
        """``generate`` for asyncio callers (any event loop); with ``stream=True`` an async iterator."""
        items = self._normalize(prompts, prompt_token_ids, sampling_params, request_id)
        if stream:
            return self._astream(items)
        loop = asyncio.get_running_loop()
        futures = []
        states = []
        try:
            for prompt, ids, params, rid in items:
                fut = loop.create_future()
                futures.append(fut)
                sink = _future_sink(loop, fut)
                states.append(self.tokenizer_manager.submit(prompt, ids, params, sink, rid))
            await asyncio.gather(*futures)
        except BaseException:
            for state in states:
                self.tokenizer_manager.abort(state.rid)
            raise
        return [self._result(state) for state in states]

    def abort(self, request_id: str) -> None:
        self.tokenizer_manager.abort(request_id)

    # ---- control ------------------------------------------------------------------------------

    def flush_cache(self) -> bool:
        """Drop the prefix cache (False if running requests still hold entries); also completes an
        open per-tensor weight update."""
        return self.tokenizer_manager.control("flush_cache")

    reset_prefix_cache = flush_cache

    def get_weight_version(self) -> str:
        return self.tokenizer_manager.control("get_weight_version")

    def get_server_info(self) -> dict[str, Any]:
        load = self.tokenizer_manager.control("get_load")
        return {"context_len": self._procs.context_len, "max_total_tokens": self._procs.num_slots, **load}

    def get_step_stats(self, reset: bool = False) -> dict[str, Any]:
        """Scheduler timings (decode steps by batch size, prefill totals); ``reset`` starts a new window."""
        return self.tokenizer_manager.control("get_step_stats", reset=reset)

    # ---- weight sync (DESIGN.md §6) ------------------------------------------------------------

    def init_process_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                           group_name: str = "weight_update_group", backend: str = "nccl",
                           timeout: float | None = None, async_op: bool = False) -> Any:
        """Join a weight-update group: TP rank r joins as ``rank_offset + r`` (the trainer is rank 0).

        Blocks until the trainer joins too, so a trainer holding this engine in its own process passes
        ``async_op=True`` (a Future is returned), then calls ``weight_sync.init_process_group``.
        """
        return self._call("init_process_group", async_op, master_address=master_address, master_port=master_port,
                          rank_offset=rank_offset, world_size=world_size, group_name=group_name, backend=backend,
                          timeout=timeout)

    def destroy_process_group(self, group_name: str = "weight_update_group", async_op: bool = False) -> Any:
        """Leave a weight-update group. On NCCL this waits for the other members to leave too, so a
        trainer holding the engine in-process passes ``async_op=True`` and then destroys its side."""
        return self._call("destroy_process_group", async_op, group_name=group_name)

    def update_weight(self, name: str, dtype: Any, shape: Any, empty_cache: bool = False,
                      async_op: bool = False) -> Any:
        """OpenRLHF's per-tensor update: receive one broadcast from rank 0 and load it in place.

        ``empty_cache=True`` (OpenRLHF passes it with the last parameter) completes the update: the
        prefix cache is flushed and the weight version bumped. Until then new requests are held.
        """
        return self._call("update_weight", async_op, name=name, dtype=_dtype_str(dtype), shape=list(shape),
                          empty_cache=empty_cache)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[Any], shapes: list[Any],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: str | None = None, load_format: str | None = None,
                                        check_finite: bool = False, async_op: bool = False) -> Any:
        """SGLang's bucketed update: receive ``names`` broadcast by rank 0 (one flat buffer with
        ``load_format="flattened_bucket"``) and load them. ``flush_cache=True`` completes the update."""
        return self._call("update_weights_from_distributed", async_op, names=list(names),
                          dtypes=[_dtype_str(d) for d in dtypes], shapes=[list(s) for s in shapes],
                          group_name=group_name, flush_cache=flush_cache, weight_version=weight_version,
                          load_format=load_format, check_finite=check_finite)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> Any:
        """Reload every parameter from a checkpoint directory (validated against its headers first)."""
        return self._call("update_weights_from_disk", False, model_path=str(model_path),
                          weight_version=weight_version)

    def update_weights_from_tensor(self, named_tensors: Any, weight_version: str | None = None,
                                   flush_cache: bool = True, check_finite: bool = False,
                                   async_op: bool = False) -> Any:
        """Load tensors from a colocated trainer: CUDA IPC handles on GPU, one shared-memory buffer on CPU."""
        from rollout.shared_tensors import share

        named = list(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
        specs, payload, cleanup = share(named)
        fut = self.tokenizer_manager.control_async("update_weights_from_tensor", specs=specs, payload=payload,
                                                   flush_cache=flush_cache, weight_version=weight_version,
                                                   check_finite=check_finite)
        fut.add_done_callback(lambda _: cleanup())
        return fut if async_op else fut.result()

    def rollback_weights(self) -> Any:
        """Restore the copy kept at the start of the last update (needs ``keep_weight_copy=True``)."""
        return self._call("rollback_weights", False)

    def pause_generation(self, mode: str = "abort") -> Any:
        """Hold new requests; ``abort`` in-flight ones, ``retract`` them (re-run later) or keep them ``in_place``."""
        return self._call("pause_generation", False, mode=mode)

    def continue_generation(self) -> Any:
        return self._call("continue_generation", False)

    resume_generation = continue_generation

    def update_weight_version(self, weight_version: str) -> str:
        return self._call("update_weight_version", False, weight_version=str(weight_version))

    def get_weight_state(self) -> dict[str, Any]:
        """{"state": consistent | updating | inconsistent, "reason", "updated", "total", ...}."""
        return self._call("get_weight_state", False)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first ``truncate_size`` values of an HF-named parameter, gathered over TP ranks."""
        return self._call("get_weights_by_name", False, name=name, truncate_size=truncate_size)

    def weights_fingerprint(self) -> str:
        """Fingerprint of the served weights in HF naming and layout; equals ``weight_sync.fingerprint``
        of the trainer's model (cast to the engine's dtype) exactly when the weights are equal."""
        return self._call("weights_fingerprint", False)

    def benchmark_receive(self, nbytes: int, num_chunks: int, group_name: str = "weight_update_group",
                          async_op: bool = False) -> Any:
        """Receive raw broadcasts without loading them: the transport ceiling for ``weight_sync.bench``."""
        return self._call("benchmark_receive", async_op, nbytes=nbytes, num_chunks=num_chunks, group_name=group_name)

    def _call(self, op: str, async_op: bool, **kwargs: Any) -> Any:
        fut = self.tokenizer_manager.control_async(op, **kwargs)
        return fut if async_op else fut.result()

    @property
    def context_len(self) -> int:
        return self._procs.context_len

    # ---- lifecycle ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every subprocess and release the IPC directory (idempotent)."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- internals ----------------------------------------------------------------------------

    def _normalize(self, prompts: PromptInput, prompt_token_ids: Any, sampling_params: Any,
                   request_id: Any) -> list[tuple[str | None, list[int] | None, SamplingParams, str | None]]:
        if self._closed:
            raise RuntimeError("the engine has been shut down")
        if prompt_token_ids is not None:
            if prompts is not None:
                raise ValueError("pass prompts or prompt_token_ids, not both")
            if not isinstance(prompt_token_ids, (list, tuple)):
                raise ValueError(f"prompt_token_ids must be a list of token-id lists, got {type(prompt_token_ids).__name__}")
            if prompt_token_ids and not isinstance(prompt_token_ids[0], (list, tuple)):
                prompt_token_ids = [prompt_token_ids]
            if not all(isinstance(ids, (list, tuple)) for ids in prompt_token_ids):
                raise ValueError("prompt_token_ids must be one list of token ids or a list of them")
            pairs = [(None, list(ids)) for ids in prompt_token_ids]
        else:
            if prompts is None:
                raise ValueError("no prompts given")
            if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
                prompts = [prompts]
            pairs = [self._prompt_pair(p) for p in prompts]
        if not pairs:
            raise ValueError("no prompts given")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(pairs):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(pairs)} prompts")
            params = [SamplingParams.from_any(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_any(sampling_params)] * len(pairs)
        rids = _request_ids(request_id, len(pairs))
        tm = self.tokenizer_manager
        items = [(text, ids if ids is not None else tm.tokenize(text), p, rid)
                 for (text, ids), p, rid in zip(pairs, params, rids)]
        for _, ids, p, _ in items:  # validate everything before sending anything
            tm.validate(ids, p)
        return items

    def _prompt_pair(self, prompt: Any) -> tuple[str | None, list[int] | None]:
        if isinstance(prompt, str):
            return prompt, None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], None
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            return None, self.apply_chat_template(list(prompt))
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def _run_batch(self, items: list, use_tqdm: bool) -> list[RequestOutput]:
        done: queue.Queue = queue.Queue()
        states: list[ReqState] = []
        try:
            for prompt, ids, params, rid in items:
                states.append(self.tokenizer_manager.submit(prompt, ids, params, _finish_sink(done), rid))
            _wait_all(done, len(states), use_tqdm and len(states) > 1)
        except BaseException:
            for state in states:
                self.tokenizer_manager.abort(state.rid)
            raise
        return [self._result(state) for state in states]

    def _stream(self, items: list) -> Iterator[RequestOutput]:
        """Submit now (like any request), then iterate over delta chunks as they arrive."""
        updates: queue.Queue = queue.Queue()
        states = [self.tokenizer_manager.submit(prompt, ids, params, updates.put, rid, stream=True)
                  for prompt, ids, params, rid in items]
        return self._iterate(states, updates)

    def _iterate(self, states: list[ReqState], updates: queue.Queue) -> Iterator[RequestOutput]:
        try:
            remaining = len(states)
            while remaining:
                chunk = self._chunk(updates.get())
                if chunk is not None:
                    remaining -= chunk.finished
                    yield chunk
        finally:
            for state in states:
                if not state.finished:
                    self.tokenizer_manager.abort(state.rid)

    def _astream(self, items: list) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        sink = lambda state: loop.call_soon_threadsafe(updates.put_nowait, state)  # noqa: E731
        states = [self.tokenizer_manager.submit(prompt, ids, params, sink, rid, stream=True)
                  for prompt, ids, params, rid in items]
        return self._aiterate(states, updates)

    async def _aiterate(self, states: list[ReqState], updates: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        try:
            remaining = len(states)
            while remaining:
                chunk = self._chunk(await updates.get())
                if chunk is not None:
                    remaining -= chunk.finished
                    yield chunk
        finally:
            for state in states:
                if not state.finished:
                    self.tokenizer_manager.abort(state.rid)

    def _chunk(self, state: ReqState) -> RequestOutput | None:
        if state.closed:
            return None
        if state.error is not None:
            _raise(state)
        out = self.tokenizer_manager.build_output(state, delta=True)
        state.closed = out.finished
        return out

    def _result(self, state: ReqState) -> RequestOutput:
        if state.error is not None:
            _raise(state)
        return self.tokenizer_manager.build_output(state)

    # ---- for the HTTP server ----

    def get_load(self, async_op: bool = False) -> Any:
        """Scheduler counters: running, waiting, kv_used, kv_total, retractions, cached_tokens, prefill_tokens,
        gen_tokens, weight_version. ``async_op=True`` returns a Future, so a caller (the /metrics endpoint)
        can stop waiting while the scheduler is busy, e.g. receiving weights."""
        return self._call("get_load", async_op)

    # ---- for trainer adapters ----

    def get_num_unfinished_requests(self) -> int:
        """Requests submitted and not finished yet (vLLM's name; a request of ``n`` samples counts once)."""
        return sum(not state.finished for state in list(self.tokenizer_manager.states.values()))

    def update_weight_cuda_ipc(self, name: str, dtype: Any, shape: Any, ipc_handle: Any, empty_cache: bool = False,
                               async_op: bool = False) -> Any:
        """Load one tensor that a colocated trainer shares by CUDA IPC, without a copy through the host.

        ``ipc_handle`` is ``torch.multiprocessing.reductions.reduce_tensor(t)`` of a tensor on this
        engine's GPU (OpenRLHF's ``update_weight_cuda_ipc`` picks it by GPU UUID); the device index in it
        is replaced by this engine's, since the trainer may number its GPUs differently. The trainer keeps
        ``t`` alive until the call returns. ``empty_cache=True`` completes the update, as in ``update_weight``.
        """
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        func, args = ipc_handle
        if func is not rebuild_cuda_tensor:
            raise ValueError("ipc_handle must come from reduce_tensor() of a CUDA tensor")
        args = list(args)
        args[6] = torch.device(self.config.resolved_device).index or 0  # storage_device
        return self._call("update_weights_from_tensor", async_op, specs=[(name, _dtype_str(dtype), list(shape))],
                          payload=("cuda_ipc", [tuple(args)]), flush_cache=empty_cache, weight_version=None,
                          check_finite=False)


def _request_ids(request_id: Any, count: int) -> list[str | None]:
    """One request id (or None: a fresh one) per prompt from ``request_id``: None, a string for one prompt,
    or a list of distinct strings, one per prompt."""
    if request_id is None:
        return [None] * count
    if isinstance(request_id, str):
        if count > 1:
            raise ValueError(f"request_id: one id for {count} prompts; pass a list of {count} ids")
        return [request_id]
    if not isinstance(request_id, (list, tuple)):
        raise ValueError(f"request_id must be a string or a list of strings, got {request_id!r}")
    if len(request_id) != count:
        raise ValueError(f"request_id: got {len(request_id)} ids for {count} prompts")
    if not all(isinstance(r, str) and r for r in request_id) or len(set(request_id)) != count:
        raise ValueError(f"request_id must be distinct, non-empty strings, got {list(request_id)!r}")
    return list(request_id)


def _dtype_str(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _raise(state: ReqState) -> None:
    exc = ValueError if state.error_type == "ValueError" else RuntimeError
    raise exc(f"request {state.rid}: {state.error}")


def _finish_sink(done: queue.Queue):
    def sink(state: ReqState) -> None:
        if state.finished:
            done.put(state)
    return sink


def _future_sink(loop: asyncio.AbstractEventLoop, fut: asyncio.Future):
    def resolve() -> None:
        if not fut.done():
            fut.set_result(None)

    def sink(state: ReqState) -> None:
        if state.finished:
            loop.call_soon_threadsafe(resolve)
    return sink


def _wait_all(done: queue.Queue, total: int, show: bool) -> None:
    """Block until ``total`` requests finished, with a tqdm bar showing output tokens/s."""
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
    start, tokens = time.monotonic(), 0
    for _ in range(total):
        state = done.get()
        tokens += sum(len(s.token_ids) for s in state.seqs)
        if bar is not None:
            bar.set_postfix_str(f"out {tokens / max(time.monotonic() - start, 1e-9):.1f} tok/s", refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()


def _load_tokenizer(config: EngineConfig) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(config.tokenizer_path or config.model_path)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"could not load a tokenizer from {config.tokenizer_path or config.model_path!r}: {e}")


def _shutdown(tokenizer_manager: TokenizerManager, procs: Any) -> None:
    tokenizer_manager.close()
    procs.stop()
