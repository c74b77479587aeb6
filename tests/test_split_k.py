"""Split-K row-parallel projections (rollout.layers.split_k) and the add + RMSNorm that sums their partials
(rollout.kernels.add_rmsnorm), against the torch ops they replace: ``F.linear`` and ``RMSNorm``'s torch path
(Hugging Face's arithmetic).

Without a CUDA device the kernel runs under Triton's CPU interpreter (``triton_interpreter``). The whole model
with split projections is checked against transformers on the GPU (``gpu_checks/check_logits.py``).
"""

from __future__ import annotations

from triton_interpreter import DEVICE  # first: sets up the interpreter before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rollout.distributed import TPGroup  # noqa: E402
from rollout.kernels.add_rmsnorm import add_rmsnorm_split_k  # noqa: E402
from rollout.layers.linear import RowParallelLinear  # noqa: E402
from rollout.layers.norm import RMSNorm  # noqa: E402
from rollout.layers.split_k import SPLIT_K_MAX_ROWS, SplitKPartials, split_k_matmul  # noqa: E402


def in_order_sum(partials: torch.Tensor) -> torch.Tensor:
    """p_0 + p_1 + ... in float32, in that order (the kernel's order)."""
    total = partials[0].clone()
    for p in partials[1:]:
        total += p
    return total


def assert_within_one_ulp(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Bit-equal but for rare values on a rounding boundary (float32 sums in another order), which may land
    one ``dtype`` ulp away. In a float32 model nothing rounds the norm's statistic away, so a sum of squares
    one ulp off moves its whole row: there every value must be within 4 ulp."""
    got, want = got.cpu().float(), want.cpu().float()
    ulps = 1.01
    if dtype == torch.float32:
        ulps = 4.0
    else:
        assert (got == want).float().mean() >= 0.99
    ulp = want.abs().clamp_min(torch.finfo(dtype).tiny) * torch.finfo(dtype).eps
    assert ((got - want).abs() <= ulp * ulps).all()


@pytest.mark.parametrize("splits", [2, 4])
def test_split_matmul_partials_sum_to_the_float32_product(splits):
    gen = torch.Generator().manual_seed(splits)
    x = torch.randn(5, 96, generator=gen).to(torch.bfloat16)
    w = (torch.randn(40, 96, generator=gen) * 0.1).to(torch.bfloat16)
    out = split_k_matmul(x.to(DEVICE), w.to(DEVICE), splits)
    assert isinstance(out, SplitKPartials) and out.dtype == torch.bfloat16
    assert out.partials.shape == (splits, 5, 40) and out.partials.dtype == torch.float32 and out.shape == (5, 40)
    for s in range(splits):  # slice s is the product over the s-th K slice
        cols = slice(s * 96 // splits, (s + 1) * 96 // splits)
        want = x[:, cols].float() @ w[:, cols].float().t()
        torch.testing.assert_close(out.partials[s].cpu(), want, rtol=1e-5, atol=1e-5)
    rounded = in_order_sum(out.partials).to(torch.bfloat16)
    assert_within_one_ulp(rounded, F.linear(x.float(), w.float()).to(torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("cols", [96, 1000])
def test_add_rmsnorm_sums_the_partials_then_adds_and_normalizes_as_torch(dtype, splits, cols):
    gen = torch.Generator().manual_seed(cols * 10 + splits)
    partials = torch.randn(splits, 7, cols, generator=gen) * 2
    residual = torch.randn(7, cols, generator=gen).to(dtype)
    norm = RMSNorm(cols, 1e-6, dtype)
    norm.weight.data.copy_(torch.rand(cols, generator=gen) + 0.5)
    want_normed, want_residual = norm(in_order_sum(partials).to(dtype), residual.clone())
    res = residual.clone().to(DEVICE)
    got = add_rmsnorm_split_k(partials.to(DEVICE), res, norm.weight.to(DEVICE), 1e-6)
    assert got.dtype == dtype and got.shape == (7, cols)
    assert torch.equal(res.cpu(), want_residual)  # residual += o, rounded to the model dtype as torch adds
    assert_within_one_ulp(got, want_normed, dtype)


def test_a_fused_norm_takes_split_partials_and_needs_their_residual():
    gen = torch.Generator().manual_seed(5)
    partials = torch.randn(2, 3, 64, generator=gen)
    residual = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    plain = RMSNorm(64, 1e-5, torch.bfloat16)
    fused = RMSNorm(64, 1e-5, torch.bfloat16, DEVICE, fused=True)
    want_h, want_res = plain(in_order_sum(partials).to(torch.bfloat16), residual.clone())
    h, res = fused(SplitKPartials(partials.to(DEVICE), torch.bfloat16), residual.clone().to(DEVICE))
    assert torch.equal(res.cpu(), want_res)
    assert_within_one_ulp(h, want_h, torch.bfloat16)
    with pytest.raises(ValueError, match="residual"):
        fused(SplitKPartials(partials.to(DEVICE), torch.bfloat16))


def _row_linear(in_features: int, out_features: int, **kw) -> RowParallelLinear:
    layer = RowParallelLinear(in_features, out_features, kw.pop("bias", False), TPGroup(), torch.bfloat16, DEVICE,
                              **kw)
    layer.weight.data.copy_(torch.randn(out_features, in_features) * 0.05)
    return layer


def test_row_parallel_linear_splits_only_small_batches_of_long_reductions():
    layer = _row_linear(96, 40, split_k=True)
    x = torch.randn(SPLIT_K_MAX_ROWS + 1, 96).to(torch.bfloat16).to(DEVICE)
    small = layer(x[:4])
    assert isinstance(small, SplitKPartials)
    assert_within_one_ulp(in_order_sum(small.partials).to(torch.bfloat16), F.linear(x[:4], layer.weight),
                          torch.bfloat16)
    big = layer(x)  # above SPLIT_K_MAX_ROWS: one plain matmul
    assert isinstance(big, torch.Tensor) and torch.equal(big, F.linear(x, layer.weight))
    assert isinstance(layer(x[:4].t().contiguous().t()), torch.Tensor)  # rows not contiguous: plain
    assert isinstance(layer(x[:0]), torch.Tensor)                       # the empty batch: plain
    for plain in (_row_linear(96, 40), _row_linear(96, 60, split_k=True),  # off; reduction < 2x output
                  _row_linear(96, 40, split_k=True, bias=True)):
        assert not plain.split_k and isinstance(plain(x[:4]), torch.Tensor)
