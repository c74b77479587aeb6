"""The tests' oracle: transformers as the reference. Greedy generation and log-probabilities (re-exported
from ``weight_sync.hf_compare``, which ``rollout-smoke`` also uses), and transformers models changed to
compute what the engine computes under ``kv_cache_dtype="fp8_e4m3"`` (``rounded_kv_attention``) and
``quantization="fp8"`` (``fp8_quantized_projections``). Tests import it as ``reference`` (``conftest.py``
puts this directory on ``sys.path``)."""

from __future__ import annotations

from typing import Any

import torch

from weight_sync.hf_compare import greedy_gaps, hf_greedy, hf_logprobs

__all__ = ["fp8_quantized_projections", "greedy_gaps", "hf_greedy", "hf_logprobs", "rounded_kv_attention"]


def rounded_kv_attention(kv_dtype: torch.dtype) -> str:
    """Register with transformers (``AttentionInterface``) an SDPA attention whose keys (after RoPE) and
    values are first rounded to ``kv_dtype`` and widened back, unit scale: what a KV cache of that type
    (``kv_cache_dtype="fp8_e4m3"``) stores and reads. Returns the ``attn_implementation`` name to load
    a model with. Queries, weights and the softmax keep the model's dtype."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        key = key.to(kv_dtype).to(query.dtype)
        value = value.to(kv_dtype).to(query.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    name = f"sdpa_kv_{str(kv_dtype).removeprefix('torch.')}"
    AttentionInterface.register(name, attention)
    return name


def fp8_quantized_projections(model: Any, tp_size: int = 1) -> Any:
    """Make a transformers model's decoder projections compute what an engine with
    ``quantization="fp8"`` computes (in place; returns the model): fp8 row-quantized weights and
    per-token fp8 activations, multiplied in float32, output in the model dtype. Row-parallel layers
    (o_proj, down_proj) quantize each of ``tp_size`` input slices separately, as the engine's ranks do."""
    from rollout.layers.quantization import is_quantized_weight, quantize_fp8_rows, reference_linear

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and is_quantized_weight(name + ".weight"):
            wq, ws = quantize_fp8_rows(module.weight.detach())
            groups = tp_size if name.endswith(("o_proj", "down_proj")) else 1

            def forward(x, wq=wq, ws=ws, bias=module.bias, groups=groups):
                parts = zip(x.chunk(groups, dim=-1), wq.chunk(groups, dim=-1))
                out = sum(reference_linear(xp, wp, ws) for xp, wp in parts)
                return (out if bias is None else out + bias).to(x.dtype)

            module.forward = forward
    return model
