"""rollout.kernels.fused_quant against the torch ops it fuses: RMSNorm (with the residual add) or
SiLU·mul in the model dtype, then ``quantize_fp8_tokens_torch``.

Without a CUDA device the kernels run under Triton's CPU interpreter (``triton_interpreter``).
"""

from __future__ import annotations

from triton_interpreter import DEVICE  # first: sets up the interpreter before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rollout.layers.norm import RMSNorm  # noqa: E402
from rollout.layers.quantization import (Fp8Activation, dequantize_fp8_rows, fp8_linear,  # noqa: E402
                                         quantize_fp8_rows, quantize_fp8_tokens_torch)
from rollout.kernels.fused_quant import add_rmsnorm_quant_fp8, silu_mul_quant_fp8  # noqa: E402


def assert_same_quantization(got: Fp8Activation, want_values: torch.Tensor) -> None:
    """``got`` quantizes ``want_values`` (the unfused ops' output) as ``quantize_fp8_tokens_torch`` does.

    The kernel's float32 sum of squares runs in another order than torch's, so a normalized value on a
    rounding boundary may land one model-dtype ulp away; everything else must be bit-identical.
    """
    want_q, want_s = quantize_fp8_tokens_torch(want_values)
    assert got.q.dtype == torch.float8_e4m3fn and got.scale.shape == want_s.shape
    torch.testing.assert_close(got.scale.cpu(), want_s, rtol=1e-2, atol=0)
    same_scale = (got.scale.cpu() == want_s).squeeze(1)
    equal = got.q.cpu().float() == want_q.float()
    assert equal[same_scale].float().mean() >= 0.99
    deq = dequantize_fp8_rows(got.q.cpu(), got.scale.cpu().squeeze(1))
    want = dequantize_fp8_rows(want_q, want_s.squeeze(1))
    step = want.abs().clamp_min(want_s) / 8  # one e4m3 ulp (3 mantissa bits), relative to the row's scale
    assert ((deq - want).abs() <= step * 1.01).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("cols", [96, 1000])
def test_add_rmsnorm_quant_is_rmsnorm_then_per_token_quantization(dtype, with_residual, cols):
    gen = torch.Generator().manual_seed(cols)
    x = (torch.randn(7, cols, generator=gen) * 3).to(dtype)
    residual = torch.randn(7, cols, generator=gen).to(dtype)
    norm = RMSNorm(cols, 1e-6, dtype)
    norm.weight.data.copy_(torch.rand(cols, generator=gen) + 0.5)
    if with_residual:
        want_normed, want_residual = norm(x, residual.clone())
    else:
        want_normed = norm(x)
    res = residual.clone().to(DEVICE) if with_residual else None
    got = add_rmsnorm_quant_fp8(x.to(DEVICE), res, norm.weight.to(DEVICE), 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    if with_residual:  # residual += x, rounded to the model dtype, exactly as torch adds
        assert torch.equal(res.cpu(), want_residual)
    assert_same_quantization(got, want_normed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cols", [80, 1024])
def test_silu_mul_quant_is_silu_times_up_then_per_token_quantization(dtype, cols):
    gen = torch.Generator().manual_seed(cols + 1)
    gate_up = (torch.randn(5, 2 * cols, generator=gen) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    got = silu_mul_quant_fp8(gate_up.to(DEVICE))
    assert got.dtype == dtype and got.shape == (5, cols)
    assert_same_quantization(got, F.silu(gate) * up)


def test_a_fused_norm_module_returns_what_the_fp8_projection_takes():
    """RMSNorm(fused, quantize_out) returns an Fp8Activation; fp8_linear of it equals fp8_linear of the
    unfused norm's output (up to the boundary cases above), and the empty batch works."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    residual = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    weight, weight_scale = quantize_fp8_rows(torch.randn(32, 64, generator=gen) * 0.05)
    plain = RMSNorm(64, 1e-5, torch.bfloat16)
    fused = RMSNorm(64, 1e-5, torch.bfloat16, DEVICE, fused=True, quantize_out=True)
    h, res = fused(x.to(DEVICE), residual.clone().to(DEVICE))
    assert isinstance(h, Fp8Activation)
    want_h, want_res = plain(x, residual.clone())
    assert torch.equal(res.cpu(), want_res)
    got = fp8_linear(Fp8Activation(h.q.cpu(), h.scale.cpu(), h.dtype), weight, weight_scale)
    torch.testing.assert_close(got, fp8_linear(want_h, weight, weight_scale), rtol=2e-2, atol=2e-2)
    empty = add_rmsnorm_quant_fp8(x[:0].to(DEVICE), None, fused.weight, 1e-5)
    assert empty.q.shape == (0, 64) and empty.scale.shape == (0, 1)
