"""rollout.kernels.decode_indices against torch references: ``kv_indices_for`` for ``write_kv_indices``,
and ``prepare_reference`` (below, from ``prepare_decode``'s contract) for ``prepare_decode``.

Without a CUDA device the kernel runs under Triton's CPU interpreter (see ``triton_interpreter``).
"""

from __future__ import annotations

from triton_interpreter import DEVICE  # first: sets up the interpreter before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from rollout.attention.common import kv_indices_for  # noqa: E402
from rollout.kernels.decode_indices import (  # noqa: E402
    CHUNK, SCAN, DecodeBuffers, chunk_programs, prepare_decode, write_kv_indices)
from rollout.model_executor.forward_batch import ForwardMode  # noqa: E402
from rollout.model_executor.model_runner import StepInput  # noqa: E402

SENTINEL = -7


def random_table(num_rows: int, max_ctx: int, seed: int, wider_by: int = 0) -> torch.Tensor:
    """int32 [num_rows, max_ctx] of distinct random slots; with ``wider_by`` a column slice of a wider
    table (row stride max_ctx + 2 * wider_by, not contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    cols = max_ctx + 2 * wider_by
    full = torch.randperm(num_rows * cols, generator=gen).to(torch.int32).view(num_rows, cols)
    return full.to(DEVICE)[:, wider_by:wider_by + max_ctx]  # sliced on the device (.to would compact it)


def launch_order_reference(seq_lens: list[int]) -> list[int]:
    """The rows by seq len, longest first, ties by row (the module docstring of ``decode_indices``)."""
    return sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i))


def check_order(order: torch.Tensor, seq_lens: list[int], spare: int) -> None:
    """``order`` (with ``spare`` sentinel entries past the batch) == ``launch_order_reference``."""
    b = len(seq_lens)
    assert order[:b].cpu().tolist() == launch_order_reference(seq_lens)
    assert order[b:].cpu().tolist() == [SENTINEL] * spare


def run_both(table: torch.Tensor, rows: list[int], seq_lens: list[int], spare: int = 0):
    """The kernel's indptr and indices buffer (``spare`` entries past the total) and the reference's
    indptr and indices, all on the host; the launch order written alongside is checked here."""
    rows_t = torch.tensor(rows, dtype=torch.int64, device=DEVICE)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    total = sum(seq_lens)
    indptr = torch.full((len(rows) + 1,), SENTINEL, dtype=torch.int32, device=DEVICE)
    buf = torch.full((total + spare,), SENTINEL, dtype=torch.int32, device=DEVICE)
    order = torch.full((len(rows) + 2,), SENTINEL, dtype=torch.int32, device=DEVICE)
    view = write_kv_indices(table, rows_t, lens_t, indptr, buf, total, order=order)
    assert view.shape == (total,) and view.data_ptr() == buf.data_ptr()  # a view of the given buffer
    check_order(order, seq_lens, 2)
    ref_indptr = torch.tensor([0] + seq_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    ref = kv_indices_for(table, rows_t, lens_t, total)
    return indptr.cpu(), buf.cpu(), ref_indptr, ref.cpu()


def check(table: torch.Tensor, rows: list[int], seq_lens: list[int], spare: int = 0) -> None:
    """Kernel == reference, and the buffer past the total untouched."""
    indptr, buf, ref_indptr, ref = run_both(table, rows, seq_lens, spare)
    total = sum(seq_lens)
    assert torch.equal(indptr, ref_indptr)
    assert torch.equal(buf[:total], ref)
    assert (buf[total:] == SENTINEL).all()


def test_reference_is_the_row_concatenation():
    table = random_table(4, 10, seed=0)
    rows, lens = [2, 0, 2], [3, 1, 10]
    ref = kv_indices_for(table, torch.tensor(rows, device=DEVICE),
                         torch.tensor(lens, dtype=torch.int32, device=DEVICE), sum(lens)).cpu()
    expected = torch.cat([table[r, :n].cpu() for r, n in zip(rows, lens)])
    assert torch.equal(ref, expected)


@pytest.mark.parametrize("rows,seq_lens", [
    ([0], [1]),
    ([3], [CHUNK]),
    ([5], [3 * CHUNK + 17]),
    ([1, 0, 2], [1, 1, 1]),
    ([7, 2, 9, 4], [CHUNK - 1, CHUNK + 1, 2 * CHUNK, 1]),
    ([4, 4, 0, 4], [5, 300, 1, 2 * CHUNK + 3]),  # repeated rows
], ids=["single-token", "one-chunk", "three-chunks", "all-ones", "chunk-edges", "repeated-rows"])
def test_matches_reference(rows, seq_lens):
    check(random_table(10, 4 * CHUNK, seed=1), rows, seq_lens)


def test_many_requests_random_order_and_lengths():
    gen = torch.Generator().manual_seed(2)
    b = 37  # not a multiple of the scan step: its tail is masked
    rows = torch.randint(0, 50, (b,), generator=gen).tolist()
    seq_lens = torch.randint(1, 2 * CHUNK + 50, (b,), generator=gen).tolist()
    check(random_table(50, 3 * CHUNK, seed=3), rows, seq_lens)


def test_long_request_loops_past_its_chunk_programs():
    """One request far longer than the batch average: each of its C >= 2 programs copies several chunks."""
    seq_lens = [1, 6 * CHUNK + 9, 2, 3]
    programs = chunk_programs(len(seq_lens), sum(seq_lens))
    assert 2 <= programs < -(-max(seq_lens) // CHUNK)
    check(random_table(8, 7 * CHUNK, seed=4), [7, 0, 3, 7], seq_lens)


def test_strided_table_slice():
    table = random_table(6, 2 * CHUNK, seed=5, wider_by=13)
    assert not table.is_contiguous()
    check(table, [5, 1, 3], [CHUNK + 7, 2 * CHUNK, 40])


def test_buffer_far_larger_than_total_is_untouched_past_it():
    check(random_table(6, 512, seed=6), [2, 5], [100, 37], spare=5 * CHUNK)


def test_indptr_tail_past_batch_is_untouched_with_int32_rows():
    table = random_table(4, 64, seed=7)
    indptr = torch.full((6,), SENTINEL, dtype=torch.int32, device=DEVICE)
    buf = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    write_kv_indices(table, torch.tensor([1, 3], dtype=torch.int32, device=DEVICE), torch.tensor([4, 9], dtype=torch.int32,
                     device=DEVICE), indptr, buf, 13)
    assert indptr.cpu().tolist() == [0, 4, 13, SENTINEL, SENTINEL, SENTINEL]
    assert torch.equal(buf[:13].cpu(), torch.cat([table[1, :4], table[3, :9]]).cpu())


def test_launch_order_puts_longer_requests_first_and_ties_by_row():
    assert launch_order_reference([3, 9, 3, 12, 1]) == [3, 1, 0, 2, 4]
    check(random_table(6, 16, seed=9), [0, 1, 2, 3, 4], [3, 9, 3, 12, 1])


def test_rejects_a_short_or_wrong_launch_order_buffer():
    table = random_table(2, 8, seed=8)
    args = (table, torch.tensor([0, 1], device=DEVICE), torch.tensor([4, 4], dtype=torch.int32, device=DEVICE),
            torch.zeros(3, dtype=torch.int32, device=DEVICE), torch.zeros(8, dtype=torch.int32, device=DEVICE), 8)
    for bad in (torch.zeros(1, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)):
        with pytest.raises(ValueError, match="order"):
            write_kv_indices(*args, order=bad.to(DEVICE))


def test_rejects_a_buffer_too_small():
    table = random_table(2, 8, seed=8)
    with pytest.raises(ValueError):
        write_kv_indices(table, torch.tensor([0, 1], device=DEVICE), torch.tensor([8, 8], dtype=torch.int32,
                         device=DEVICE), torch.zeros(3, dtype=torch.int32, device=DEVICE),
                         torch.zeros(15, dtype=torch.int32, device=DEVICE), 16)


# ---- prepare_decode ------------------------------------------------------------------------------

NEW_SLOT_BASE = 1 << 20  # out slots of the tests: disjoint from every random table entry


def decode_step(rows: list[int], seq_lens: list[int]) -> StepInput:
    """A decode step of requests in ``rows`` whose new token sits at position seq_len - 1, with fresh slots."""
    slots = torch.tensor([NEW_SLOT_BASE + 3 * k for k in range(len(rows))], dtype=torch.int64)
    return StepInput(ForwardMode.DECODE, rows, None, [n - 1 for n in seq_lens], slots, seq_lens, [1] * len(rows))


def sentinel_buffers(size: int) -> DecodeBuffers:
    def full(dtype: torch.dtype) -> torch.Tensor:
        return torch.full((size,), SENTINEL, dtype=dtype, device=DEVICE)

    return DecodeBuffers(full(torch.int64), full(torch.int64), full(torch.int64), full(torch.int64), full(torch.int32))


def prepare_reference(table: torch.Tensor, last_token_ids: torch.Tensor, step: StepInput, padded: int):
    """``prepare_decode``'s contract in torch (host tensors): the written table, the five buffers' first
    ``padded`` entries (as a tuple, ``DecodeBuffers`` order), indptr and indices."""
    table = table.cpu().clone()
    rows = torch.tensor(step.rows, dtype=torch.int64)
    positions = torch.tensor(step.positions, dtype=torch.int64)
    table[rows, positions] = step.out_slots.to(torch.int32)
    pad = padded - len(step.rows)
    zeros = torch.zeros(pad, dtype=torch.int64)
    all_rows = torch.cat([rows, zeros])
    lens = torch.tensor(step.seq_lens + [1] * pad, dtype=torch.int32)
    buffers = (torch.cat([last_token_ids.cpu()[rows], zeros]), torch.cat([positions, zeros]),
               torch.cat([step.out_slots, zeros]), all_rows, lens)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), lens.to(torch.int64).cumsum(0)]).to(torch.int32)
    indices = kv_indices_for(table, all_rows, lens, int(lens.sum()))
    return table, buffers, indptr, indices


def check_prepare(table: torch.Tensor, step: StepInput, padded: int, spare: int = 3) -> None:
    """Kernel == reference on ``table`` (written in place), with ``spare`` sentinel entries past every
    output's end left untouched; the new slots land in the table and in the indices."""
    last = torch.arange(1000, 1000 + table.shape[0], dtype=torch.int64, device=DEVICE)
    ref_table, ref_bufs, ref_indptr, ref_indices = prepare_reference(table, last, step, padded)
    total = sum(step.seq_lens) + padded - len(step.rows)
    bufs = sentinel_buffers(padded + spare)
    indptr = torch.full((padded + 1 + spare,), SENTINEL, dtype=torch.int32, device=DEVICE)
    indices = torch.full((total + spare,), SENTINEL, dtype=torch.int32, device=DEVICE)
    packed = step.decode_pack().to(DEVICE)
    order = torch.full((padded + spare,), SENTINEL, dtype=torch.int32, device=DEVICE)
    view = prepare_decode(packed, last, table, bufs, indptr, indices, padded, total, order=order)
    assert view.shape == (total,) and view.data_ptr() == indices.data_ptr()
    check_order(order, step.seq_lens + [1] * (padded - len(step.rows)), spare)  # padding rows: 1 token
    assert torch.equal(table.cpu(), ref_table)
    for got, want in zip(bufs.tensors(), ref_bufs):
        assert got.dtype == want.dtype
        assert torch.equal(got[:padded].cpu(), want)
        assert (got[padded:].cpu() == SENTINEL).all()
    assert torch.equal(indptr[:padded + 1].cpu(), ref_indptr)
    assert (indptr[padded + 1:].cpu() == SENTINEL).all()
    assert torch.equal(indices[:total].cpu(), ref_indices)
    assert (indices[total:].cpu() == SENTINEL).all()
    for i, (pos, slot) in enumerate(zip(step.positions, step.out_slots.tolist())):
        assert table[step.rows[i], pos].item() == slot
        assert indices[ref_indptr[i] + pos].item() == slot


def test_decode_pack_layout():
    step = decode_step([4, 1], [7, 3])
    packed = step.decode_pack()
    assert packed.dtype == torch.int64 and packed.is_contiguous()
    assert packed.tolist() == [[4, 1], [6, 2], step.out_slots.tolist(), [7, 3]]


@pytest.mark.parametrize("rows,seq_lens,padded", [
    ([3], [2], 1),
    ([3], [5], 2),
    ([2, 7, 0], [4, 9, 2], 8),
    ([5, 1, 6, 2], [30, 2, 17, 8], 4),
    ([1, 2, 3, 4, 5], [40] * 5, 8),
    ([9, 8, 7], [40] * 3, 3),
], ids=["batch-1", "batch-1-padded", "padded", "unpadded", "repeated-lengths-padded", "repeated-lengths"])
def test_prepare_matches_reference(rows, seq_lens, padded):
    check_prepare(random_table(10, 64, seed=11), decode_step(rows, seq_lens), padded)


def test_prepare_lengths_across_chunk_boundaries():
    """New tokens at the last position of a chunk, the first of the next, and inside later chunks."""
    seq_lens = [CHUNK, CHUNK + 1, 2 * CHUNK + 3, CHUNK - 1, 3 * CHUNK]
    check_prepare(random_table(12, 3 * CHUNK + 8, seed=12), decode_step([11, 0, 5, 7, 2], seq_lens), 8)


def test_prepare_long_request_loops_past_its_chunk_programs():
    seq_lens = [2, 6 * CHUNK + 9, 3]
    padded = 4
    programs = chunk_programs(padded, sum(seq_lens) + 1)
    assert 2 <= programs < -(-max(seq_lens) // CHUNK)
    check_prepare(random_table(6, 7 * CHUNK, seed=13), decode_step([4, 1, 5], seq_lens), padded)


def test_prepare_many_requests_and_strided_table():
    gen = torch.Generator().manual_seed(14)
    b, padded = 37, 48
    rows = torch.randperm(60, generator=gen)[:b].tolist()
    seq_lens = torch.randint(2, CHUNK + 300, (b,), generator=gen).tolist()
    table = random_table(60, 2 * CHUNK, seed=15, wider_by=5)
    assert not table.is_contiguous()
    check_prepare(table, decode_step(rows, seq_lens), padded)


def test_prepare_only_touches_the_new_table_entries():
    table = random_table(8, 32, seed=16)
    before = table.cpu().clone()
    step = decode_step([6, 3], [10, 20])
    check_prepare(table, step, 4)
    changed = (table.cpu() != before).nonzero().tolist()
    assert changed == [[3, 19], [6, 9]]


def test_prepare_rejects_short_buffers():
    table = random_table(4, 16, seed=17)
    step = decode_step([1, 2], [3, 4])
    packed, last = step.decode_pack().to(DEVICE), torch.zeros(4, dtype=torch.int64, device=DEVICE)
    indptr = torch.zeros(5, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError):  # padded below the batch
        prepare_decode(packed, last, table, sentinel_buffers(4), indptr, torch.zeros(16, dtype=torch.int32,
                       device=DEVICE), 1, 7)
    with pytest.raises(ValueError):  # static buffers shorter than the padded size
        prepare_decode(packed, last, table, sentinel_buffers(3), indptr, torch.zeros(16, dtype=torch.int32,
                       device=DEVICE), 4, 9)
    with pytest.raises(ValueError):  # indices buffer below the total
        prepare_decode(packed, last, table, sentinel_buffers(4), indptr, torch.zeros(8, dtype=torch.int32,
                       device=DEVICE), 4, 9)


def test_batches_longer_than_one_scan_step():
    # more requests than SCAN, so a program sums the seq lens before it over several loop steps
    gen = torch.Generator().manual_seed(18)
    b = SCAN + 45
    rows = torch.randperm(b + 9, generator=gen)[:b].tolist()
    seq_lens = torch.randint(2, 40, (b,), generator=gen).tolist()
    table = random_table(b + 9, 64, seed=19)
    check(table, rows, seq_lens)
    check_prepare(table, decode_step(rows, seq_lens), b + 30)


def check_prepare_paged(table: torch.Tensor, step: StepInput, padded: int, page: int, spare: int = 2) -> None:
    """With a page table: the same table and buffer writes as without; ``page_table[i, j]`` = the slot of
    position j * page of padded row i, divided by page, for the row's pages only; ``indices`` untouched."""
    last = torch.arange(1000, 1000 + table.shape[0], dtype=torch.int64, device=DEVICE)
    ref_table, ref_bufs, ref_indptr, _ = prepare_reference(table, last, step, padded)
    total = sum(step.seq_lens) + padded - len(step.rows)
    width = -(-max(step.seq_lens) // page) + spare
    pages = torch.full((padded + spare, width), SENTINEL, dtype=torch.int32, device=DEVICE)
    bufs = sentinel_buffers(padded)
    indptr = torch.full((padded + 1,), SENTINEL, dtype=torch.int32, device=DEVICE)
    indices = torch.full((8,), SENTINEL, dtype=torch.int32, device=DEVICE)
    view = prepare_decode(step.decode_pack().to(DEVICE), last, table, bufs, indptr, indices, padded, total,
                          page_table=pages, page_size=page)
    assert view.shape == (padded, width) and view.data_ptr() == pages.data_ptr()
    assert torch.equal(table.cpu(), ref_table)
    for got, want in zip(bufs.tensors(), ref_bufs):
        assert torch.equal(got.cpu(), want)
    assert torch.equal(indptr.cpu(), ref_indptr)
    assert (indices.cpu() == SENTINEL).all()
    want = torch.full((padded + spare, width), SENTINEL, dtype=torch.int32)
    rows, lens = ref_bufs[3], ref_bufs[4]
    for i in range(padded):
        n = -(-int(lens[i]) // page)
        want[i, :n] = ref_table[rows[i], 0:n * page:page] // page
    assert torch.equal(pages.cpu(), want)


@pytest.mark.parametrize("page", [4, 16])
def test_prepare_writes_the_page_table(page):
    # new tokens on a page's first position (seq len k * page + 1), its last, and inside it
    seq_lens = [page + 1, 2 * page, 3 * page + 5, 1, 5 * page + 1]
    check_prepare_paged(random_table(12, 6 * page, seed=20), decode_step([3, 0, 7, 11, 5], seq_lens), 8, page)


def test_prepare_page_table_loops_past_its_chunk_programs():
    seq_lens = [2, 4 * CHUNK * 4 + 9, 3]
    check_prepare_paged(random_table(6, 4 * CHUNK * 4 + 16, seed=21), decode_step([4, 1, 5], seq_lens), 4, 4)
