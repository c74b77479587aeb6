"""rollout.attention.triton_indices against the torch reference ``kv_indices_for``.

Without a CUDA device the kernel runs under Triton's CPU interpreter (see ``triton_interpreter``).
"""

from __future__ import annotations

from triton_interpreter import DEVICE  # first: sets up the interpreter before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from rollout.attention.flashinfer_backend import kv_indices_for  # noqa: E402
from rollout.attention.triton_indices import CHUNK, chunk_programs, write_kv_indices  # noqa: E402

SENTINEL = -7


def random_table(num_rows: int, max_ctx: int, seed: int, wider_by: int = 0) -> torch.Tensor:
    """int32 [num_rows, max_ctx] of distinct random slots; with ``wider_by`` a column slice of a wider
    table (row stride max_ctx + 2 * wider_by, not contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    cols = max_ctx + 2 * wider_by
    full = torch.randperm(num_rows * cols, generator=gen).to(torch.int32).view(num_rows, cols)
    return full[:, wider_by:wider_by + max_ctx].to(DEVICE) if wider_by else full.to(DEVICE)


def run_both(table: torch.Tensor, rows: list[int], seq_lens: list[int], spare: int = 0):
    """The kernel's indptr and indices buffer (``spare`` entries past the total) and the reference's
    indptr and indices, all on the host."""
    rows_t = torch.tensor(rows, dtype=torch.int64, device=DEVICE)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    total = sum(seq_lens)
    indptr = torch.full((len(rows) + 1,), SENTINEL, dtype=torch.int32, device=DEVICE)
    buf = torch.full((total + spare,), SENTINEL, dtype=torch.int32, device=DEVICE)
    view = write_kv_indices(table, rows_t, lens_t, indptr, buf, total)
    assert view.shape == (total,) and view.data_ptr() == buf.data_ptr()  # a view of the given buffer
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
    b = 37  # not a power of two: BLOCK_B masks the tail
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


def test_rejects_a_buffer_too_small():
    table = random_table(2, 8, seed=8)
    with pytest.raises(ValueError):
        write_kv_indices(table, torch.tensor([0, 1], device=DEVICE), torch.tensor([8, 8], dtype=torch.int32,
                         device=DEVICE), torch.zeros(3, dtype=torch.int32, device=DEVICE),
                         torch.zeros(15, dtype=torch.int32, device=DEVICE), 16)
