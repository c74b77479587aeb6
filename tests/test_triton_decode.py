"""rollout.kernels.decode_attention against attention written out in float32 torch over the widened KV.

Without a CUDA device the kernels run under Triton's CPU interpreter (see ``triton_interpreter``, which
makes its float8 and bfloat16 conversions and dots match the GPU's).
"""

from __future__ import annotations

from triton_interpreter import DEVICE  # first: sets up the interpreter before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from rollout.kernels.decode_attention import DecodeLaunch, decode_attention, num_kv_splits  # noqa: E402


def make_case(seq_lens: list[int], hq: int, hk: int, d: int, kv_dtype: torch.dtype, q_dtype: torch.dtype,
              seed: int):
    gen = torch.Generator().manual_seed(seed)
    slots = sum(seq_lens) + 7
    k_buf = (torch.randn(slots, hk, d, generator=gen) * 2).to(kv_dtype).to(DEVICE)
    v_buf = torch.randn(slots, hk, d, generator=gen).to(kv_dtype).to(DEVICE)
    perm = (torch.randperm(slots - 1, generator=gen)[:sum(seq_lens)] + 1).to(torch.int32)
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(seq_lens).cumsum(0)
    q = torch.randn(len(seq_lens), hq, d, generator=gen).to(q_dtype).to(DEVICE)
    return q, k_buf, v_buf, indptr.to(DEVICE), perm.to(DEVICE)


def reference(q, k_buf, v_buf, indptr, indices, scale, compute=torch.float16):
    """float32 softmax attention, q rounded to the compute type and K/V widened to it, as the kernel."""
    out = torch.empty(q.shape, dtype=torch.float32)
    group = q.shape[1] // k_buf.shape[1]
    for b in range(q.shape[0]):
        idx = indices[indptr[b]:indptr[b + 1]].long().cpu()
        k = k_buf.cpu()[idx].to(compute).float().repeat_interleave(group, 1)  # [n, hq, d]
        v = v_buf.cpu()[idx].to(compute).float().repeat_interleave(group, 1)
        qb = q[b].cpu().to(compute).float()
        p = torch.softmax(scale * torch.einsum("hd,nhd->hn", qb, k), -1)
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out


CASES = [  # seq lens, heads q/kv, head dim
    ([1, 5, 64, 65, 130], 8, 2, 64),
    ([200, 3, 17], 4, 4, 128),
    ([33, 1], 12, 3, 64),
]


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("launch", [DecodeLaunch(16, 4, 2), None], ids=["16x4x2", "default"])
def test_matches_float32_attention_over_widened_kv(kv_dtype, splits, case, launch):
    seq_lens, hq, hk, d = CASES[case]
    q_dtype = torch.float16 if kv_dtype.itemsize == 1 else torch.bfloat16
    q, k_buf, v_buf, indptr, indices = make_case(seq_lens, hq, hk, d, kv_dtype, q_dtype, seed=case)
    scale = d ** -0.5
    out = decode_attention(q, k_buf, v_buf, indptr, indices, scale, splits, launch=launch)
    assert out.dtype == q_dtype and out.shape == q.shape
    want = reference(q, k_buf, v_buf, indptr, indices, scale, compute=q_dtype)
    # p is rounded to the 16-bit compute type before P.V (as FlashInfer does), plus output rounding
    tol = 1e-2 if q_dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(out.float().cpu(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("splits", [1, 4])
def test_bf16_query_over_float8_pool_computes_in_float16_into_a_bf16_out(splits):
    """The engine's call: a bf16 query (model dtype) over a float8 pool is rounded to float16 in the
    kernel, and the result lands in the caller's bf16 ``out`` (no conversion kernels around it)."""
    q, k_buf, v_buf, indptr, indices = make_case([5, 70, 33], 8, 2, 64, torch.float8_e4m3fn, torch.bfloat16, seed=4)
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=DEVICE)
    decode_attention(q, k_buf, v_buf, indptr, indices, 0.125, splits, out=out)
    want = reference(q, k_buf, v_buf, indptr, indices, 0.125, compute=torch.float16)
    torch.testing.assert_close(out.float().cpu(), want, atol=1e-2, rtol=1e-2)


def test_bf16_query_with_float32_output_dtype_and_more_splits_than_tokens():
    """A float32 query computes in float16; splits with no tokens (seq 1 and 2 over 8 splits) weigh
    nothing; ``out`` is written in place."""
    q, k_buf, v_buf, indptr, indices = make_case([1, 2, 9], 4, 2, 64, torch.float8_e4m3fn, torch.float32, seed=9)
    out = torch.full(q.shape, 7.0, dtype=q.dtype, device=DEVICE)
    returned = decode_attention(q, k_buf, v_buf, indptr, indices, 0.125, 8, out=out,
                                launch=DecodeLaunch(16, 4, 2))
    assert returned is out
    torch.testing.assert_close(out.cpu(), reference(q, k_buf, v_buf, indptr, indices, 0.125),
                               atol=3e-3, rtol=3e-3)


def test_num_kv_splits_fills_the_device_and_stays_a_power_of_two():
    assert num_kv_splits(256, 8, 132) == 1 and num_kv_splits(128, 8, 132) == 2 and num_kv_splits(64, 8, 132) == 2
    assert num_kv_splits(32, 8, 132) == 4 and num_kv_splits(1, 8, 132) == 16 and num_kv_splits(16, 8, 132) == 8
    # float8 pools: twice the programs per SM (2 splits at 256 requests on 132 SMs)
    assert num_kv_splits(256, 8, 132, 1) == 2 and num_kv_splits(128, 8, 132, 1) == 2
    assert num_kv_splits(64, 8, 132, 1) == 4 and num_kv_splits(1, 8, 132, 1) == 16
    assert num_kv_splits(300, 8, 132, 1) == 1 and num_kv_splits(1000, 8, 132) == 1
    assert all(s & (s - 1) == 0 for s in (num_kv_splits(b, 3, 78, i) for b in range(1, 300) for i in (1, 2)))


def test_rejects_bad_shapes_and_splits():
    q, k_buf, v_buf, indptr, indices = make_case([4], 6, 4, 64, torch.bfloat16, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="shapes"):
        decode_attention(q, k_buf, v_buf, indptr, indices, 0.1, 1)
    q, k_buf, v_buf, indptr, indices = make_case([4], 8, 4, 64, torch.bfloat16, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(q, k_buf, v_buf, indptr, indices, 0.1, 3)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("splits", [2, 4, 16])
@pytest.mark.parametrize("heads_first", [False, True], ids=["batch-first", "heads-first"])
def test_in_kernel_merge_leaves_the_callers_counters_zero(kv_dtype, splits, heads_first):
    """The caller's counters (the engine's, reused by every graph replay) are 0 again after each launch, in
    either launch order, and the result is the one without them (a zeroed buffer made for the call). Tiles of
    64: one token (every split after the first empty), a tile and one token (a second split of one token),
    three tiles, the last partial (two tiles in the first split at 2); 4 and 16 splits leave empty ones on
    every request. 2 KV heads: each launch order indexes its counters by request and KV head."""
    seq_lens, hq, hk, d = [1, 65, 130], 8, 2, 64
    q_dtype = torch.float16 if kv_dtype.itemsize == 1 else torch.bfloat16
    q, k_buf, v_buf, indptr, indices = make_case(seq_lens, hq, hk, d, kv_dtype, q_dtype, seed=7)
    scale = d ** -0.5
    counters = torch.zeros(len(seq_lens) * hk + 3, dtype=torch.int32, device=q.device)
    launch = DecodeLaunch(64, 2, 4, heads_first)  # either launch order counts each (request, KV head) pair
    own = decode_attention(q, k_buf, v_buf, indptr, indices, scale, splits, launch=launch)
    for _ in range(2):  # the counts are back at 0, so a second launch (a graph replay) merges again
        fused = decode_attention(q, k_buf, v_buf, indptr, indices, scale, splits, counters=counters, launch=launch)
        assert counters.eq(0).all()
        torch.testing.assert_close(fused, own, atol=0, rtol=0)
    want = reference(q, k_buf, v_buf, indptr, indices, scale, compute=q_dtype)
    tol = 1e-2 if q_dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(fused.float().cpu(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("heads_first", [False, True], ids=["batch-first", "heads-first"])
def test_launch_order_changes_no_result(splits, heads_first):
    """Programs launched in another order (``order``: the index kernel's longest first, or any permutation)
    compute the same bits: each request's rows still go to its own output."""
    seq_lens, hq, hk, d = [1, 5, 64, 65, 130], 8, 2, 64
    q, k_buf, v_buf, indptr, indices = make_case(seq_lens, hq, hk, d, torch.bfloat16, torch.bfloat16, seed=8)
    launch = DecodeLaunch(16, 4, 2, heads_first)
    counters = torch.zeros(len(seq_lens) * hk, dtype=torch.int32, device=q.device)
    plain = decode_attention(q, k_buf, v_buf, indptr, indices, 0.125, splits, launch=launch, counters=counters)
    for perm in ([4, 3, 2, 1, 0], [2, 0, 4, 1, 3]):
        order = torch.tensor(perm + [-1], dtype=torch.int32, device=q.device)  # entries past B unused
        out = decode_attention(q, k_buf, v_buf, indptr, indices, 0.125, splits, launch=launch, counters=counters,
                               order=order)
        torch.testing.assert_close(out, plain, atol=0, rtol=0)
    with pytest.raises(ValueError, match="order"):
        decode_attention(q, k_buf, v_buf, indptr, indices, 0.125, splits, order=order[:3])


def test_fused_merge_rejects_short_or_wrong_counters():
    q, k_buf, v_buf, indptr, indices = make_case([4, 9], 8, 4, 64, torch.bfloat16, torch.bfloat16, seed=1)
    for bad in (torch.zeros(7, dtype=torch.int32), torch.zeros(8, dtype=torch.int64)):
        with pytest.raises(ValueError, match="counters"):
            decode_attention(q, k_buf, v_buf, indptr, indices, 0.1, 2, counters=bad.to(q.device))


def shared_prefix_case(kv_dtype, hq: int, hk: int, d: int, seed: int):
    """Six requests over one pool: rows 0, 1, 3 share their first 70 slots, rows 4 and 2 their first 40 (row 4
    listed first), row 5 shares nothing. Returns the case and its ``SharedPrefixArgs`` pieces: the group
    table (with an unused group and -1 padding) and each row's covered prefix."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [75, 130, 41, 71, 90, 17]
    prefixes = {0: (70, [0, 1, 3]), 1: (40, [4, 2])}
    slots = sum(seq_lens) + 9
    k_buf = (torch.randn(slots, hk, d, generator=gen) * 2).to(kv_dtype)
    v_buf = torch.randn(slots, hk, d, generator=gen).to(kv_dtype)
    perm = (torch.randperm(slots - 1, generator=gen) + 1).to(torch.int32)
    lists = [perm[sum(seq_lens[:i]):sum(seq_lens[:i + 1])].clone() for i in range(len(seq_lens))]
    for plen, members in prefixes.values():
        for m in members[1:]:
            lists[m][:plen] = lists[members[0]][:plen]
    indices = torch.cat(lists)
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(seq_lens).cumsum(0)
    q = torch.randn(len(seq_lens), hq, d, generator=gen).to(torch.bfloat16)
    members = 4
    groups = torch.full((3, 1 + members), -1, dtype=torch.int32)
    groups[2, 0] = 0  # unused
    req_prefix = torch.zeros(len(seq_lens), dtype=torch.int32)
    for g, (plen, rows) in prefixes.items():
        groups[g, 0] = plen
        groups[g, 1:1 + len(rows)] = torch.tensor(rows, dtype=torch.int32)
        req_prefix[rows] = plen
    dev = [t.to(DEVICE) for t in (q, k_buf, v_buf, indptr, indices, groups, req_prefix)]
    return dev


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("splits,prefix_splits", [(1, 1), (1, 2), (4, 2)])
@pytest.mark.parametrize("heads", [(8, 2), (2, 2)], ids=["group4", "group1"])
def test_shared_prefix_equals_attention_over_each_whole_kv(kv_dtype, splits, prefix_splits, heads):
    """Cascade decode (stage 0 reads each group's prefix once for all its members) gives the attention of each
    request over its whole KV list: grouped rows, a row in no group, an unused group and member padding."""
    from rollout.kernels.decode_attention import SharedPrefixArgs

    hq, hk = heads
    q, k_buf, v_buf, indptr, indices, groups, req_prefix = shared_prefix_case(kv_dtype, hq, hk, 64, seed=3)
    counters = torch.zeros(q.shape[0] * hk, dtype=torch.int32, device=q.device)
    args = SharedPrefixArgs(groups, req_prefix, prefix_splits)
    for _ in range(2):  # a second launch (a graph replay) finds the counts back at 0
        out = decode_attention(q, k_buf, v_buf, indptr, indices, 0.125, splits, counters=counters,
                               shared_prefix=args, launch=DecodeLaunch(16, 4, 2))
        assert counters.eq(0).all()
    want = reference(q, k_buf, v_buf, indptr, indices, 0.125,
                     compute=torch.float16 if kv_dtype.itemsize == 1 else torch.bfloat16)
    torch.testing.assert_close(out.float().cpu(), want, atol=1e-2, rtol=1e-2)
    plain = decode_attention(q, k_buf, v_buf, indptr, indices, 0.125, splits, counters=counters,
                             launch=DecodeLaunch(16, 4, 2))
    torch.testing.assert_close(out.float(), plain.float(), atol=4e-3, rtol=4e-3)


def test_shared_prefix_needs_counters_and_int32_tables():
    from rollout.kernels.decode_attention import SharedPrefixArgs

    q, k_buf, v_buf, indptr, indices, groups, req_prefix = shared_prefix_case(torch.bfloat16, 8, 2, 64, seed=1)
    counters = torch.zeros(q.shape[0] * 2, dtype=torch.int32, device=q.device)
    with pytest.raises(ValueError, match="pass counters"):
        decode_attention(q, k_buf, v_buf, indptr, indices, 0.1, 1,
                         shared_prefix=SharedPrefixArgs(groups, req_prefix, 1))
    for bad in (SharedPrefixArgs(groups.long(), req_prefix, 1), SharedPrefixArgs(groups, req_prefix[:3], 1),
                SharedPrefixArgs(groups, req_prefix, 3)):
        with pytest.raises(ValueError, match="shared_prefix"):
            decode_attention(q, k_buf, v_buf, indptr, indices, 0.1, 1, counters=counters, shared_prefix=bad)
