"""Tests for rollout.kernels.sampling (fused fast-path sampler) against the torch Sampler.

Without a CUDA device the kernel runs under Triton's CPU interpreter (see ``triton_interpreter``).
"""

from __future__ import annotations

from triton_interpreter import DEVICE, INTERPRETED  # first: sets up the interpreter before triton is imported

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from rollout.kernels import sampling as triton_sampling  # noqa: E402
from rollout.layers.sampler import Sampler, uniform_noise  # noqa: E402
from rollout.layers.sampling_info import SamplingBatchInfo, SamplingRow, _to_int64  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402

NEG_INF = float("-inf")
TEMPERATURES = [0.0, 0.3, 0.7, 1.0, 1.5]
SEEDS = [2**70 + 3, -5, 2**64 - 1, 0, 123456789012345678901234, -(2**40)]
POSITIONS = [0, 5, 2**33 + 1, 123, 7]


def row(seed=0, output_len=0, **params) -> SamplingRow:
    """A request row; it asks for logprobs (so its rank is counted) unless ``logprobs=None`` is passed."""
    params.setdefault("logprobs", 0)
    return SamplingRow(params=SamplingParams(**params), seed=seed, output_len=output_len,
                       prompt_token_ids=[], output_token_ids=[], eos_token_ids=[])


def mixed_rows(n: int, salt: int = 0) -> list[SamplingRow]:
    """Greedy and random rows over several temperatures, both logprob modes, odd seeds and positions."""
    return [row(seed=SEEDS[(i + salt) % len(SEEDS)] + salt, output_len=POSITIONS[i % len(POSITIONS)] + salt,
                temperature=TEMPERATURES[i % len(TEMPERATURES)],
                logprobs_mode=["raw", "processed"][(i // len(TEMPERATURES)) % 2]) for i in range(n)]


def randn(*shape, seed=0, scale=3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE)


def build(rows, vocab_size: int) -> SamplingBatchInfo:
    info = SamplingBatchInfo.build(rows, vocab_size, DEVICE)
    assert info.fast_path
    return info


def fused(logits: torch.Tensor, info: SamplingBatchInfo, block_size=None, num_chunks=None):
    return triton_sampling.fused_sample(logits, info.temperatures, info.seeds, info.positions, info.is_greedy,
                                        info.use_processed, count_ranks=info.need_ranks, block_size=block_size,
                                        num_chunks=num_chunks)


def assert_matches_torch(logits: torch.Tensor, rows, block_size=None, num_chunks=None):
    """Tokens and ranks equal to the torch Sampler's, logprobs within 1e-5; returns the fused outputs."""
    info = build(rows, logits.shape[-1])
    return assert_equals_reference(Sampler()(logits, info), fused(logits, info, block_size, num_chunks))


def assert_equals_reference(ref, out):
    """``assert_matches_torch`` against a torch Sampler output ``ref`` computed already; returns ``out``."""
    ids, logprobs, ranks = out
    n = ref.next_token_ids.shape[0]
    assert ids.dtype == torch.int64 and ranks.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert ids.shape == ranks.shape == logprobs.shape == (n,)
    assert ids.tolist() == ref.next_token_ids.tolist()
    assert ranks.tolist() == ref.ranks.tolist()
    torch.testing.assert_close(logprobs, ref.logprobs, atol=1e-5, rtol=0)
    return ids, logprobs, ranks


# ------------------------------------------------------------------------------------------ noise


def test_noise_is_bit_identical_to_uniform_noise():
    seeds = torch.tensor([_to_int64(s) for s in SEEDS], dtype=torch.int64, device=DEVICE)
    positions = torch.tensor([0, 1, 7, 2**33 + 3, 5, 2**40], dtype=torch.int64, device=DEVICE)
    u, e = triton_sampling._noise_for_test(seeds, positions, 3001)
    ref = uniform_noise(seeds, positions, 3001)
    assert torch.equal(u, ref)
    truth = -ref.double().log()
    assert ((e.double() - truth).abs() / truth).max().item() < 1.2e-7


def test_log_within_one_ulp_on_every_noise_value_and_on_sums():
    """E = -log(U) for all 2**23 values U can take (relative precision matters near U = 1, where E ~ 6e-8),
    and log over the range of the softmax sums."""
    block = 2**20 if INTERPRETED else 8192  # the interpreter's cost is per program: a few large ones
    j = torch.arange(2**23, dtype=torch.float64)
    u = ((2 * j + 1) * 2.0**-24).float()
    e = -triton_sampling._log_for_test(u.to(DEVICE), block).cpu().double()
    truth = -u.double().log()
    assert ((e - truth).abs() / truth).max().item() < 1.2e-7
    sums = torch.logspace(0, 5.5, 100_001, dtype=torch.float64).float()
    got = triton_sampling._log_for_test(sums.to(DEVICE), block).cpu().double()
    truth = sums.double().log()
    nearest = truth.float()
    ulp = (torch.nextafter(nearest, torch.tensor(float("inf"))) - nearest).double()
    assert ((got - truth).abs() <= ulp).all()


# ------------------------------------------------------------------------------- against the sampler


@pytest.mark.parametrize("seed,vocab", [(0, 5000), (1, 1000), (2, 4096), (3, 2049), (4, 10)])
def test_mixed_batch_matches_torch_sampler(seed, vocab):
    rows = mixed_rows(16, salt=seed)
    logits = randn(16, vocab, seed=seed)
    ids, _, ranks = assert_matches_torch(logits, rows)
    assert (ranks[[r.params.temperature > 0 for r in rows]] > 1).any()  # ranks are not trivially 1
    assert all(ranks[i] == 1 for i, r in enumerate(rows) if r.params.temperature == 0)


def test_all_greedy_and_all_random_batches():
    logits = randn(8, 3000, seed=4)
    assert_matches_torch(logits, [row(temperature=0.0, logprobs_mode="processed")] * 8)
    assert_matches_torch(logits, [row(seed=s, output_len=s, temperature=0.8) for s in range(8)])
    assert_matches_torch(logits, [row(seed=s, temperature=1.2, logprobs_mode="processed") for s in range(8)])


def test_neg_inf_entries_and_partial_last_block():
    V = 1000 + 37  # with block_size=256: 5 blocks, the last one partial
    logits = randn(10, V, seed=5)
    logits[0, ::2] = NEG_INF                    # half the vocab banned
    logits[1, :] = NEG_INF
    logits[1, [17, V - 1]] = torch.tensor([0.5, 2.0], device=DEVICE)  # two finite tokens, one in the tail
    logits[2, : V - 5] = NEG_INF                # only the tail block is finite
    logits[3, 300:] = NEG_INF
    rows = mixed_rows(10, salt=5)
    rows[1] = row(seed=9, temperature=1.0, logprobs_mode="processed")
    rows[2] = row(seed=11, temperature=0.7)
    for block_size in (None, 256):
        ids, _, _ = assert_matches_torch(logits, rows, block_size)
        assert ids[1].item() in (17, V - 1) and ids[2].item() >= V - 5 and ids[3].item() < 300
        assert logits[0, ids[0]].item() > NEG_INF


def test_greedy_ties_pick_lowest_index_across_blocks():
    logits = torch.zeros(3, 1000, device=DEVICE)
    logits[0, [700, 300, 900]] = 5.0   # ties in different blocks of 256
    logits[1, [10, 11]] = 2.0          # ties in one block
    ids, logprobs, ranks = assert_matches_torch(logits, [row(temperature=0.0)] * 3, block_size=256)
    assert ids.tolist() == [300, 10, 0] and ranks.tolist() == [1, 1, 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits(dtype):
    logits = randn(12, 3001, seed=6).to(dtype)
    assert_matches_torch(logits, mixed_rows(12, salt=6))


def test_strided_logits_rows():
    wide = randn(6, 2100, seed=7)
    assert_matches_torch(wide[:, :2000], mixed_rows(6, salt=7))


def test_peaked_logits_skip_blocks_and_keep_results():
    """Peaked rows (as from a trained model): most blocks are skipped by both loops; results must not move."""
    V, B = 6000, 10
    logits = randn(B, V, seed=8, scale=1.0)
    hot = torch.tensor([5, 100, 2500, 5999, 4000, 3, 1234, 4096, 50, 2047], device=DEVICE)
    logits[torch.arange(B), hot] += 30.0
    logits[torch.arange(B), (hot + 1500) % V] += 29.0   # a far-away runner-up
    rows = mixed_rows(B, salt=8)
    small = assert_matches_torch(logits, rows, block_size=256)
    default = assert_matches_torch(logits, rows)
    assert all(torch.equal(a, b) for a, b in zip(small[::2], default[::2]))


@pytest.mark.parametrize("scale", [0.01, 1.0, 60.0])
def test_flat_and_wide_logits_through_the_per_entry_race_bound(scale):
    """Random rows over many small blocks, where after the first blocks most are passed over by the per-entry
    bound (flat rows: nearly every block; wide rows, |logits / T| up to ~4,000: the bound's relative slack):
    tokens and ranks still equal the torch sampler's, at temperatures from 0.05 to 3, one chunk and several."""
    V, B = 2048, 12  # 64 blocks a row
    logits = randn(B, V, seed=21, scale=scale)
    rows = [row(seed=SEEDS[i % len(SEEDS)] + i, output_len=POSITIONS[i % len(POSITIONS)] + 3 * i,
                temperature=[0.05, 0.6, 1.0, 3.0][i % 4], logprobs_mode=["raw", "processed"][(i // 4) % 2])
            for i in range(B)]
    one = assert_matches_torch(logits, rows, block_size=32, num_chunks=1)
    several = assert_matches_torch(logits, rows, block_size=32, num_chunks=5)
    assert torch.equal(one[0], several[0]) and torch.equal(one[2], several[2])


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_ranks_are_counted_only_when_some_row_asks_for_logprobs(num_chunks):
    logits = randn(12, 3000, seed=11)
    rows = [dataclasses_replace(r, logprobs=None) for r in mixed_rows(12, salt=4)]
    info = build(rows, 3000)
    assert not info.need_ranks
    counted = assert_matches_torch(logits, mixed_rows(12, salt=4), num_chunks=num_chunks)
    ids, logprobs, ranks = assert_matches_torch(logits, rows, num_chunks=num_chunks)
    assert ranks.tolist() == [1] * 12 and max(counted[2].tolist()) > 1
    assert ids.tolist() == counted[0].tolist() and logprobs.tolist() == counted[1].tolist()
    one = rows[:-1] + mixed_rows(12, salt=4)[-1:]  # one row with logprobs: every row's rank is counted
    assert build(one, 3000).need_ranks
    assert assert_matches_torch(logits, one, num_chunks=num_chunks)[2].tolist() == counted[2].tolist()


def dataclasses_replace(r: SamplingRow, **params) -> SamplingRow:
    return dataclasses.replace(r, params=dataclasses.replace(r.params, **params))


def test_sample_depends_only_on_own_row():
    V = 2500
    target = randn(1, V, seed=9)
    r = row(seed=2**65 + 17, output_len=41, temperature=0.9, logprobs_mode="processed")
    alone = fused(target, build([r], V))
    batch = torch.cat([randn(3, V, seed=10), target])
    together = fused(batch, build(mixed_rows(3) + [r], V))
    assert [t[0].item() for t in alone] == [t[3].item() for t in together]


# ------------------------------------------------------------------------------------ row split


def chunk_of(token: int, block_size: int, num_blocks: int, num_chunks: int) -> int:
    """The chunk that holds ``token`` under ``fused_sample``'s layout."""
    _, per_chunk = triton_sampling._chunk_layout(1, num_blocks, torch.device("cpu"), num_chunks)
    return token // block_size // per_chunk


CHUNKS_V, CHUNKS_BLOCK, CHUNKS_NUM_BLOCKS = 12 * 128 + 85, 128, 13


@pytest.fixture(scope="module")
def chunk_counts_case():
    """test_chunk_counts_match_torch_and_each_other's batch, its torch reference and its one-chunk result,
    computed once for every chunk count."""
    V, B = CHUNKS_V, 10
    logits = randn(B, V, seed=12)
    rows = mixed_rows(B, salt=12)  # 5 temperatures (greedy among them) x both logprobs modes
    info = build(rows, V)
    return logits, rows, Sampler()(logits, info), fused(logits, info, CHUNKS_BLOCK, 1)


@pytest.mark.parametrize("num_chunks", [1, 2, 5, 7, 13, 100])
def test_chunk_counts_match_torch_and_each_other(num_chunks, chunk_counts_case):
    """V = 1621 in blocks of 128: 13 blocks, the last partial; 2, 5 and 7 chunks leave a shorter last chunk
    (5: a last chunk of only the partial block), 13 and 100 (clamped) give one block per chunk."""
    logits, rows, ref, one = chunk_counts_case
    block = CHUNKS_BLOCK
    chunks, per_chunk = triton_sampling._chunk_layout(len(rows), CHUNKS_NUM_BLOCKS, logits.device, num_chunks)
    assert -(-CHUNKS_V // block) == CHUNKS_NUM_BLOCKS and CHUNKS_V % block  # the last block partial
    assert per_chunk == 1 if num_chunks >= CHUNKS_NUM_BLOCKS else chunks * per_chunk > CHUNKS_NUM_BLOCKS or chunks == 1
    out = one if num_chunks == 1 else fused(logits, build(rows, CHUNKS_V), block, num_chunks)
    ids, logprobs, ranks = assert_equals_reference(ref, out)
    one_ids, one_logprobs, one_ranks = one
    assert torch.equal(ids, one_ids) and torch.equal(ranks, one_ranks)
    torch.testing.assert_close(logprobs, one_logprobs, atol=1e-6, rtol=0)
    if num_chunks > 1:  # some rank sums counts of several chunks
        spread = [len({chunk_of(int(j), block, CHUNKS_NUM_BLOCKS, num_chunks)
                       for j in (logits[i] > logits[i, ids[i]]).nonzero()})
                  for i, r in enumerate(rows) if r.params.temperature > 0 and r.params.logprobs_mode == "raw"]
        assert max(spread) >= 2


@pytest.mark.parametrize("num_chunks", [3, 8])
def test_greedy_ties_across_chunk_boundaries_pick_lowest_index(num_chunks):
    """Blocks of 128 over V = 1024: 3 chunks are blocks [0, 3), [3, 6), [6, 8); 8 chunks one block each."""
    logits = torch.zeros(5, 1024, device=DEVICE)
    logits[0, [384, 383]] = 4.0          # the last entry of chunk 0 (of 3) and the first of chunk 1
    logits[1, [128, 127]] = 4.0          # the same at the first boundary of 8 chunks
    logits[2, [1023, 900, 768]] = 4.0    # ties inside the last chunk and the one before it
    logits[3, [1000, 5]] = 4.0           # first and last chunk
    ids, _, ranks = assert_matches_torch(logits, [row(temperature=0.0)] * 5, 128, num_chunks)
    assert ids.tolist() == [383, 127, 768, 5, 0] and ranks.tolist() == [1] * 5


def test_chunks_that_are_all_neg_inf():
    """4 chunks of 256 over V = 1024: rows whose finite entries sit in one chunk (or one entry)."""
    V, block = 1024, 128
    logits = randn(8, V, seed=13)
    logits[0, :512] = NEG_INF            # chunks 0 and 1 banned
    logits[1, :768] = NEG_INF            # only the last chunk finite
    logits[2, 256:] = NEG_INF            # only the first chunk finite
    logits[3, :] = NEG_INF
    logits[3, 600] = 1.5                 # one finite entry, in chunk 2
    logits[4, 256:768] = NEG_INF         # the middle chunks banned
    logits[5:, 300:700] = NEG_INF
    rows = [row(seed=s, output_len=s, temperature=t, logprobs_mode=mode)
            for s, (t, mode) in enumerate([(0.0, "raw"), (0.8, "raw"), (1.3, "processed"), (0.7, "processed"),
                                           (0.0, "processed"), (1.0, "raw"), (0.5, "processed"), (0.0, "raw")])]
    ids, logprobs, ranks = assert_matches_torch(logits, rows, block, 4)
    assert ids[0] >= 512 and ids[1] >= 768 and ids[2] < 256 and ids[3] == 600
    assert ranks[3] == 1 and logprobs[3] == 0.0
    assert torch.isfinite(logprobs).all()


def test_batch_of_one_splits_its_row():
    V, block = 4000, 256  # 16 blocks: 4 chunks by default off CUDA, or one per block
    logits = randn(1, V, seed=14)
    for r in (row(seed=3, output_len=9, temperature=1.1), row(temperature=0.0),
              row(seed=5, temperature=0.6, logprobs_mode="processed")):
        outs = [assert_matches_torch(logits, [r], block, n) for n in (None, 1, 16)]
        assert all(torch.equal(a[0], outs[0][0]) and torch.equal(a[2], outs[0][2]) for a in outs)


def test_chunk_layout_rule(monkeypatch):
    """1 <= S <= blocks, no empty chunk, the fewest blocks per chunk for the S asked; on CUDA S aims at
    4 programs per SM over the batch."""
    cpu = torch.device("cpu")
    for batch in (1, 2, 7, 256, 1000):
        for num_blocks in (1, 2, 5, 24, 63, 64):
            for asked in (None, 1, 3, 7, 64, 500):
                chunks, per_chunk = triton_sampling._chunk_layout(batch, num_blocks, cpu, asked)
                want = min(triton_sampling._INTERPRETER_CHUNKS if asked is None else asked, num_blocks)
                assert 1 <= chunks <= num_blocks
                assert (chunks - 1) * per_chunk < num_blocks <= chunks * per_chunk
                assert per_chunk == -(-num_blocks // want)
    assert triton_sampling._chunk_layout(3, 24, cpu) == (4, 6)  # the CPU tests run multi-chunk paths

    class H200:
        multi_processor_count = 132
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: H200())
    cuda = torch.device("cuda", 0)
    vocab_blocks = -(-128256 // 2048)  # 63
    assert triton_sampling._chunk_layout(256, vocab_blocks, cuda) == (3, 21)
    assert triton_sampling._chunk_layout(1, vocab_blocks, cuda) == (63, 1)
    assert triton_sampling._chunk_layout(64, vocab_blocks, cuda) == (9, 7)
    assert triton_sampling._chunk_layout(13, vocab_blocks, cuda) == (32, 2)  # 41 asked: 2 blocks each either way
    assert triton_sampling._chunk_layout(1024, vocab_blocks, cuda) == (1, 63)
    assert triton_sampling._chunk_layout(5, 4, cuda, 2) == (2, 2)  # num_chunks overrides the SM rule


# ---------------------------------------------------------------------------------------- dispatch


def test_fast_path_flag():
    V = 50
    assert SamplingBatchInfo.build(mixed_rows(6), V, DEVICE).fast_path
    for params in (dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1), dict(logprobs=2), dict(presence_penalty=0.5),
                   dict(repetition_penalty=1.2)):
        rows = mixed_rows(3) + [SamplingRow(params=SamplingParams(**params), seed=1, output_len=1,
                                            prompt_token_ids=[1], output_token_ids=[2], eos_token_ids=[])]
        assert not SamplingBatchInfo.build(rows, V, DEVICE).fast_path, params


def test_sampler_fused_dispatch():
    V = 3000
    logits = randn(8, V, seed=11)
    sampler, reference = Sampler(fused=True), Sampler()
    assert Sampler().fused is False

    fast = build(mixed_rows(8, salt=11), V)
    out, ref = sampler(logits, fast), reference(logits, fast)
    assert sampler.fused_steps == 1
    assert out.top_logprob_ids is None and out.top_logprobs is None
    assert torch.equal(out.next_token_ids, ref.next_token_ids) and torch.equal(out.ranks, ref.ranks)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    direct = fused(logits, fast)
    assert all(torch.equal(a, b) for a, b in zip((out.next_token_ids, out.logprobs, out.ranks), direct))

    for extra in (dict(top_k=20), dict(logprobs=3), dict(frequency_penalty=0.5)):
        rows = [row(seed=i, temperature=0.8, **extra) for i in range(8)]
        info = SamplingBatchInfo.build(rows, V, DEVICE)
        out, ref = sampler(logits, info), reference(logits, info)
        assert sampler.fused_steps == 1, extra  # not on the fast path: the torch path ran, bit for bit
        for a, b in zip((out.next_token_ids, out.logprobs, out.ranks), (ref.next_token_ids, ref.logprobs, ref.ranks)):
            assert torch.equal(a, b)
