"""Per-step sampling parameters as device tensors: ``SamplingRow`` (what the scheduler knows about one request)
and ``SamplingBatchInfo`` (the batch's tensors and fast-path flags, built once per step, see ``Sampler``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rollout.device_copy import to_device
from rollout.sampling_params import SamplingParams


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
    ``all_processed``, ``max_top_logprobs`` (K of the output top-logprobs, 0 = none), ``need_ranks`` (some row
    asked for logprobs, whose outputs carry the sampled token's rank; else ranks are not counted).
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
    need_ranks: bool = True

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
        greedy = [p.greedy for p in ps]
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
            need_ranks=any(p.logprobs is not None for p in ps),
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
