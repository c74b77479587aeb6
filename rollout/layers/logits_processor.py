"""Prompt (input) logprobs: the log-probability of each prompt token given the tokens before it.

They are computed in the prefill forward that computes the prompt's KV (vLLM's ``prompt_logprobs``,
SGLang's ``input_token_logprobs``): the final hidden states of the wanted positions go through the LM
head in blocks of rows, so a long prompt never materializes a [prompt, vocab] logits tensor at once.
Values are ``log_softmax`` of the model's raw logits in float32, like the sampler's raw logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_ROWS = 512  # rows of logits at a time: [512, vocab] float32 (about 300 MB at a 152k vocabulary)


@dataclass
class PromptLogprobs:
    """For N positions: ``token_logprobs`` [N] float32 (of each position's next prompt token), ``ranks``
    [N] int64 (1 + the number of tokens with a strictly larger logprob), and with ``k`` > 0
    ``top_ids`` / ``top_logprobs`` [N, k] (descending), else None."""

    token_logprobs: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


def prompt_logprobs(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, k: int) -> PromptLogprobs:
    """Logprobs of ``targets`` [N] under the logits of ``hidden`` [N, hidden size] (``lm_head.logits``),
    with the top ``k`` alternatives of each row when ``k`` > 0."""
    parts = []
    for start in range(0, hidden.shape[0], BLOCK_ROWS):
        logits = lm_head.logits(hidden[start:start + BLOCK_ROWS]).float()
        lp = torch.log_softmax(logits, dim=-1)
        tgt = targets[start:start + BLOCK_ROWS, None]
        token = lp.gather(1, tgt)
        rank = (lp > token).sum(dim=-1) + 1
        top = lp.topk(k, dim=-1) if k > 0 else None
        parts.append((token.squeeze(1), rank, top))
    token_lp = torch.cat([p[0] for p in parts])
    ranks = torch.cat([p[1] for p in parts])
    if k == 0:
        return PromptLogprobs(token_lp, ranks, None, None)
    return PromptLogprobs(token_lp, ranks, torch.cat([p[2].indices for p in parts]),
                          torch.cat([p[2].values for p in parts]))
