"""rollout.kernels.balanced_decode against attention written out in float32 torch over the widened KV, with the
batch's tokens cut so that requests fall wholly inside one range, across two, and across many."""

from __future__ import annotations

from triton_interpreter import DEVICE  # first: sets up the interpreter before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from rollout.kernels.balanced_decode import balanced_decode_attention, balanced_programs  # noqa: E402
from rollout.kernels.decode_attention import DecodeLaunch  # noqa: E402
from test_triton_decode import make_case, reference  # noqa: E402

SEQ_LENS = [1, 5, 64, 65, 130, 300, 2]


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("programs,min_chunk", [(1, 1), (3, 16), (7, 16), (40, 1), (5, 1000)])
def test_matches_float32_attention_and_leaves_counters_zero(kv_dtype, programs, min_chunk):
    hq, hk, d = 8, 2, 64
    q_dtype = torch.float16 if kv_dtype.itemsize == 1 else torch.bfloat16
    q, k_buf, v_buf, indptr, indices = make_case(SEQ_LENS, hq, hk, d, kv_dtype, q_dtype, seed=3)
    counters = torch.zeros(len(SEQ_LENS) * hk, dtype=torch.int32, device=q.device)
    want = reference(q, k_buf, v_buf, indptr, indices, d ** -0.5, compute=q_dtype)
    tol = 1e-2 if q_dtype == torch.bfloat16 else 3e-3
    for _ in range(2):  # the counts are back at 0, so a second launch (a graph replay) merges again
        out = balanced_decode_attention(q, k_buf, v_buf, indptr, indices, d ** -0.5, programs, counters,
                                        launch=DecodeLaunch(16, 4, 2), min_chunk=min_chunk)
        assert counters.eq(0).all()
        torch.testing.assert_close(out.float().cpu(), want, atol=tol, rtol=tol)


def test_group_of_one_and_head_dim_128_into_a_float32_out():
    seq_lens, hq, hk, d = [200, 3, 17], 4, 4, 128
    q, k_buf, v_buf, indptr, indices = make_case(seq_lens, hq, hk, d, torch.bfloat16, torch.bfloat16, seed=5)
    counters = torch.zeros(len(seq_lens) * hk, dtype=torch.int32, device=q.device)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    balanced_decode_attention(q, k_buf, v_buf, indptr, indices, 0.1, 4, counters, out=out,
                              launch=DecodeLaunch(16, 4, 2), min_chunk=16)
    want = reference(q, k_buf, v_buf, indptr, indices, 0.1, compute=torch.bfloat16)
    torch.testing.assert_close(out.cpu(), want, atol=1e-2, rtol=1e-2)


def test_rejects_bad_counters_and_programs():
    q, k_buf, v_buf, indptr, indices = make_case([4, 9], 8, 4, 64, torch.bfloat16, torch.bfloat16, seed=1)
    for bad in (torch.zeros(7, dtype=torch.int32), torch.zeros(8, dtype=torch.int64)):
        with pytest.raises(ValueError, match="counters"):
            balanced_decode_attention(q, k_buf, v_buf, indptr, indices, 0.1, 4, bad.to(q.device))
    with pytest.raises(ValueError, match="positive"):
        balanced_decode_attention(q, k_buf, v_buf, indptr, indices, 0.1, 0,
                                  torch.zeros(8, dtype=torch.int32, device=q.device))


def test_balanced_programs_spreads_programs_per_sm_over_the_kv_heads():
    assert balanced_programs(8, 132) == 66
    assert balanced_programs(8, 132, programs_per_sm=1) == 16
    assert balanced_programs(64, 4) == 1
