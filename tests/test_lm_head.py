"""``ParallelLMHead.logits`` into a caller's buffer (what every decode CUDA graph shares) equals the plain
logits, on one rank and across two (gloo), against ``F.linear`` with the whole vocabulary."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from rollout.distributed import TPGroup
from rollout.layers.embedding import ParallelLMHead

VOCAB, HIDDEN, TOKENS = 1001, 24, 5  # an odd vocabulary: two ranks pad it to 1,002


def _full_weight_and_hidden() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(VOCAB, HIDDEN, generator=gen), torch.randn(TOKENS, HIDDEN, generator=gen)


def _head(tp: TPGroup, weight: torch.Tensor) -> ParallelLMHead:
    head = ParallelLMHead(VOCAB, HIDDEN, tp, torch.float32)
    head.weight.data[: head.valid_local] = weight[head.start: head.start + head.valid_local]
    return head


def test_logits_into_a_buffer_equal_the_plain_logits_on_one_rank():
    weight, hidden = _full_weight_and_hidden()
    head = _head(TPGroup(), weight)
    out = torch.full((TOKENS + 3, head.padded_vocab_size), float("nan"))
    got = head.logits(hidden, out[:TOKENS])
    assert got.shape == (TOKENS, VOCAB) and got.data_ptr() == out.data_ptr()
    assert torch.equal(got, head.logits(hidden))
    torch.testing.assert_close(got, F.linear(hidden, weight))
    assert out[TOKENS:].isnan().all()  # rows past the batch are untouched


def _two_ranks(rank: int, store: str, results: dict) -> None:
    torch.set_num_threads(1)
    tp = TPGroup.init(rank, 2, "gloo", store, torch.device("cpu"))
    try:
        weight, hidden = _full_weight_and_hidden()
        head = _head(tp, weight)
        out = torch.empty(TOKENS, head.padded_vocab_size)
        got = head.logits(hidden, out)
        results[rank] = (head.padded_vocab_size, got.data_ptr() == out.data_ptr(),
                         torch.equal(got, head.logits(hidden)),
                         (got - F.linear(hidden, weight)).abs().max().item())
    finally:
        torch.distributed.destroy_process_group()


def test_logits_into_a_buffer_across_two_ranks(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_two_ranks, args=(str(tmp_path / "store"), results), nprocs=2, join=True)
        results = dict(results)
    for rank in (0, 1):
        padded, in_buffer, equal_plain, err = results[rank]
        assert padded == 1002 and in_buffer and equal_plain
        assert err < 1e-5
