"""The sparse MLP block of Qwen3-MoE and Mixtral: the router (``gate``), top-k routing and ``FusedMoE`` experts."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rollout.config import ModelConfig
from rollout.distributed import TPGroup
from rollout.layers.linear import ReplicatedLinear
from rollout.layers.moe import FusedMoE, select_experts
from rollout.model_executor.forward_batch import ForwardBatch


class SparseMoeBlock(nn.Module):
    """y = Σ_k topk_weight_k · expert_{topk_id_k}(x) per token (transformers' ``Qwen3MoeSparseMoeBlock`` /
    ``MixtralSparseMoeBlock``). The router is replicated on every rank; the experts are tensor-parallel.

    When the batch's KV pool keeps routing (``enable_return_routed_experts``), the forward records each
    token's top-k expert ids there, at the token's KV slot (``RoutedExpertsPool.record``).
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup, dtype: torch.dtype, device: Any,
                 fused: bool = False, quant: str | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        if quant is not None:
            raise ValueError(f"quantization={quant!r} is not supported for mixture-of-experts models yet")
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.weights_fp32 = cfg.moe_topk_weights_fp32
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, False, dtype, device)
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, tp, dtype, device,
                                fused)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        router_logits = self.gate(x)
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        if not self.weights_fp32:  # Qwen3-MoE scales the experts' outputs in the model dtype
            topk_weights = topk_weights.to(router_logits.dtype)
        routing = batch.kv_pool.routed_experts
        if routing is not None:
            routing.record(self.layer_id, batch.out_cache_loc, topk_ids)
        return self.experts(x, topk_ids, topk_weights)
