"""rollout.kernels.balanced_decode: the piece plan against its definition, and the attention over the pieces
against attention written out in float32 torch over the widened KV, for requests cut into one, two and many
pieces (a straggler)."""

from __future__ import annotations

from triton_interpreter import DEVICE  # first: sets up the interpreter before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from rollout.kernels.balanced_decode import (DecodePieces, balanced_decode_attention, balanced_programs,  # noqa: E402
                                             plan_pieces, wants_pieces)
from rollout.kernels.decode_attention import DecodeLaunch  # noqa: E402
from test_triton_decode import make_case, reference  # noqa: E402

SEQ_LENS = [1, 5, 64, 65, 130, 300, 2, 1000]


def expected_plan(seq_lens: list[int], programs: int, min_chunk: int) -> tuple[list[int], list[int]]:
    chunk = max(-(-sum(seq_lens) // programs), min_chunk)
    counts = [-(-n // chunk) for n in seq_lens]
    first = [sum(counts[:b]) for b in range(len(seq_lens) + 1)]
    owner = [b for b, c in enumerate(counts) for _ in range(c)]
    return first, owner + [-1] * (len(seq_lens) + programs - len(owner))


def indptr_of(seq_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(seq_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("programs,min_chunk", [(1, 1), (4, 16), (40, 1), (7, 256), (3, 10_000)])
def test_plan_cuts_each_request_into_pieces_of_at_most_the_chunk(programs, min_chunk):
    pieces = DecodePieces.new(len(SEQ_LENS), programs, torch.device(DEVICE))
    pieces.owner.fill_(7)  # stale entries from an earlier step are overwritten
    plan_pieces(indptr_of(SEQ_LENS), len(SEQ_LENS), pieces, min_chunk)
    first, owner = expected_plan(SEQ_LENS, programs, min_chunk)
    assert pieces.first.tolist() == first and pieces.owner.tolist() == owner


def test_plan_covers_batches_larger_than_one_block():
    seq_lens = [3] * 1030 + [5000]
    pieces = DecodePieces.new(len(seq_lens), 20, torch.device(DEVICE))
    plan_pieces(indptr_of(seq_lens), len(seq_lens), pieces, 16)
    first, owner = expected_plan(seq_lens, 20, 16)
    assert pieces.first.tolist() == first and pieces.owner.tolist() == owner


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("programs,min_chunk", [(1, 1), (4, 16), (40, 1), (3, 10_000)])
def test_matches_float32_attention_and_leaves_counters_zero(kv_dtype, programs, min_chunk):
    hq, hk, d = 8, 2, 64
    q_dtype = torch.float16 if kv_dtype.itemsize == 1 else torch.bfloat16
    q, k_buf, v_buf, indptr, indices = make_case(SEQ_LENS, hq, hk, d, kv_dtype, q_dtype, seed=3)
    pieces = DecodePieces.new(len(SEQ_LENS), programs, q.device)
    plan_pieces(indptr, len(SEQ_LENS), pieces, min_chunk)
    counters = torch.zeros(len(SEQ_LENS) * hk, dtype=torch.int32, device=q.device)
    want = reference(q, k_buf, v_buf, indptr, indices, d ** -0.5, compute=q_dtype)
    tol = 1e-2 if q_dtype == torch.bfloat16 else 3e-3
    for _ in range(2):  # the counts are back at 0, so a second launch (a graph replay) merges again
        out = balanced_decode_attention(q, k_buf, v_buf, indptr, indices, d ** -0.5, pieces, counters,
                                        launch=DecodeLaunch(16, 4, 2))
        assert counters.eq(0).all()
        torch.testing.assert_close(out.float().cpu(), want, atol=tol, rtol=tol)


def test_group_of_one_and_head_dim_128_into_a_float32_out():
    seq_lens, hq, hk, d = [200, 3, 17], 4, 4, 128
    q, k_buf, v_buf, indptr, indices = make_case(seq_lens, hq, hk, d, torch.bfloat16, torch.bfloat16, seed=5)
    pieces = DecodePieces.new(len(seq_lens), 4, q.device)
    plan_pieces(indptr, len(seq_lens), pieces, 16)
    counters = torch.zeros(len(seq_lens) * hk, dtype=torch.int32, device=q.device)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    balanced_decode_attention(q, k_buf, v_buf, indptr, indices, 0.1, pieces, counters, out=out,
                              launch=DecodeLaunch(16, 4, 2))
    want = reference(q, k_buf, v_buf, indptr, indices, 0.1, compute=torch.bfloat16)
    torch.testing.assert_close(out.cpu(), want, atol=1e-2, rtol=1e-2)


def test_rejects_bad_counters_and_small_tables():
    q, k_buf, v_buf, indptr, indices = make_case([4, 9], 8, 4, 64, torch.bfloat16, torch.bfloat16, seed=1)
    pieces = DecodePieces.new(2, 4, q.device)
    for bad in (torch.zeros(7, dtype=torch.int32), torch.zeros(8, dtype=torch.int64)):
        with pytest.raises(ValueError, match="counters"):
            balanced_decode_attention(q, k_buf, v_buf, indptr, indices, 0.1, pieces, bad.to(q.device))
    with pytest.raises(ValueError, match="too small"):
        plan_pieces(indptr, 2, DecodePieces.new(1, 4, q.device))


def test_a_step_is_cut_into_pieces_when_its_longest_request_holds_ratio_times_the_mean():
    assert wants_pieces([900] * 255 + [16384], 4.0) and not wants_pieces([1500] * 256, 4.0)
    assert not wants_pieces([100, 2048, 700, 1500], 4.0)  # mixed lengths, no straggler
    assert wants_pieces([1500] * 8, 0.0) and not wants_pieces([1] * 7 + [10**6], float("inf"))
    assert not wants_pieces([], 0.0)


def test_balanced_programs_counts_programs_per_sm_over_the_kv_heads():
    assert balanced_programs(8, 132) == 132 and balanced_programs(8, 132, kv_itemsize=1) == 264
    assert balanced_programs(64, 4) == 1
