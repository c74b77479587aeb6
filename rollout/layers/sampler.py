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

import dataclasses
from dataclasses import dataclass

import torch

from rollout.device_copy import to_device
from rollout.sampling_params import SamplingParams

__all__ = ["SamplingRow", "SamplingBatchInfo", "SamplerOutput", "Sampler", "uniform_noise"]

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
class SamplingRow:
    """What the scheduler knows about one request at this step.

    ``seed`` is the row's effective seed (any Python int; reduced mod 2**64). ``output_len`` is the number of
    tokens generated so far, i.e. the position of the token being sampled. ``eos_token_ids`` are banned
    while ``output_len < params.min_new_tokens`` unless ``params.ignore_eos``; ``params.stop_token_ids`` are
    banned during the same window regardless of ``ignore_eos``.
    """

    params: SamplingParams
    seed: int
    output_len: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: list[int]


@dataclass
class SamplerOutput:
    """Result of one sampling step for a batch of B rows.

    ``next_token_ids`` [B] int64. ``logprobs`` [B] float32: logprob of the sampled token in the row's chosen
    distribution (raw or processed, per ``params.logprobs_mode``). ``ranks`` [B] int64: 1 + number of vocab
    entries with strictly greater logprob in that distribution. ``top_logprob_ids`` / ``top_logprobs``
    [B, K] with K = the largest ``params.logprobs`` in the batch (None when every row asks for None or 0);
    a row that asked for k < K should keep only its first k columns (sorted by descending logprob).
    """

    next_token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_logprob_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


@dataclass
class SamplingBatchInfo:
    """Per-step sampling tensors (all on one device) plus Python-side fast-path flags.

    Per-row tensors [B]: ``temperatures`` (1.0 on greedy rows), ``top_ps`` (1.0 = off), ``top_ks`` (vocab
    size = off), ``min_ps`` (0.0 = off), ``seeds`` (int64, seed mod 2**64 as two's complement),
    ``positions`` (int64 output_len), ``is_greedy`` (bool), ``use_processed`` (bool, logprobs_mode ==
    "processed"), ``repetition_penalties``, ``frequency_penalties``, ``presence_penalties`` (float32).
    Dense [B, V] tensors, only built when some row needs them (else None): ``seen_mask`` (bool, token in
    prompt or output; rows without repetition penalty are all False), ``output_counts`` (float32 count of
    each token in the output; rows without frequency/presence penalty are all 0). ``ban_rows`` /
    ``ban_cols`` (int64 index pairs set to -inf by min_new_tokens, or None).
    Flags: ``all_greedy``, ``any_greedy``, ``need_top_k_top_p``, ``need_min_p``, ``any_processed``,
    ``all_processed``, ``max_top_logprobs`` (K of the output top-logprobs, 0 = none).
    """

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    is_greedy: torch.Tensor
    use_processed: torch.Tensor
    repetition_penalties: torch.Tensor
    frequency_penalties: torch.Tensor
    presence_penalties: torch.Tensor
    seen_mask: torch.Tensor | None
    output_counts: torch.Tensor | None
    ban_rows: torch.Tensor | None
    ban_cols: torch.Tensor | None
    vocab_size: int
    all_greedy: bool
    any_greedy: bool
    need_top_k_top_p: bool
    need_min_p: bool
    any_processed: bool
    all_processed: bool
    max_top_logprobs: int

    @property
    def has_penalties(self) -> bool:
        """True when logits must be modified before sampling (penalties or min_new_tokens bans)."""
        return self.seen_mask is not None or self.output_counts is not None or self.ban_rows is not None

    @property
    def reusable(self) -> bool:
        """The next decode step of the same rows can reuse this info with ``advanced()`` (nothing in it
        depends on the tokens the rows generate next)."""
        return not self.has_penalties

    def advanced(self) -> "SamplingBatchInfo":
        """The same rows one position later (for the next decode step; only ``positions`` change)."""
        return dataclasses.replace(self, positions=self.positions + 1)

    @property
    def fast_path(self) -> bool:
        """True when the fused kernel covers the batch: no penalties, top-k/top-p, min-p or top logprobs."""
        return (not self.has_penalties and not self.need_top_k_top_p and not self.need_min_p
                and self.max_top_logprobs == 0)

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device | str) -> "SamplingBatchInfo":
        """Turn per-request rows into device tensors; neutral values stand in for unused features."""
        if not rows:
            raise ValueError("SamplingBatchInfo.build needs at least one row")
        ps = [r.params for r in rows]
        greedy = [p.temperature == 0.0 for p in ps]
        top_ks = [vocab_size if g or p.top_k <= 0 else min(p.top_k, vocab_size) for p, g in zip(ps, greedy)]
        top_ps = [1.0 if g else float(p.top_p) for p, g in zip(ps, greedy)]
        min_ps = [0.0 if g else float(p.min_p) for p, g in zip(ps, greedy)]
        processed = [p.logprobs_mode == "processed" for p in ps]
        k = max((p.logprobs or 0) for p in ps)

        # every per-row value travels in two host tensors and two copies (not one transfer per field)
        floats = to_device(torch.tensor([
            [1.0 if g else float(p.temperature) for p, g in zip(ps, greedy)], top_ps, min_ps,
            [float(p.repetition_penalty) for p in ps], [float(p.frequency_penalty) for p in ps],
            [float(p.presence_penalty) for p in ps], [float(g) for g in greedy], [float(x) for x in processed],
        ], dtype=torch.float32), device)
        ints = to_device(torch.tensor([top_ks, [_to_int64(r.seed) for r in rows], [int(r.output_len) for r in rows]],
                                       dtype=torch.int64), device)
        ban_rows, ban_cols = _min_tokens_bans(rows, vocab_size, device)
        return cls(
            temperatures=floats[0],
            top_ps=floats[1],
            top_ks=ints[0],
            min_ps=floats[2],
            seeds=ints[1],
            positions=ints[2],
            is_greedy=floats[6] > 0.5,
            use_processed=floats[7] > 0.5,
            repetition_penalties=floats[3],
            frequency_penalties=floats[4],
            presence_penalties=floats[5],
            seen_mask=_seen_mask(rows, vocab_size, device),
            output_counts=_output_counts(rows, vocab_size, device),
            ban_rows=ban_rows,
            ban_cols=ban_cols,
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            need_top_k_top_p=any(kk < vocab_size or pp < 1.0 for kk, pp in zip(top_ks, top_ps)),
            need_min_p=any(m > 0.0 for m in min_ps),
            any_processed=any(processed),
            all_processed=all(processed),
            max_top_logprobs=k,
        )


# ----------------------------------------------------------------------------------------------- build


def _to_int64(seed: int) -> int:
    """Reduce any Python int mod 2**64 and reinterpret as a signed int64."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return s - (1 << 64) if s >= (1 << 63) else s


def _index_pairs(per_row: list[list[int]], vocab_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten per-row token lists to (row, col) int64 index tensors, dropping ids outside [0, V)."""
    rows = [i for i, ids in enumerate(per_row) for _ in range(len(ids))]
    cols = [t for ids in per_row for t in ids]
    pairs = torch.tensor([rows, cols], dtype=torch.int64)
    pairs = to_device(pairs[:, (pairs[1] >= 0) & (pairs[1] < vocab_size)], device)  # filtered on the host
    return pairs[0], pairs[1]


def _seen_mask(rows: list[SamplingRow], vocab_size: int, device) -> torch.Tensor | None:
    """[B, V] bool: token occurs in prompt or output, for rows with repetition_penalty != 1 (else None)."""
    use = [r.params.repetition_penalty != 1.0 for r in rows]
    if not any(use):
        return None
    ids = [list(r.prompt_token_ids) + list(r.output_token_ids) if u else [] for r, u in zip(rows, use)]
    ri, ci = _index_pairs(ids, vocab_size, device)
    mask = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    mask[ri, ci] = True
    return mask


def _output_counts(rows: list[SamplingRow], vocab_size: int, device) -> torch.Tensor | None:
    """[B, V] float32 output-token counts, for rows with frequency/presence penalty != 0 (else None)."""
    use = [r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0 for r in rows]
    if not any(use):
        return None
    ids = [list(r.output_token_ids) if u else [] for r, u in zip(rows, use)]
    ri, ci = _index_pairs(ids, vocab_size, device)
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    counts.index_put_((ri, ci), torch.ones_like(ri, dtype=torch.float32), accumulate=True)
    return counts


def _min_tokens_bans(rows: list[SamplingRow], vocab_size: int, device):
    """(row, col) pairs to set to -inf because the row has not reached min_new_tokens; (None, None) if none."""
    per_row = []
    for r in rows:
        p = r.params
        active = r.output_len < p.min_new_tokens
        per_row.append(([] if p.ignore_eos else list(r.eos_token_ids)) + list(p.stop_token_ids) if active else [])
    if not any(per_row):
        return None, None
    return _index_pairs(per_row, vocab_size, device)


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
        :mod:`rollout.layers.triton_sampling`; ``fused_steps`` counts the steps it sampled."""
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
        from rollout.layers.triton_sampling import fused_sample

        self.fused_steps += 1
        out = fused_sample(logits, info.temperatures, info.seeds, info.positions, info.is_greedy, info.use_processed)
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
        ranks = (chosen > token_lp).sum(dim=-1) + 1
        ids, values = _top_logprobs(chosen, info.max_top_logprobs)
        return SamplerOutput(next_token_ids=next_ids, logprobs=token_lp.squeeze(1), ranks=ranks,
                             top_logprob_ids=ids, top_logprobs=values)
