"""The engine against transformers at run time: ``rollout-smoke`` compares the engine's greedy outputs and
logprobs with the same model in transformers. Greedy generation, teacher-forced log-probabilities, and how
far each greedy token falls below the model's best choice (near-ties)."""

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


def _output_logprobs(model: Any, prompt: list[int], output: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_softmax of the logits at each of ``output``'s positions [len(output), vocab], the logprob of each
    ``output`` token [len(output)]), given the prompt: one teacher-forced forward."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output], device=device)).logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp, lp[torch.arange(len(output), device=device), torch.tensor(output, device=device)]


def hf_logprobs(model: Any, prompt: list[int], output: list[int]) -> list[float]:
    """log_softmax of the model's logits at each of ``output``'s tokens, given the prompt."""
    if not output:
        return []
    return _output_logprobs(model, prompt, output)[1].tolist()


def greedy_gaps(model: Any, prompt: list[int], output: list[int]) -> list[float]:
    """For each token of a greedy ``output``: how far its logprob is below the model's best choice.

    All zeros when ``output`` is exactly the model's greedy path; a small gap marks a near-tie that
    a different but correct implementation may break the other way."""
    if not output:
        return []
    lp, chosen = _output_logprobs(model, prompt, output)
    return (lp.max(dim=-1).values - chosen).tolist()
