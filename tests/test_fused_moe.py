"""rollout.kernels.fused_moe against a per-expert torch loop: the expert grouping (``moe_align_block_size``)
and the whole routed SwiGLU MLP, float32 and bfloat16, with experts that get no tokens and sizes that are
no multiple of the tiles.

Without a CUDA device the kernels run under Triton's CPU interpreter (``triton_interpreter``), with tiny
tiles to stay fast.
"""

from __future__ import annotations

from triton_interpreter import DEVICE  # first: sets up the interpreter before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import rollout.kernels.fused_moe as fused_moe_module  # noqa: E402
from rollout.kernels.fused_moe import MoeLaunch, fused_moe, max_padded_len, moe_align_block_size  # noqa: E402

TINY = MoeLaunch(block_m=16, block_n=16, block_k=16, group_m=1, num_warps=1, num_stages=1)


def route(t: int, top_k: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """[t, top_k] distinct experts per token, drawn from all but experts 0 and 3 (which get no tokens)."""
    used = torch.tensor([e for e in range(num_experts) if e not in (0, 3)])
    picks = torch.stack([torch.randperm(len(used), generator=gen)[:top_k] for _ in range(t)])
    return used[picks]


def reference_moe(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Per-expert loop in float32, rounding where the kernels round: GEMM1's output, SiLU·mul (in x's dtype),
    each weighted GEMM2 row, then the float32 sum over the K slots."""
    dt = x.dtype
    t, h = x.shape
    inter = w2.shape[2]
    flat_ids = topk_ids.reshape(-1)
    rows = x.float().repeat_interleave(topk_ids.shape[1], dim=0)
    down = torch.zeros(flat_ids.numel(), h)
    for e in flat_ids.unique().tolist():
        sel = flat_ids == e
        gate_up = (rows[sel] @ w13[e].float().T).to(dt)
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        down[sel] = ((act.float() @ w2[e].float().T) * topk_weights.reshape(-1)[sel, None].float()).to(dt).float()
    return down.view(t, -1, h).sum(dim=1).to(dt)


@pytest.mark.parametrize("block_m,num_experts,programs", [(1, 9, 128), (4, 200, 128), (16, 9, 128), (16, 200, 2),
                                                           (4, 200, 1)])
def test_align_groups_every_pair_by_expert_in_padded_blocks(block_m, num_experts, programs, monkeypatch):
    """200 experts: the pairs are counted and scattered in tiles of 32 rows, five programs of one tile, two of
    three or one of five."""
    monkeypatch.setattr(fused_moe_module, "ALIGN_MAX_PROGRAMS", programs)
    gen = torch.Generator().manual_seed(block_m)
    t, top_k = 33, 4
    topk_ids = route(t, top_k, num_experts, gen).to(torch.int32)
    sorted_ids, expert_ids, num_post = (v.cpu() for v in moe_align_block_size(topk_ids.to(DEVICE), num_experts,
                                                                                block_m))
    numel = t * top_k
    assert sorted_ids.dtype == expert_ids.dtype == num_post.dtype == torch.int32 and num_post.shape == (1,)
    assert sorted_ids.shape == (max_padded_len(numel, num_experts, block_m),)
    assert expert_ids.shape == (sorted_ids.numel() // block_m,)
    counts = torch.bincount(topk_ids.reshape(-1).long(), minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert num_post.item() == padded.sum().item()
    used = num_post.item()
    assert (sorted_ids[used:] == numel).all() and (expert_ids[used // block_m:] == -1).all()
    real = sorted_ids[sorted_ids != numel]
    assert torch.equal(real.sort().values, torch.arange(numel, dtype=torch.int32))  # each pair exactly once
    start = 0
    for e in range(num_experts):  # experts in order, each group starting on a block, indices increasing
        group = sorted_ids[start:start + padded[e]]
        want = torch.nonzero(topk_ids.reshape(-1) == e).flatten().to(torch.int32)
        assert torch.equal(group[:counts[e]], want) and (group[counts[e]:] == numel).all()
        assert (expert_ids[start // block_m:(start + padded[e]) // block_m] == e).all()
        start += padded[e]


@pytest.mark.parametrize("dtype,weights_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("t", [1, 5, 33])
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("launch", [TINY, (MoeLaunch(16, 32, 32, 2, 1, 1), MoeLaunch(16, 16, 32, 1, 1, 2))],
                         ids=["tiny", "grouped-pair"])
def test_fused_moe_matches_the_per_expert_loop(dtype, weights_dtype, t, top_k, launch):
    gen = torch.Generator().manual_seed(t * 10 + top_k)
    num_experts, h, inter = 8, 40, 24
    x = torch.randn(t, h, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, h, generator=gen) / h ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, h, inter, generator=gen) / inter ** 0.5).to(dtype)
    topk_ids = route(t, top_k, num_experts, gen)
    topk_weights = torch.rand(t, top_k, generator=gen).softmax(dim=-1).to(weights_dtype)
    got = fused_moe(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), topk_weights.to(DEVICE), topk_ids.to(DEVICE),
                    launch=launch)
    assert got.dtype == dtype and got.shape == (t, h)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu(), reference_moe(x, w13, w2, topk_weights, topk_ids), rtol=tol, atol=tol)


def test_fused_moe_default_launch():
    """The GPU-sized default tiles (BLOCK_N, BLOCK_K past H and 2I) at a few tokens."""
    test_fused_moe_matches_the_per_expert_loop(torch.bfloat16, torch.float32, 5, 2, None)


def test_fused_moe_writes_in_place_and_takes_the_empty_batch():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 40, generator=gen)
    w13, w2 = torch.randn(4, 48, 40, generator=gen) * 0.1, torch.randn(4, 40, 24, generator=gen) * 0.1
    topk_ids, topk_weights = torch.tensor([[1, 2], [2, 1], [1, 2]]), torch.rand(3, 2, generator=gen)
    want = reference_moe(x, w13, w2, topk_weights, topk_ids)
    xd = x.to(DEVICE)
    got = fused_moe(xd, w13.to(DEVICE), w2.to(DEVICE), topk_weights.to(DEVICE), topk_ids.to(DEVICE), xd, TINY)
    assert got is xd
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one block_m"):
        fused_moe(xd, w13.to(DEVICE), w2.to(DEVICE), topk_weights.to(DEVICE), topk_ids.to(DEVICE),
                  launch=(TINY, MoeLaunch(block_m=32)))
    empty = fused_moe(xd[:0], w13.to(DEVICE), w2.to(DEVICE), topk_weights[:0].to(DEVICE), topk_ids[:0].to(DEVICE))
    assert empty.shape == (0, 40)
