"""Tests for rollout.layers.sampler against independent references (HF logits processors, plain loops)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

import rollout.layers.sampler as sampler_mod
from rollout.layers.sampler import Sampler, uniform_noise
from rollout.layers.sampling_info import SamplingBatchInfo, SamplingRow, _to_int64
from rollout.sampling_params import SamplingParams

NEG_INF = float("-inf")


def row(seed=0, output_len=None, prompt=(), output=(), eos=(), **params) -> SamplingRow:
    """A request row; it asks for logprobs (so ranks are counted) unless ``logprobs=None`` is passed."""
    params.setdefault("logprobs", 0)
    output = list(output)
    return SamplingRow(params=SamplingParams(**params), seed=seed,
                       output_len=len(output) if output_len is None else output_len,
                       prompt_token_ids=list(prompt), output_token_ids=output, eos_token_ids=list(eos))


def many(seeds, positions, **params) -> list[SamplingRow]:
    """Rows sharing one SamplingParams (cheap to build by the ten thousand), empty prompt/output."""
    sp = SamplingParams(**params)
    return [SamplingRow(params=sp, seed=s, output_len=p, prompt_token_ids=[], output_token_ids=[], eos_token_ids=[])
            for s, p in zip(seeds, positions)]


def run(logits: torch.Tensor, rows: list[SamplingRow]):
    info = SamplingBatchInfo.build(rows, logits.shape[-1], logits.device)
    return Sampler()(logits, info)


def randn(*shape, seed=0, scale=3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


# ------------------------------------------------------------------------------------- references


def ref_adjusted(x: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    """Penalties (HF repetition + plain-loop frequency/presence) and min_new_tokens bans on one row [V]."""
    p, x = r.params, x.float().clone()[None]
    ids = list(r.prompt_token_ids) + list(r.output_token_ids)
    if p.repetition_penalty != 1.0 and ids:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([ids]), x)
    for t in set(r.output_token_ids):
        c = r.output_token_ids.count(t)
        x[0, t] -= p.frequency_penalty * c + p.presence_penalty
    if r.output_len < p.min_new_tokens:
        for t in ([] if p.ignore_eos else r.eos_token_ids) + p.stop_token_ids:
            x[0, t] = NEG_INF
    return x[0]


def ref_processed(x: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    """Log of the distribution actually sampled from, via HF warpers."""
    p, x = r.params, ref_adjusted(x, r)[None]
    if p.temperature == 0.0:
        return torch.log_softmax(x[0], dim=-1)
    dummy = torch.zeros(1, 1, dtype=torch.long)
    x = TemperatureLogitsWarper(p.temperature)(dummy, x)
    if p.top_k > 0:
        x = TopKLogitsWarper(p.top_k)(dummy, x)
    if p.top_p < 1.0:
        x = TopPLogitsWarper(p.top_p)(dummy, x)
    if p.min_p > 0.0:
        x = MinPLogitsWarper(p.min_p)(dummy, x)
    return torch.log_softmax(x[0], dim=-1)


def ref_chosen(x: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    return ref_processed(x, r) if r.params.logprobs_mode == "processed" else torch.log_softmax(x.float(), dim=-1)


def ref_rank(dist: torch.Tensor, token: int) -> int:
    return 1 + sum(1 for v in dist.tolist() if v > dist[token].item())


def py_mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


def py_uniform(seed: int, pos: int, token: int) -> float:
    """Pure-Python spec of the counter-based hash (seed, position, token) -> U in (0, 1)."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    key = py_mix32((s & 0xFFFFFFFF) ^ 0x9E3779B9)
    key = py_mix32(key ^ (s >> 32))
    key = py_mix32(key ^ ((pos & 0xFFFFFFFF) ^ 0x85EBCA6B))
    key2 = py_mix32(key ^ 0x27D4EB2F)
    x = py_mix32(py_mix32(key ^ py_mix32(token ^ 0xC2B2AE35)) ^ key2)
    return ((x >> 9) * 2 + 1) / 2 ** 24


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token with zero probability"
    stat = ((counts[support] - expected[support]) ** 2 / expected[support]).sum().item()
    return stat, int(support.sum()) - 1


def assert_chi_square_ok(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    stat, dof = chi_square(tokens, probs)
    # ~6 standard deviations above the mean of a chi-square(dof): deterministic seeds, no flakiness.
    assert stat < dof + 6 * math.sqrt(2 * dof), (stat, dof)


# ------------------------------------------------------------------------------------------ greedy


def test_greedy_argmax_and_raw_logprobs():
    logits = randn(6, 500)
    out = run(logits, [row(temperature=0.0, logprobs=5) for _ in range(6)])
    ref_lp = logits.double() - torch.logsumexp(logits.double(), dim=-1, keepdim=True)
    assert torch.equal(out.next_token_ids, logits.argmax(dim=-1))
    assert out.next_token_ids.dtype == torch.int64 and out.ranks.dtype == torch.int64
    assert out.logprobs.dtype == torch.float32
    expect = ref_lp.gather(1, out.next_token_ids[:, None]).squeeze(1).float()
    torch.testing.assert_close(out.logprobs, expect, atol=1e-6, rtol=0)
    assert out.ranks.tolist() == [1] * 6
    top_vals, top_ids = ref_lp.float().topk(5, dim=-1)
    assert torch.equal(out.top_logprob_ids, top_ids)
    torch.testing.assert_close(out.top_logprobs, top_vals, atol=1e-6, rtol=0)


def test_greedy_ties_pick_lowest_index():
    logits = torch.zeros(2, 10)
    logits[0, [3, 7]] = 5.0
    logits[1, [2, 9]] = 1.0
    out = run(logits, [row(temperature=0.0), row(temperature=0.0, repetition_penalty=1.5, prompt=[0])])
    assert out.next_token_ids.tolist() == [3, 2]
    assert out.top_logprobs is None and out.top_logprob_ids is None
    mixed = run(torch.cat([logits, logits]), [row(temperature=0.0), row(seed=1, top_k=2),
                                              row(temperature=0.0, presence_penalty=0.5, output=[3]), row(seed=2)])
    assert mixed.next_token_ids[0].item() == 3 and mixed.next_token_ids[2].item() == 7


def test_all_greedy_fast_path_skips_sort_and_hash(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("fast path must not sort or hash")

    monkeypatch.setattr(sampler_mod, "uniform_noise", boom)
    monkeypatch.setattr(sampler_mod, "_top_k_top_p", boom)
    logits = randn(4, 100)
    out = run(logits, [row(temperature=0.0, top_k=3, top_p=0.5, logprobs=2) for _ in range(4)])
    assert torch.equal(out.next_token_ids, logits.argmax(dim=-1))
    out = run(logits, [row(temperature=0.0, presence_penalty=1.0, output=[1, 2])] * 4)
    assert out.next_token_ids.shape == (4,)


def test_no_sort_without_top_k_or_top_p(monkeypatch):
    monkeypatch.setattr(sampler_mod, "_top_k_top_p", lambda *a: (_ for _ in ()).throw(AssertionError("sorted")))
    out = run(randn(3, 50), [row(seed=i, min_p=0.1) for i in range(3)])
    assert out.next_token_ids.shape == (3,)


# ----------------------------------------------------------------------------------------- penalties


PENALTY_ROWS = [
    dict(repetition_penalty=1.7),
    dict(repetition_penalty=0.6),
    dict(frequency_penalty=0.8),
    dict(presence_penalty=1.3),
    dict(frequency_penalty=-0.5, presence_penalty=0.7, repetition_penalty=1.2),
    dict(),
]


@pytest.mark.parametrize("extra", PENALTY_ROWS)
def test_penalties_match_reference(extra):
    V = 20  # logprobs=20 then covers the whole processed distribution
    logits = randn(1, V, seed=3)
    r = row(temperature=0.0, logprobs=20, logprobs_mode="processed",
            prompt=[1, 5, 5, 9, 14], output=[5, 7, 7, 7, 12, 19], **extra)
    out = run(logits, [r])
    ref = ref_processed(logits[0], r)
    assert out.next_token_ids.item() == ref_adjusted(logits[0], r).argmax().item()
    torch.testing.assert_close(out.logprobs[0], ref[out.next_token_ids[0]], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.top_logprobs[0], ref.sort(descending=True).values, atol=1e-5, rtol=0)


def test_penalties_only_touch_rows_that_ask_for_them():
    V = 32
    logits = randn(3, V, seed=4)
    rows = [row(temperature=0.0, logprobs_mode="processed", logprobs=20, prompt=[1, 2], output=[3]),
            row(temperature=0.0, logprobs_mode="processed", logprobs=20, prompt=[1, 2], output=[3, 3],
                repetition_penalty=2.0, frequency_penalty=0.5),
            row(temperature=0.0, logprobs_mode="processed", logprobs=20, output=[4], presence_penalty=2.0)]
    out = run(logits, rows)
    for i, r in enumerate(rows):
        torch.testing.assert_close(out.top_logprobs[i], ref_processed(logits[i], r).topk(20).values,
                                   atol=1e-5, rtol=0)


def test_min_new_tokens_bans_eos_and_stop_ids():
    V = 20
    logits = torch.zeros(5, V)
    logits[:, 7] = 10.0   # eos
    logits[:, 11] = 9.0   # stop token id
    logits[:, 2] = 8.0
    common = dict(temperature=0.0, min_new_tokens=3, max_new_tokens=10, stop_token_ids=[11],
                  logprobs_mode="processed", logprobs=3)
    rows = [row(output_len=0, eos=[7], **common),                    # banned: eos and stop
            row(output_len=2, eos=[7], **common),                    # still banned
            row(output_len=3, eos=[7], **common),                    # allowed again
            row(output_len=1, eos=[7], ignore_eos=True, **common),   # eos allowed, stop banned
            row(output_len=0, eos=[7, 11], seed=1, **{**common, "temperature": 1.0})]
    out = run(logits, rows)
    assert out.next_token_ids.tolist()[:4] == [2, 2, 7, 7]
    assert out.next_token_ids[4].item() not in (7, 11)
    for i in (0, 1, 4):
        assert 7 not in out.top_logprob_ids[i, :2].tolist() and 11 not in out.top_logprob_ids[i, :2].tolist()
    processed0 = ref_processed(logits[0], rows[0])
    assert processed0[7] == NEG_INF and processed0[11] == NEG_INF
    torch.testing.assert_close(out.logprobs[0], processed0[2], atol=1e-6, rtol=0)
    # With ignore_eos, the stop token stays banned (row 3 would otherwise still pick 7 anyway).
    assert ref_processed(logits[3], rows[3])[11] == NEG_INF


# ---------------------------------------------------------------------------- processed distribution


WARP_ROWS = [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=5),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.9, min_p=0.05),
    dict(temperature=1.1, top_k=12, top_p=0.9, min_p=0.02),
    dict(temperature=0.5, top_k=1),
    dict(temperature=2.0, top_p=0.3, repetition_penalty=1.3, frequency_penalty=0.4),
]


@pytest.mark.parametrize("extra", WARP_ROWS)
def test_processed_logprobs_match_hf_warpers(extra):
    V = 20
    logits = randn(8, V, seed=5)
    rows = [row(seed=100 + i, logprobs=20, logprobs_mode="processed", prompt=[0, 1], output=[2, 2, 3], **extra)
            for i in range(8)]
    out = run(logits, rows)
    for i, r in enumerate(rows):
        ref = ref_processed(logits[i], r)
        tok = out.next_token_ids[i].item()
        assert ref[tok] > NEG_INF
        torch.testing.assert_close(out.logprobs[i], ref[tok], atol=1e-5, rtol=0)
        torch.testing.assert_close(out.top_logprobs[i], ref.sort(descending=True).values, atol=1e-5, rtol=0)
        finite = out.top_logprobs[i] > NEG_INF
        assert set(out.top_logprob_ids[i][finite].tolist()) == set(torch.nonzero(ref > NEG_INF).flatten().tolist())
        assert out.ranks[i].item() == ref_rank(ref, tok)


@pytest.mark.parametrize("extra", WARP_ROWS)
def test_samples_stay_in_support(extra):
    V, B = 300, 2000
    logits = randn(1, V, seed=6).expand(B, V).contiguous()
    rows = [row(seed=s, prompt=[0, 1], output=[2, 2, 3], **extra) for s in range(B)]
    out = run(logits, rows)
    support = ref_processed(logits[0], rows[0]) > NEG_INF
    assert support[out.next_token_ids].all()
    if extra.get("top_k") == 1:
        assert (out.next_token_ids == out.next_token_ids[0]).all()


@pytest.mark.parametrize("extra", [dict(temperature=1.0), dict(temperature=0.6, top_k=5),
                                   dict(temperature=1.4, top_p=0.7), dict(temperature=1.0, min_p=0.1),
                                   dict(temperature=0.8, top_k=6, top_p=0.9, presence_penalty=0.5)])
def test_empirical_frequencies_match_target(extra):
    V, B = 8, 20000
    base = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0, 1.5, 0.7])
    logits = base.expand(B, V).contiguous()
    rows = many(range(B), [0] * B, **extra)
    out = run(logits, rows)
    probs = ref_processed(base, rows[0]).exp()
    assert_chi_square_ok(out.next_token_ids, probs)


def test_frequencies_over_positions_and_pairwise_independence():
    V, B = 4, 20000
    base = torch.tensor([0.3, -0.2, 1.0, 0.0])
    probs = torch.softmax(base, dim=-1)
    logits = base.expand(B, V).contiguous()
    # One seed, varying positions: still the target distribution.
    by_pos = run(logits, many([1234] * B, range(B))).next_token_ids
    assert_chi_square_ok(by_pos, probs)
    # Same seeds at positions 0 and 1: the joint distribution factorizes.
    a = run(logits, many(range(B), [0] * B)).next_token_ids
    b = run(logits, many(range(B), [1] * B)).next_token_ids
    assert_chi_square_ok(a * V + b, (probs[:, None] * probs[None, :]).flatten())


# ------------------------------------------------------------------------------- determinism by seed


def test_sample_independent_of_batch_companions_and_position():
    V = 1000
    target_logits = randn(V, seed=7)
    target = row(seed=987654321, output_len=17, temperature=0.8, top_p=0.95, top_k=50, logprobs=3,
                 output=[1, 2, 3], repetition_penalty=1.1)
    alone = run(target_logits[None], [target])
    companions = randn(7, V, seed=8)
    batch_a = torch.cat([target_logits[None], companions[:3]])
    out_a = run(batch_a, [target, row(temperature=0.0), row(seed=1), row(seed=2, min_p=0.2, logprobs=7)])
    batch_b = torch.cat([companions[3:], target_logits[None]])
    out_b = run(batch_b, [row(seed=5, top_k=3), row(temperature=0.0, presence_penalty=1.0, output=[4]),
                          row(seed=6, logprobs_mode="processed"), row(seed=9, top_p=0.5), target])
    again = run(target_logits[None], [target])
    for out, i in ((out_a, 0), (out_b, 4), (again, 0)):
        assert out.next_token_ids[i] == alone.next_token_ids[0]
        assert out.logprobs[i] == alone.logprobs[0]
        assert out.ranks[i] == alone.ranks[0]
        assert torch.equal(out.top_logprob_ids[i, :3], alone.top_logprob_ids[0])


def test_batch_equals_rows_one_by_one():
    V, B = 200, 24
    logits = randn(B, V, seed=9)
    rows = [row(seed=3 * i + 1, output_len=i, temperature=[0.0, 0.7, 1.0, 1.5][i % 4],
                top_k=[-1, 10][i % 2], top_p=[1.0, 0.9, 0.6][i % 3], output=[i % 7, 3], frequency_penalty=0.2 * (i % 2),
                logprobs_mode=["raw", "processed"][i % 2]) for i in range(B)]
    batched = run(logits, rows)
    for i, r in enumerate(rows):
        single = run(logits[i:i + 1], [r])
        assert batched.next_token_ids[i] == single.next_token_ids[0]
        assert batched.ranks[i] == single.ranks[0]
        torch.testing.assert_close(batched.logprobs[i], single.logprobs[0], atol=1e-6, rtol=0)


def test_different_seeds_and_positions_give_different_samples():
    V, B = 1000, 400
    logits = torch.zeros(B, V)  # uniform: every token equally likely
    by_seed = run(logits, [row(seed=s) for s in range(B)]).next_token_ids
    by_pos = run(logits, [row(seed=42, output_len=p) for p in range(B)]).next_token_ids
    # ~B * (1 - e^{-B/V}) / (B/V) ~ 330 distinct values expected among 400 uniform draws over 1000.
    assert len(set(by_seed.tolist())) > 280
    assert len(set(by_pos.tolist())) > 280
    assert (by_seed != by_pos).float().mean() > 0.9


def test_hash_matches_python_reference_and_is_strictly_inside_unit_interval():
    seeds = [0, 1, 2 ** 31, 2 ** 63 + 5, -1, -(2 ** 40), 123456789012345678901234]
    positions = [0, 1, 7, 2 ** 33 + 3, 5, 0, 99]
    V = 37
    seeds64 = torch.tensor([_to_int64(s) for s in seeds], dtype=torch.int64)
    u = uniform_noise(seeds64, torch.tensor(positions, dtype=torch.int64), V)
    expect = torch.tensor([[py_uniform(s, p, t) for t in range(V)] for s, p in zip(seeds, positions)],
                          dtype=torch.float64)
    assert torch.equal(u.double(), expect)
    assert (u > 0).all() and (u < 1).all()
    big = uniform_noise(torch.arange(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64), 4096)
    assert (big > 0).all() and (big < 1).all() and (-torch.log(big) > 0).all()
    assert abs(big.mean().item() - 0.5) < 0.005


def test_no_global_rng_use():
    logits = randn(4, 100, seed=10)
    rows = [row(seed=i, top_p=0.9) for i in range(4)]
    torch.manual_seed(0)
    first = run(logits, rows).next_token_ids
    torch.manual_seed(1)
    torch.rand(1000)
    assert torch.equal(first, run(logits, rows).next_token_ids)


# ---------------------------------------------------------------------------- logprobs, ranks, mixes


def test_top_logprobs_and_ranks_from_chosen_distribution():
    V = 500
    logits = randn(4, V, seed=11)
    rows = [row(seed=1, temperature=1.0, logprobs=7, logprobs_mode="raw"),
            row(seed=2, temperature=0.5, top_k=40, logprobs=3, logprobs_mode="processed"),
            row(seed=3, temperature=1.2, logprobs=None),
            row(seed=4, temperature=2.0, logprobs=0, logprobs_mode="processed")]
    out = run(logits, rows)
    assert out.top_logprob_ids.shape == (4, 7) and out.top_logprobs.shape == (4, 7)
    assert out.top_logprob_ids.dtype == torch.int64 and out.top_logprobs.dtype == torch.float32
    for i, r in enumerate(rows):
        dist = ref_chosen(logits[i], r)
        tok = out.next_token_ids[i].item()
        torch.testing.assert_close(out.logprobs[i], dist[tok], atol=1e-5, rtol=0)
        assert out.ranks[i].item() == ref_rank(dist, tok)
        vals, ids = dist.topk(7)
        assert torch.equal(out.top_logprob_ids[i], ids)
        torch.testing.assert_close(out.top_logprobs[i], vals, atol=1e-5, rtol=0)
    # A raw-mode random row usually samples something other than the mode, with rank > 1 somewhere.
    many = run(randn(1, V, seed=12).expand(64, V).contiguous(), [row(seed=s, temperature=1.5) for s in range(64)])
    assert (many.ranks > 1).any()
    # no row asks for logprobs: ranks are not counted (outputs without logprobs carry none); tokens are the same
    quiet = run(randn(1, V, seed=12).expand(64, V).contiguous(),
                [row(seed=s, temperature=1.5, logprobs=None) for s in range(64)])
    assert quiet.ranks.tolist() == [1] * 64 and torch.equal(quiet.next_token_ids, many.next_token_ids)


def test_mixed_batch():
    V = 128
    logits = randn(6, V, seed=13)
    rows = [row(temperature=0.0, logprobs=4),
            row(seed=1, temperature=0.9, top_p=0.8, logprobs=2, logprobs_mode="processed"),
            row(temperature=0.0, repetition_penalty=1.5, prompt=[int(logits[2].argmax())], logprobs=4,
                logprobs_mode="processed"),
            row(seed=2, temperature=1.0, frequency_penalty=1.0, presence_penalty=0.5, output=[1, 1, 2]),
            row(seed=3, temperature=0.7, min_p=0.1, min_new_tokens=2, max_new_tokens=5, output_len=0, eos=[5],
                logprobs=1),
            row(seed=4, temperature=1.0, top_k=3, logprobs=4, logprobs_mode="processed")]
    out = run(logits, rows)
    for i, r in enumerate(rows):
        dist = ref_chosen(logits[i], r)
        processed = ref_processed(logits[i], r)
        tok = out.next_token_ids[i].item()
        if r.params.temperature == 0.0:
            assert tok == ref_adjusted(logits[i], r).argmax().item()
        assert processed[tok] > NEG_INF
        torch.testing.assert_close(out.logprobs[i], dist[tok], atol=1e-5, rtol=0)
        assert out.ranks[i].item() == ref_rank(dist, tok)
        k = r.params.logprobs or 0
        torch.testing.assert_close(out.top_logprobs[i, :k], dist.topk(k).values, atol=1e-5, rtol=0)
    assert out.next_token_ids[2].item() != logits[2].argmax().item()  # penalty moved the greedy choice
    assert out.ranks[0].item() == 1 and out.ranks[2].item() == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits(dtype):
    V = 300
    logits = randn(4, V, seed=14).to(dtype)
    rows = [row(temperature=0.0, logprobs=3), row(seed=1, top_k=20, logprobs=3, logprobs_mode="processed"),
            row(seed=2, top_p=0.9), row(temperature=0.0, presence_penalty=0.5, output=[0, 1])]
    out = run(logits, rows)
    x = logits.float()
    assert out.logprobs.dtype == torch.float32 and out.top_logprobs.dtype == torch.float32
    assert out.next_token_ids[0].item() == x[0].argmax().item()
    torch.testing.assert_close(out.logprobs[0], torch.log_softmax(x[0], -1)[out.next_token_ids[0]], atol=1e-6, rtol=0)
    for i, r in enumerate(rows):
        dist = ref_chosen(x[i], r)
        tok = out.next_token_ids[i].item()
        assert ref_processed(x[i], r)[tok] > NEG_INF
        torch.testing.assert_close(out.logprobs[i], dist[tok], atol=1e-5, rtol=0)
    assert out.next_token_ids[3].item() == ref_adjusted(x[3], rows[3]).argmax().item()
