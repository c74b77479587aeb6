"""Owns the model, its KV memory and attention backend on one TP rank; runs forwards and sampling."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from rollout.attention.base import AttentionBackend
from rollout.attention.common import AttentionSpec
from rollout.attention.registry import GPU_KERNEL_DTYPES, create_attention_backend
from rollout.config import EngineConfig, ModelConfig, kv_cache_torch_dtype, resolve_torch_dtype
from rollout.device_copy import list_to_device, to_device
from rollout.distributed import TPGroup
from rollout.layers.logits_processor import PromptLogprobs, prompt_logprobs
from rollout.layers.sampler import Sampler, SamplerOutput
from rollout.layers.sampling_info import SamplingBatchInfo, SamplingRow
from rollout.mem_cache.kv_pool import KVPool, ReqToTokenPool, SlotAllocator
from rollout.mem_cache.routed_experts import RoutedExpertsPool
from rollout.model_executor.forward_batch import ForwardBatch, ForwardMode, SharedPrefixes
from rollout.model_executor.memory_saver import create_memory_saver, unique_tensors
from rollout.models.loader import build_model

logger = logging.getLogger(__name__)


def use_fused_kernels(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """The fused kernels (FlashInfer norm / activation, Triton rope + KV store and sampling) run for float16 and
    bfloat16 models on CUDA with the ``gpu`` extra (``config.fused_kernels``); a float32 model runs the torch
    path, since FlashInfer's kernels take half-precision tensors only."""
    return (config.fused_kernels and device.type == "cuda" and dtype in GPU_KERNEL_DTYPES
            and _has_module("flashinfer") and _has_module("triton"))


@dataclass
class StepInput:
    """The tokens one forward computes, flattened over requests (host lists, built by the scheduler).

    ``input_ids`` is None in decode: each request's input is its newest token, which may not have
    reached the host yet (overlap scheduling), so the runner reads it from ``ModelRunner.last_token_ids``.
    In both modes ``out_slots`` (the new tokens' slots) need only be in the host request table: the runner
    writes them to the device one at (``rows``, ``positions``) with the step's own inputs, one write a step.
    """

    mode: ForwardMode
    rows: list[int]
    input_ids: list[int] | None
    positions: list[int]
    out_slots: torch.Tensor
    seq_lens: list[int]
    extend_lens: list[int]
    prompt_logprobs: "PromptLogprobsRequest | None" = None
    shared_prefixes: SharedPrefixes | None = None  # decode rows sharing a cached prefix (cascade decode)
    balanced_decode: bool = False  # decode: the requests cut into pieces by length (wants_balanced_decode)

    def decode_pack(self, pin: bool = False) -> torch.Tensor:
        """Host int64 [4, B], contiguous: rows ``rows``, ``positions``, ``out_slots``, ``seq_lens`` (the
        layout ``rollout.kernels.decode_indices.prepare_decode`` reads); pinned when ``pin``, so one
        non-blocking copy moves it to a GPU."""
        out = torch.empty((4, len(self.rows)), dtype=torch.int64, pin_memory=pin)
        out[0] = torch.tensor(self.rows, dtype=torch.int64)
        out[1] = torch.tensor(self.positions, dtype=torch.int64)
        out[2] = self.out_slots
        out[3] = torch.tensor(self.seq_lens, dtype=torch.int64)
        return out


@dataclass
class PromptLogprobsRequest:
    """Prompt logprobs wanted from an extend step: for each of ``indices`` (into the step's flattened tokens),
    the logprob of the token at the next position, ``targets``; with the top ``top_k`` alternatives.
    ``counts[i]`` of the rows belong to the step's request ``i`` (in order)."""

    indices: list[int]
    targets: list[int]
    top_k: int
    counts: list[int]


@dataclass
class StepOutput:
    """A launched step's results, being copied to the host; ``wait()`` makes them readable.

    Token fields are host tensors with one row per sampled request (see ``SamplerOutput``; None when the
    step sampled nothing); ``prompt_logprobs`` has one row per ``StepInput.prompt_logprobs`` index.
    """

    next_token_ids: torch.Tensor | None
    logprobs: torch.Tensor | None
    ranks: torch.Tensor | None
    top_logprob_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    prompt_logprobs: PromptLogprobs | None = None
    event: Any = None

    def wait(self) -> "StepOutput":
        if self.event is not None:
            self.event.synchronize()
        return self


class ModelRunner:
    """Model + KV pool + request table + attention backend + sampler for one TP rank."""

    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, tp: TPGroup, device: torch.device) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.tp = tp
        self.device = device
        self.dtype = resolve_torch_dtype(config, model_cfg)
        self.kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        self.context_len = _context_len(config, model_cfg)
        fused = self.fused_kernels = use_fused_kernels(config, device, self.dtype)
        if device.type == "cuda" and self.dtype == torch.float32:
            logger.info("a float32 model on CUDA runs the torch kernels (FlashInfer's take float16 / bfloat16 only); "
                        "pass dtype='bfloat16' for the fast path")
        if config.quantization == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
            raise ValueError("quantization='fp8' needs a GPU of compute capability 9.0 or newer (Hopper): its "
                             "row-wise scaled fp8 GEMMs do not run on older GPUs")
        self.memory = create_memory_saver(config.enable_memory_saver, device)  # sleep / wake_up
        self._weight_tensors: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        with self.memory.region("weights"):
            self.model, self.weight_map = build_model(model_cfg, config.model_path, self.context_len, tp,
                                                      self.dtype, device, config.load_format, config.seed, fused,
                                                      config.quantization)
        attn = self.model.model.layers[0].self_attn.attn
        self.num_slots = self._kv_slots(attn.num_kv_heads)
        self.context_len = min(self.context_len, self.num_slots - 1)
        with self.memory.region("kv_cache"):
            self.kv_pool = KVPool(self.num_slots, model_cfg.num_layers, attn.num_kv_heads, model_cfg.head_dim,
                                  self.kv_dtype, device, config.page_size)
            if self.records_routing:
                self.kv_pool.routed_experts = RoutedExpertsPool(
                    self.num_slots + config.page_size, model_cfg.num_layers, model_cfg.sparse_layers,
                    model_cfg.num_experts_per_tok, device)
            self.req_to_token = ReqToTokenPool(config.max_running_requests + 1, self.context_len + 1, device)
            # each request row's newest token, written by the sampler on the device: decode reads its inputs
            # here, so the next step can be launched before the previous one's tokens reach the host
            self.last_token_ids = torch.zeros(config.max_running_requests + 1, dtype=torch.int64, device=device)
            self.attn_backend = self._attention_backend(attn)
        self.allocator = SlotAllocator(self.num_slots, config.page_size)
        self.sampler = Sampler(fused=fused)
        # every CUDA graph is captured on this one stream, the piecewise ones first: captured after the decode
        # graphs or on another stream, they made every decode replay ~0.1 ms slower on an H100 (its kernels no
        # longer overlapped through programmatic dependent launch; docs/rl_rollouts.md)
        self.capture_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        with self.memory.region("cuda_graph"):
            self.piecewise_runner = self._piecewise_runner()
            self.graph_runner = self._graph_runner()

    def release_memory(self, tag: str, keep_weights: bool) -> None:
        """Release one memory tag (``memory_saver.TAGS``); the weights' contents are kept with
        ``keep_weights`` (buffers, which no update restores, always are)."""
        tensors, keep = self._memory_tensors(tag, keep_weights)
        self.memory.release(tag, tensors, keep)

    def resume_memory(self, tag: str, kept_weights: bool) -> None:
        """Map a released tag's memory back (same addresses on CUDA) and restore what ``release_memory`` kept;
        the attention backend's state that must start at zero is zeroed."""
        tensors, keep = self._memory_tensors(tag, kept_weights)
        self.memory.resume(tag, tensors, keep)
        if tag == "kv_cache":
            self.attn_backend.reset_state()

    def _memory_tensors(self, tag: str, keep_weights: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(every tensor of ``tag`` that is resized on the CPU, those whose contents come back); listed while
        every storage is allocated (a released storage has no address to tell tied weights apart by)."""
        if self._weight_tensors is None:
            buffers = unique_tensors(list(self.model.buffers()))
            self._weight_tensors = (unique_tensors(list(self.model.parameters())) + buffers, buffers)
        if tag == "weights":
            everything, buffers = self._weight_tensors
            return everything, everything if keep_weights else buffers
        if tag == "kv_cache":
            routing = self.kv_pool.routed_experts
            return self.kv_pool.k_buffers + self.kv_pool.v_buffers + ([routing.buffer] if routing else []), []
        return [], []

    @property
    def records_routing(self) -> bool:
        """The KV pool keeps each token's routed experts (``enable_return_routed_experts`` on an MoE model)."""
        return self.config.enable_return_routed_experts and self.model_cfg.is_moe

    def _kv_slots(self, kv_heads_local: int) -> int:
        """KV slots from ``max_total_tokens`` or the memory budget, at most what ``max_running_requests`` requests
        of the whole context can use, and never so few that the context (clipped to ``num_slots - 1``) shrinks
        for that cap alone: one request of the whole context plus a page."""
        per_token = KVPool.bytes_per_token(self.model_cfg.num_layers, kv_heads_local, self.model_cfg.head_dim,
                                           self.kv_dtype)
        if self.records_routing:
            per_token += RoutedExpertsPool.bytes_per_token(len(self.model_cfg.sparse_layers),
                                                           self.model_cfg.num_experts_per_tok)
        if self.config.max_total_tokens is not None:
            slots = self.config.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1.0 - self.config.mem_fraction_static)
            slots = int(budget // per_token)
        else:
            slots = int(self.config.cpu_kv_cache_gb * (1 << 30) // per_token)
        # a pool of exactly the context would clip the context by one token (max_running_requests=1 refused a
        # prompt of context - 1 tokens, and ended max_tokens=None outputs a token early)
        slots = min(slots, max(self.context_len * self.config.max_running_requests,
                               self.context_len + self.config.page_size))
        if self.tp.size > 1:  # every rank must agree on the pool size
            t = torch.tensor([slots], dtype=torch.int64)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.tp.cpu_group)
            slots = int(t.item())
        slots -= slots % self.config.page_size  # whole pages
        if slots < 2:
            raise ValueError(f"not enough memory for the KV cache ({slots} slots)")
        logger.info("KV cache: %d token slots, %.2f GiB, %s", slots, slots * per_token / (1 << 30),
                    str(self.kv_dtype).replace("torch.", ""))
        return slots

    def _attention_backend(self, attn) -> AttentionBackend:
        """The backend ``config.attention_backend`` and ``decode_attention_backend`` name
        (``rollout.attention.registry``; "auto": FlashInfer prefill + Triton decode on CUDA when the ``gpu``
        extra is installed, else ``torch_native``)."""
        spec = AttentionSpec(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scaling, self.dtype,
                             self.kv_dtype, self.device, max_batch_size=self.config.max_running_requests,
                             max_context_len=self.context_len + 1, page_size=self.config.page_size,
                             decode_balance_ratio=self.config.decode_balance_ratio)
        return create_attention_backend(spec, self.config.attention_backend, self.config.decode_attention_backend)

    def _graph_runner(self):
        """CUDA graphs for decode, when the attention backend supports them (unless disabled)."""
        if self.config.disable_cuda_graph or not self.attn_backend.supports_cuda_graph:
            return None
        from rollout.model_executor.cuda_graph_runner import CudaGraphRunner, default_batch_sizes

        max_bs = min(self.config.cuda_graph_max_bs, self.config.max_running_requests)
        return CudaGraphRunner(self, self.attn_backend, default_batch_sizes(max_bs), self.shared_prefix_members > 0,
                               self.capture_stream)

    def _piecewise_runner(self):
        """Piecewise CUDA graphs for extend steps (``rollout.model_executor.piecewise_graph_runner``) with
        ``enable_piecewise_cuda_graph``, unless ``disable_cuda_graph`` (no graphs at all) or the model runs a path
        they do not support: not the fused CUDA path, TP > 1, fp8 weights, a KV pool not in the model dtype,
        mixture-of-experts layers."""
        cfg = self.config
        if (not cfg.enable_piecewise_cuda_graph or cfg.disable_cuda_graph or not self.fused_kernels or self.tp.size > 1
                or cfg.quantization is not None or self.kv_dtype != self.dtype or self.model_cfg.sparse_layers
                or self.records_routing):
            return None
        from rollout.model_executor.piecewise_graph_runner import PiecewiseCudaGraphRunner, piecewise_token_sizes

        pieces = PiecewiseCudaGraphRunner(self, piecewise_token_sizes(cfg.piecewise_cuda_graph_max_tokens
                                                                      or cfg.max_prefill_tokens), self.capture_stream)
        if cfg.enable_memory_saver:
            logger.warning("the piecewise CUDA graphs' %.2f GiB stay allocated while the engine sleeps (graph memory "
                           "is not released); a smaller piecewise_cuda_graph_max_tokens holds less",
                           pieces.graph_bytes / 2**30)
        return pieces

    @property
    def shared_prefix_members(self) -> int:
        """The most rows of one ``StepInput.shared_prefixes`` group decode takes (0: cascade decode is off, by
        ``disable_cascade_attn`` or because the attention backend has none; groups are then not worth building)."""
        return 0 if self.config.disable_cascade_attn else self.attn_backend.max_shared_prefix_members

    def forward(self, step: StepInput) -> tuple[torch.Tensor, PromptLogprobs | None]:
        """Logits [num_requests, vocab] (model dtype; the sampler computes in float32) of each request's last
        token in ``step``, and the prompt logprobs ``step.prompt_logprobs`` asks for (else None). The step
        also writes its ``out_slots`` into the device request table at (``rows``, ``positions``): the
        scheduler writes only the host table (``KVCacheManager.extend``, ``alloc_decode``)."""
        if step.mode == ForwardMode.DECODE:
            return self._forward_decode(step), None
        dev = self.device
        rows, positions = list_to_device(step.rows, torch.int64, dev), list_to_device(step.positions, torch.int64, dev)
        out_slots = to_device(step.out_slots, dev)
        if self.req_to_token.table is not self.req_to_token.cpu_table:  # the new tokens' slots, one write
            per_token = torch.repeat_interleave(rows, list_to_device(step.extend_lens, torch.int64, dev),
                                                output_size=len(step.positions))
            self.req_to_token.write_device(per_token, positions, out_slots)
        batch = self._batch(step, list_to_device(step.input_ids, torch.int64, dev), rows, positions, out_slots,
                            list_to_device(step.seq_lens, torch.int32, dev))
        want = step.prompt_logprobs
        with torch.no_grad():
            pieces = self.piecewise_runner
            hidden = (pieces.forward(batch) if pieces is not None and pieces.can_run(len(step.positions))
                      else self.model.model(batch))
            logits = self.model.logits(batch, hidden)
            if want is None:
                return logits, None
            picked = hidden.index_select(0, list_to_device(want.indices, torch.int64, dev))
            return logits, prompt_logprobs(self.model.lm_head, picked, list_to_device(want.targets, torch.int64, dev),
                                           want.top_k)

    def _forward_decode(self, step: StepInput) -> torch.Tensor:
        """Decode from one host-to-device copy (``StepInput.decode_pack``). A CUDA graph's runner prepares
        its inputs from it (one kernel with Triton decode); otherwise the table write, the input tokens'
        gather from ``last_token_ids`` and an eager forward."""
        packed = to_device(step.decode_pack(pin=self.device.type == "cuda"), self.device)
        if self.graph_runner is not None and self.graph_runner.can_run(len(step.rows)):
            return self.graph_runner.replay(step, packed, self.last_token_ids)
        rows, positions, out_slots, seq_lens = packed.unbind(0)
        self.req_to_token.write_device(rows, positions, out_slots)
        return self.model(self._batch(step, self.last_token_ids[rows], rows, positions, out_slots,
                                      seq_lens.to(torch.int32), step.shared_prefixes))

    def _batch(self, step: StepInput, input_ids: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
               out_slots: torch.Tensor, seq_lens: torch.Tensor, shared: SharedPrefixes | None = None) -> ForwardBatch:
        """The eager (no graph) forward batch of ``step``'s inputs, already on the device, attention planned."""
        batch = ForwardBatch(
            mode=step.mode,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_slots,
            req_pool_indices=rows,
            seq_lens=seq_lens,
            seq_lens_cpu=step.seq_lens,
            extend_lens=step.extend_lens,
            kv_pool=self.kv_pool,
            req_to_token=self.req_to_token.table,
            attn_backend=self.attn_backend,
            shared_prefixes=shared,
            balanced_decode=step.balanced_decode,
        )
        self.attn_backend.init_forward_metadata(batch)
        return batch

    def sampling_info(self, rows: list[SamplingRow]) -> SamplingBatchInfo:
        """The sampling tensors of ``rows`` on this rank's device."""
        return SamplingBatchInfo.build(rows, self.model_cfg.vocab_size, self.device)

    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SamplerOutput:
        out = self.sampler(logits, info)
        if self.tp.size > 1:  # every rank must continue with the same tokens
            self.tp.broadcast_tensor(out.next_token_ids)
        return out

    def run_step(self, step: StepInput, sample_index: list[int],
                 info: SamplingBatchInfo | None) -> StepOutput | None:
        """Launch the forward of ``step`` and sampling of its requests ``sample_index`` (with ``info``);
        returns without waiting for the GPU (None when the step samples nothing and wants no prompt
        logprobs). The sampled tokens become the rows' ``last_token_ids``."""
        logits, extra = self.forward(step)
        if not sample_index:
            return None if extra is None else self._to_host(None, extra)
        if len(sample_index) < len(step.rows):
            logits = logits.index_select(0, list_to_device(sample_index, torch.int64, self.device))
        out = self.sample(logits, info)
        sampled_rows = [step.rows[i] for i in sample_index]
        self.last_token_ids.index_copy_(0, list_to_device(sampled_rows, torch.int64, self.device), out.next_token_ids)
        return self._to_host(out, extra)

    def _to_host(self, out: SamplerOutput | None, extra: PromptLogprobs | None) -> StepOutput:
        """Start copying ``out`` and ``extra`` to pinned host memory; the returned output's ``wait()``
        completes it."""
        fields = (out.next_token_ids, out.logprobs, out.ranks, out.top_logprob_ids, out.top_logprobs) if out \
            else (None,) * 5
        if self.device.type != "cuda":
            return StepOutput(*fields, prompt_logprobs=extra)

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return buf.copy_(t, non_blocking=True)

        event = torch.cuda.Event()
        extra_host = None if extra is None else PromptLogprobs(*(host(t) for t in (
            extra.token_logprobs, extra.ranks, extra.top_ids, extra.top_logprobs)))
        result = StepOutput(*(host(t) for t in fields), prompt_logprobs=extra_host)
        event.record()
        result.event = event
        return result


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _context_len(config: EngineConfig, cfg: ModelConfig) -> int:
    n = cfg.max_position_embeddings
    if cfg.sliding_window:
        n = min(n, cfg.sliding_window)
    if config.context_length is not None:
        n = min(n, config.context_length)
    return n
