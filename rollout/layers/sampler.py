"""Batched, per-row-parameterized token sampler (same code on CPU and CUDA).

Pipeline for one step, per row:
  raw logits --(repetition / frequency / presence penalties)--> --(min_new_tokens EOS/stop ban)-->
  greedy rows: argmax;  random rows: temperature -> top-k -> top-p -> min-p -> seeded exponential race.

Random rows are sampled with the exponential-race (Gumbel-max) trick, token = argmax(p / E), where
E = -log(U) and U in (0, 1) is a counter-based 32-bit hash of (seed, output_len, token_id). The sample of
a row therefore depends only on its own logits, parameters, seed and position: never on the batch it is
in, its position in that batch, or any global RNG state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.layers.sampling_info import SamplingBatchInfo

__all__ = ["SamplerOutput", "Sampler", "uniform_noise"]

_M32 = 0xFFFFFFFF
# "lowbias32" improved constants (Wellons' hash prospector); both < 2**31, so a 32-bit value times a
# multiplier stays < 2**63 and never overflows int64. Masking after each multiply keeps the result
# bit-identical on every device.
_MUL1 = 0x21F0AAAD
_MUL2 = 0x735A2D97
_SEED_SALT = 0x9E3779B9
_POS_SALT = 0x85EBCA6B
_TOKEN_SALT = 0xC2B2AE35
_KEY2_SALT = 0x27D4EB2F


@dataclass
class SamplerOutput:
    """Result of one sampling step for a batch of B rows.

    ``next_token_ids`` [B] int64. ``logprobs`` [B] float32: logprob of the sampled token in the row's chosen
    distribution (raw or processed, per ``params.logprobs_mode``). ``ranks`` [B] int64: 1 + number of vocab
    entries with strictly greater logprob in that distribution (1 everywhere when no row asked for logprobs,
    ``SamplingBatchInfo.need_ranks``: only outputs with logprobs carry ranks). ``top_logprob_ids`` / ``top_logprobs``
    [B, K] with K = the largest ``params.logprobs`` in the batch (None when every row asks for None or 0);
    a row that asked for k < K should keep only its first k columns (sorted by descending logprob).
    """

    next_token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_logprob_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


# ------------------------------------------------------------------------------------------------ hash


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Bijective 32-bit avalanche mix (lowbias32 family) on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _M32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _M32
    return x ^ (x >> 15)


def _mix32_i32(x: torch.Tensor) -> torch.Tensor:
    """``_mix32`` on int32 tensors holding the same 32 bits (wrapping multiplies, masked shifts):
    bit-identical results at half the memory traffic of the int64 form, for the [B, V] part."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _MUL1
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _MUL2
    return x ^ ((x >> 15) & 0x1FFFF)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 U strictly inside (0, 1), a pure function of (seed, position, token id).

    Values are odd multiples of 2**-24 (exact in float32), so -log(U) is finite and positive. Bit-identical
    on every device and independent of which other rows are in the batch.
    """
    lo = seeds & _M32
    hi = (seeds >> 32) & _M32
    key = _mix32(lo ^ _SEED_SALT)
    key = _mix32(key ^ hi)
    key = _mix32(key ^ ((positions & _M32) ^ _POS_SALT))
    key2 = _mix32(key ^ _KEY2_SALT)
    tok = _mix32(torch.arange(vocab_size, dtype=torch.int64, device=seeds.device) ^ _TOKEN_SALT)
    x = _mix32_i32((key[:, None] ^ tok[None, :]).to(torch.int32))
    x = _mix32_i32(x ^ key2.to(torch.int32)[:, None])
    return (((x >> 9) & 0x7FFFFF) * 2 + 1).to(torch.float32) * (2.0 ** -24)


# ---------------------------------------------------------------------------------------------- sampler


def _apply_penalties(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Repetition (HF), then frequency/presence (OpenAI/vLLM), then min_new_tokens bans; returns a new tensor."""
    if info.seen_mask is not None:
        p = info.repetition_penalties[:, None]
        penalized = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(info.seen_mask, penalized, logits)
    if info.output_counts is not None:
        counts = info.output_counts
        logits = (logits - info.frequency_penalties[:, None] * counts
                  - info.presence_penalties[:, None] * (counts > 0).to(logits.dtype))
    if info.ban_rows is not None:
        logits = logits.index_put((info.ban_rows, info.ban_cols),
                                  torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
    return logits


def _top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Mask to -inf everything below each row's top-k then top-p cutoff (ties at the cutoff are kept).

    top-p keeps the smallest prefix (by descending prob, after top-k renormalization) whose cumulative
    probability reaches top_p, and always at least one token. top_ks == V and top_ps >= 1 mean off.
    """
    sorted_logits = logits.sort(dim=-1, descending=True, stable=True).values
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_ks[:, None], float("-inf"))
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    cum_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    keep = (cum_before < top_ps[:, None]) | (top_ps[:, None] >= 1.0)
    n_keep = torch.minimum(keep.sum(dim=-1).clamp(min=1), top_ks)
    cutoff = sorted_logits.gather(1, (n_keep - 1)[:, None])
    return logits.masked_fill(logits < cutoff, float("-inf"))


def _min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose prob is below min_p * max prob (HF MinPLogitsWarper); min_p == 0 is a no-op."""
    probs = logits.softmax(dim=-1)
    threshold = min_ps[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _warp(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Temperature, then top-k/top-p (only if some row needs it), then min-p; returns warped logits."""
    logits = logits / info.temperatures[:, None]
    if info.need_top_k_top_p:
        logits = _top_k_top_p(logits, info.top_ks, info.top_ps)
    if info.need_min_p:
        logits = _min_p(logits, info.min_ps)
    return logits


def _exponential_race(logprobs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """argmax(p / E), E = -log(U) from the seeded hash; computed in log space as argmax(log p - log E)."""
    u = uniform_noise(info.seeds, info.positions, logprobs.shape[-1])
    return (logprobs - torch.log(-torch.log(u))).argmax(dim=-1)


def _choose(raw: torch.Tensor | None, processed: torch.Tensor | None, info: SamplingBatchInfo) -> torch.Tensor:
    """Per row, the distribution that its logprobs/ranks/top-k come from."""
    if not info.any_processed:
        return raw
    if info.all_processed:
        return processed
    return torch.where(info.use_processed[:, None], processed, raw)


def _top_logprobs(chosen: torch.Tensor, k: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The k largest entries of each row (descending), or (None, None) when k == 0."""
    if k == 0:
        return None, None
    values, ids = chosen.topk(k, dim=-1)
    return ids, values


class Sampler(torch.nn.Module):
    """Sample one token per row from ``logits`` [B, V] (any float dtype; computed in float32).

    Greedy rows (temperature 0) take argmax of the penalized/masked logits (lowest index on ties); random
    rows follow temperature -> top-k -> top-p -> min-p and a seeded exponential race, so each row's token
    depends only on its own logits, params, seed and output_len. No host syncs: fast paths are chosen
    from the Python flags of ``SamplingBatchInfo``.
    """

    def __init__(self, fused: bool = False) -> None:
        """``fused``: sample fast-path batches (``SamplingBatchInfo.fast_path``) with the Triton kernel of
        :mod:`rollout.kernels.sampling`; ``fused_steps`` counts the steps it sampled."""
        super().__init__()
        self.fused = fused
        self.fused_steps = 0

    def forward(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SamplerOutput:
        """Return a :class:`SamplerOutput` for this step (see its docstring for the fields)."""
        if self.fused and info.fast_path:
            return self._fused(logits, info)
        logits = logits.float()
        if info.all_greedy and not info.has_penalties:
            return self._plain_greedy(logits, info)
        raw = logits.log_softmax(dim=-1) if not info.all_processed else None
        adjusted = _apply_penalties(logits, info) if info.has_penalties else logits
        processed = None
        if info.all_greedy:
            next_ids = adjusted.argmax(dim=-1)
            processed = adjusted.log_softmax(dim=-1) if info.any_processed else None
        else:
            sampled_lp = _warp(adjusted, info).log_softmax(dim=-1)
            next_ids = _exponential_race(sampled_lp, info)
            if info.any_greedy:
                next_ids = torch.where(info.is_greedy, adjusted.argmax(dim=-1), next_ids)
            if info.any_processed:
                processed = self._processed_with_greedy(adjusted, sampled_lp, raw, info)
        return self._finish(next_ids, _choose(raw, processed, info), info)

    def _fused(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SamplerOutput:
        """Fast-path batch through the fused kernel (triton is imported only when this path is first taken)."""
        from rollout.kernels.sampling import fused_sample

        self.fused_steps += 1
        out = fused_sample(logits, info.temperatures, info.seeds, info.positions, info.is_greedy, info.use_processed,
                           count_ranks=info.need_ranks)
        return SamplerOutput(*out, top_logprob_ids=None, top_logprobs=None)

    @staticmethod
    def _plain_greedy(logits: torch.Tensor, info: SamplingBatchInfo) -> SamplerOutput:
        """All-greedy batch without penalties: raw == processed and the argmax always has rank 1."""
        next_ids = logits.argmax(dim=-1)
        lp = logits.log_softmax(dim=-1)
        ids, values = _top_logprobs(lp, info.max_top_logprobs)
        return SamplerOutput(next_token_ids=next_ids, logprobs=lp.gather(1, next_ids[:, None]).squeeze(1),
                             ranks=torch.ones_like(next_ids), top_logprob_ids=ids, top_logprobs=values)

    @staticmethod
    def _processed_with_greedy(adjusted, sampled_lp, raw, info: SamplingBatchInfo) -> torch.Tensor:
        """Processed distribution: warped for random rows, log_softmax(penalized logits) for greedy rows."""
        if not info.any_greedy:
            return sampled_lp
        greedy_lp = raw if (not info.has_penalties and raw is not None) else adjusted.log_softmax(dim=-1)
        return torch.where(info.is_greedy[:, None], greedy_lp, sampled_lp)

    @staticmethod
    def _finish(next_ids: torch.Tensor, chosen: torch.Tensor, info: SamplingBatchInfo) -> SamplerOutput:
        """Gather the sampled logprob, its rank and the top-K from the chosen distribution."""
        token_lp = chosen.gather(1, next_ids[:, None])
        ranks = (chosen > token_lp).sum(dim=-1) + 1 if info.need_ranks else torch.ones_like(next_ids)
        ids, values = _top_logprobs(chosen, info.max_top_logprobs)
        return SamplerOutput(next_token_ids=next_ids, logprobs=token_lp.squeeze(1), ranks=ranks,
                             top_logprob_ids=ids, top_logprobs=values)
