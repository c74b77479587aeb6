"""The engine against transformers at run time: ``rollout-smoke`` compares the engine's greedy outputs and
logprobs with the same model in transformers. Greedy generation, teacher-forced log-probabilities (for
mixture-of-experts models with the engine's routing replayed, docs/moe.md), and how far each greedy token
falls below the model's best choice (near-ties)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np
import torch


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int, eos_token_id: Any = None) -> list[int]:
    """``generate`` with do_sample=False; stops at ``eos_token_id`` only when one is given. Every prompt token is
    attended (an explicit mask: ``generate`` would otherwise mask the prompt's ``pad_token_id`` tokens, here 0
    or the EOS id, as padding)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id,
                              pad_token_id=0 if eos_token_id is None else eos_token_id)
    device = next(model.parameters()).device
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos_token_id  # generate merges the model's defaults back in
    try:
        with torch.no_grad():
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


def _output_logprobs(model: Any, prompt: list[int], output: list[int], routed_experts: np.ndarray | None = None,
                     counts: dict[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_softmax of the logits at each of ``output``'s positions [len(output), vocab], the logprob of each
    ``output`` token [len(output)]), given the prompt: one teacher-forced forward over ``prompt + output[:-1]``,
    with ``routed_experts`` (the engine's, from position 0) replayed in its sparse layers when given."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + output[:-1]], device=device)
    with torch.no_grad(), replayed_routing(model, routed_experts, counts):
        logits = model(ids).logits[0, len(prompt) - 1:].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp, lp[torch.arange(len(output), device=device), torch.tensor(output, device=device)]


def hf_logprobs(model: Any, prompt: list[int], output: list[int], routed_experts: np.ndarray | None = None,
                counts: dict[str, int] | None = None) -> list[float]:
    """log_softmax of the model's logits at each of ``output``'s tokens, given the prompt; see
    ``replayed_routing`` for ``routed_experts`` and ``counts``."""
    if not output:
        return []
    return _output_logprobs(model, prompt, output, routed_experts, counts)[1].tolist()


@contextlib.contextmanager
def replayed_routing(model: Any, routed_experts: np.ndarray | None,
                     counts: dict[str, int] | None = None) -> Iterator[None]:
    """Within the block, each sparse layer's router picks the experts of ``routed_experts`` (int [T, layers,
    top_k], the engine's ``CompletionOutput.routed_experts`` for the T input positions of the next forward;
    -1 on dense layers) and weighs them with its own probabilities (docs/moe.md, "How a trainer replays it"):
    the transformers model then differs from the engine only where their arithmetic does, not where a
    near-tie in a router went the other way. ``counts`` (when given) gains "rows" (token × sparse layer) and
    "differ" (rows whose expert set transformers' own router would have picked otherwise). Nothing changes
    when ``routed_experts`` is None. Needs transformers' router modules (transformers >= 5)."""
    if routed_experts is None:
        yield
        return
    routers = {i: layer.mlp.gate for i, layer in enumerate(model.model.layers)
               if hasattr(layer.mlp, "gate") and not hasattr(layer.mlp, "gate_proj")}
    if any(not hasattr(r, "top_k") for r in routers.values()):
        raise RuntimeError("routing replay needs transformers' MoE router modules (transformers >= 5)")
    saved = {i: r.forward for i, r in routers.items()}
    for i, router in routers.items():
        router.forward = _replaying(router, saved[i], routed_experts[:, i], counts)
    try:
        yield
    finally:
        for i, router in routers.items():
            router.forward = saved[i]


def _replaying(router: Any, forward: Any, rows: np.ndarray, counts: dict[str, int] | None) -> Any:
    """``router``'s forward with its top-k indices replaced by ``rows`` [T, top_k] (weights from its own
    probabilities, renormalized where the router renormalizes)."""
    def replay(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, scores, own = forward(hidden)
        ids = torch.as_tensor(np.asarray(rows), dtype=torch.long, device=logits.device)
        if ids.shape != own.shape:
            raise ValueError(f"routed_experts rows {tuple(ids.shape)} do not match the forward's {tuple(own.shape)}")
        weights = torch.softmax(logits.float(), dim=-1).gather(-1, ids)
        if getattr(router, "norm_topk_prob", True):  # Mixtral always renormalizes; Qwen3-MoE when configured
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if counts is not None:
            same = (own.sort(dim=-1).values == ids.sort(dim=-1).values).all(dim=-1)
            counts["rows"] = counts.get("rows", 0) + same.numel()
            counts["differ"] = counts.get("differ", 0) + int((~same).sum())
        return logits, weights.to(scores.dtype), ids
    return replay


def greedy_gaps(model: Any, prompt: list[int], output: list[int], routed_experts: np.ndarray | None = None
                ) -> list[float]:
    """For each token of a greedy ``output``: how far its logprob is below the model's best choice (with
    ``routed_experts`` replayed when given).

    All zeros when ``output`` is exactly the model's greedy path; a small gap marks a near-tie that
    a different but correct implementation may break the other way."""
    if not output:
        return []
    lp, chosen = _output_logprobs(model, prompt, output, routed_experts)
    return (lp.max(dim=-1).values - chosen).tolist()
