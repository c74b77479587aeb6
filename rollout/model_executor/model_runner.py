"""Owns the model, its KV memory and attention backend on one TP rank; runs forwards and sampling."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rollout.attention.base import AttentionBackend
from rollout.config import EngineConfig, ModelConfig, resolve_torch_dtype
from rollout.distributed import TPGroup
from rollout.layers.sampler import Sampler, SamplerOutput, SamplingBatchInfo, SamplingRow
from rollout.mem_cache.kv_pool import KVPool, ReqToTokenPool, SlotAllocator
from rollout.model_executor.forward_batch import ForwardBatch, ForwardMode
from rollout.models.loader import build_model

logger = logging.getLogger(__name__)


@dataclass
class StepInput:
    """The tokens one forward computes, flattened over requests (host lists, built by the scheduler)."""

    mode: ForwardMode
    rows: list[int]
    input_ids: list[int]
    positions: list[int]
    out_slots: torch.Tensor
    seq_lens: list[int]
    extend_lens: list[int]


class ModelRunner:
    """Model + KV pool + request table + attention backend + sampler for one TP rank."""

    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, tp: TPGroup, device: torch.device) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.tp = tp
        self.device = device
        self.dtype = resolve_torch_dtype(config, model_cfg)
        self.context_len = _context_len(config, model_cfg)
        fused = config.fused_kernels and device.type == "cuda" and _has_flashinfer()
        self.model, self.weight_map = build_model(model_cfg, config.model_path, self.context_len, tp,
                                                  self.dtype, device, config.load_format, config.seed, fused)
        attn = self.model.model.layers[0].self_attn.attn
        self.num_slots = self._kv_slots(attn.num_kv_heads)
        self.context_len = min(self.context_len, self.num_slots - 1)
        self.kv_pool = KVPool(self.num_slots, model_cfg.num_layers, attn.num_kv_heads, model_cfg.head_dim,
                              self.dtype, device)
        self.allocator = SlotAllocator(self.num_slots)
        self.req_to_token = ReqToTokenPool(config.max_running_requests + 1, self.context_len + 1, device)
        self.attn_backend = self._attention_backend(attn)
        self.sampler = Sampler()
        self.graph_runner = self._graph_runner()

    def _kv_slots(self, kv_heads_local: int) -> int:
        per_token = KVPool.bytes_per_token(self.model_cfg.num_layers, kv_heads_local, self.model_cfg.head_dim,
                                           self.dtype)
        if self.config.max_total_tokens is not None:
            slots = self.config.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1.0 - self.config.mem_fraction_static)
            slots = int(budget // per_token)
        else:
            slots = int(self.config.cpu_kv_cache_gb * (1 << 30) // per_token)
        slots = min(slots, max(self.context_len * self.config.max_running_requests, 1))
        if self.tp.size > 1:  # every rank must agree on the pool size
            t = torch.tensor([slots], dtype=torch.int64)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.tp.cpu_group)
            slots = int(t.item())
        if slots < 2:
            raise ValueError(f"not enough memory for the KV cache ({slots} slots)")
        logger.info("KV cache: %d token slots, %.2f GiB", slots, slots * per_token / (1 << 30))
        return slots

    def _attention_backend(self, attn) -> AttentionBackend:
        """``flashinfer`` on CUDA when it is installed (the ``gpu`` extra), else ``torch_native``."""
        name = self.config.attention_backend
        if name == "auto":
            name = "flashinfer" if self.device.type == "cuda" and _has_flashinfer() else "torch_native"
        if name == "torch_native":
            from rollout.attention.torch_native import TorchNativeBackend

            return TorchNativeBackend()
        if name == "flashinfer":
            if self.device.type != "cuda":
                raise ValueError("the flashinfer attention backend needs a CUDA device")
            from rollout.attention.flashinfer_backend import FlashInferBackend

            max_indices = self.config.max_running_requests * (self.context_len + 1) + 1
            return FlashInferBackend(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scaling, self.dtype,
                                     self.device, max_indices)
        raise ValueError(f"attention backend {name!r} is not available")

    def _graph_runner(self):
        """CUDA graphs for decode (FlashInfer backend on CUDA, unless disabled)."""
        from rollout.attention.flashinfer_backend import FlashInferBackend

        if self.config.disable_cuda_graph or not isinstance(self.attn_backend, FlashInferBackend):
            return None
        from rollout.model_executor.cuda_graph_runner import CudaGraphRunner, default_batch_sizes

        max_bs = min(self.config.cuda_graph_max_bs, self.config.max_running_requests)
        return CudaGraphRunner(self, self.attn_backend, default_batch_sizes(max_bs))

    def forward(self, step: StepInput) -> torch.Tensor:
        """Logits [num_requests, vocab] (float32) of each request's last token in ``step``."""
        if step.mode == ForwardMode.DECODE and self.graph_runner is not None \
                and self.graph_runner.can_run(len(step.rows)):
            return self.graph_runner.replay(step).float()
        dev = self.device
        batch = ForwardBatch(
            mode=step.mode,
            input_ids=torch.tensor(step.input_ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions=torch.tensor(step.positions, dtype=torch.int64).to(dev, non_blocking=True),
            out_cache_loc=step.out_slots.to(dev, non_blocking=True),
            req_pool_indices=torch.tensor(step.rows, dtype=torch.int64).to(dev, non_blocking=True),
            seq_lens=torch.tensor(step.seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            seq_lens_cpu=step.seq_lens,
            extend_lens=step.extend_lens,
            kv_pool=self.kv_pool,
            req_to_token=self.req_to_token.table,
            attn_backend=self.attn_backend,
        )
        self.attn_backend.init_forward_metadata(batch)
        return self.model(batch).float()

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        info = SamplingBatchInfo.build(rows, logits.shape[-1], logits.device)
        out = self.sampler(logits, info)
        if self.tp.size > 1:  # every rank must continue with the same tokens
            self.tp.broadcast_tensor(out.next_token_ids)
        return out


def _has_flashinfer() -> bool:
    import importlib.util

    return importlib.util.find_spec("flashinfer") is not None


def _context_len(config: EngineConfig, cfg: ModelConfig) -> int:
    n = cfg.max_position_embeddings
    if cfg.sliding_window:
        n = min(n, cfg.sliding_window)
    if config.context_length is not None:
        n = min(n, config.context_length)
    return n
