"""transformers as the oracle: greedy generation and teacher-forced log-probabilities."""

from __future__ import annotations

from typing import Any

import torch


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int, eos_token_id: Any = None) -> list[int]:
    """``generate`` with do_sample=False; stops at ``eos_token_id`` only when one is given."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id,
                              pad_token_id=0 if eos_token_id is None else eos_token_id)
    device = next(model.parameters()).device
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos_token_id  # generate merges the model's defaults back in
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt], device=device), generation_config=config)
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


def hf_logprobs(model: Any, prompt: list[int], output: list[int]) -> list[float]:
    """log_softmax of the model's logits at each of ``output``'s tokens, given the prompt."""
    if not output:
        return []
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output], device=device)).logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[torch.arange(len(output), device=device), torch.tensor(output, device=device)].tolist()


def greedy_gaps(model: Any, prompt: list[int], output: list[int]) -> list[float]:
    """For each token of a greedy ``output``: how far its logprob is below the model's best choice.

    All zeros when ``output`` is exactly the model's greedy path; a small gap marks a near-tie that
    a different but correct implementation may break the other way."""
    if not output:
        return []
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output], device=device)).logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp[torch.arange(len(output), device=device), torch.tensor(output, device=device)]
    return (lp.max(dim=-1).values - chosen).tolist()


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
