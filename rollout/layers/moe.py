"""Mixture-of-experts layers: top-k routing (``select_experts``) and ``FusedMoE``, the experts' stacked weights.

Layout (SGLang's and vLLM's): ``w13_weight`` [E, 2·I_local, H] holds each expert's gate rows, then its up
rows; ``w2_weight`` [E, H, I_local] its down projection. Tensor parallelism splits every expert's
intermediate dimension I: rank r holds rows [r·I_local, (r+1)·I_local) of each gate and up and those
columns of each down, and the output's partial sums are all-reduced, as ``RowParallelLinear``'s are.

Shard ids of ``shard_view`` / ``weight_loader`` (used by ``rollout.weights.weight_map``) are
``(expert, proj)``: ``proj`` "gate" or "up" (in ``w13_weight``) or "down" (``w2_weight``); ``expert`` an
int for one expert's Hugging Face tensor ([I, H] for gate and up, [H, I] for down), or None for that
projection of every expert in transformers 5's fused tensors (the gate or up half of ``gate_up_proj``
[E, 2I, H], loaded as two shards, or ``down_proj`` [E, H, I]).

The CPU forward is torch-native and computes what transformers' eager experts compute (per expert, its
tokens' SiLU(gate)·up then down, scaled by the routing weight and added in expert order); on CUDA
(``fused``) ``FusedMoE.experts`` runs the Triton kernel of ``rollout.kernels.fused_moe``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rollout.distributed import TPGroup
from rollout.layers.linear import ShardSpec, _new_param, _split, attach


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32 [T, top_k], topk_ids int64 [T, top_k]) from router logits [T, E]: the softmax
    in float32, its ``top_k`` largest probabilities (largest first), divided by their sum when
    ``renormalize`` (Qwen3-MoE's ``norm_topk_prob``; always for Mixtral), as transformers' routers do."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


class FusedMoE(nn.Module):
    """``num_experts`` SwiGLU experts of ``intermediate_size`` over ``hidden_size``, tensor-parallel over
    the intermediate dimension. ``forward(x, topk_ids, topk_weights)`` → [T, H] in x's dtype (all-reduced)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPGroup,
                 dtype: torch.dtype, device: Any = None, fused: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.fused = fused
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.i_local = _split(intermediate_size, tp, "moe intermediate size")
        self.w13_weight = attach(_new_param((num_experts, 2 * self.i_local, hidden_size), dtype, device),
                                 self._w13_view)
        self.w2_weight = attach(_new_param((num_experts, hidden_size, self.i_local), dtype, device), self._w2_view)

    def _w13_view(self, param: nn.Parameter, shard_id: Any) -> tuple[torch.Tensor, ShardSpec]:
        expert, proj = self._check(shard_id, ("gate", "up"))
        n, start = self.i_local, self.tp.rank * self.i_local
        offset = 0 if proj == "gate" else n
        if expert is None:  # the gate or up half of a fused [E, 2I, H] tensor
            full_start = start if proj == "gate" else self.intermediate_size + start
            return param.data.narrow(1, offset, n), ShardSpec(1, full_start, n)
        return param.data[expert].narrow(0, offset, n), ShardSpec(0, start, n)

    def _w2_view(self, param: nn.Parameter, shard_id: Any) -> tuple[torch.Tensor, ShardSpec]:
        expert, _ = self._check(shard_id, ("down",))
        n, start = self.i_local, self.tp.rank * self.i_local
        if expert is None:  # a fused [E, H, I] tensor
            return param.data, ShardSpec(2, start, n)
        return param.data[expert], ShardSpec(1, start, n)

    def _check(self, shard_id: Any, projs: tuple[str, ...]) -> tuple[int | None, str]:
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[1] in projs):
            raise ValueError(f"expert shard id must be (expert, proj) with proj in {projs}, got {shard_id!r}")
        expert = shard_id[0]
        if expert is not None and not (isinstance(expert, int) and 0 <= expert < self.num_experts):
            raise ValueError(f"expert index {expert!r} out of range (the layer has {self.num_experts} experts)")
        return shard_id

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Σ over each token's top-k experts of weight · expert(x); ``topk_weights``' dtype is the dtype
        the experts' outputs are scaled in (float32 for Mixtral, x's for Qwen3-MoE, as in transformers)."""
        return self.tp.all_reduce(self.experts(x, topk_ids, topk_weights))

    def experts(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum [T, H] (before the all-reduce). ``fused`` (CUDA): the Triton grouped-GEMM
        kernel (``rollout.kernels.fused_moe``; no host synchronization, so CUDA graphs capture it); else the
        torch-native loop over the experts that any token picked, in expert order (transformers' eager order,
        so float sums match)."""
        if self.fused:
            from rollout.kernels.fused_moe import fused_moe

            return fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        out = torch.zeros_like(x)
        hit = torch.zeros(self.num_experts, dtype=torch.bool, device=x.device)
        hit[topk_ids.flatten()] = True
        for expert in hit.nonzero().flatten().tolist():
            pos, token_idx = torch.where(topk_ids.t() == expert)  # by top-k slot, then token (as transformers)
            gate, up = F.linear(x[token_idx], self.w13_weight[expert]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.w2_weight[expert]) * topk_weights[token_idx, pos, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        return out
