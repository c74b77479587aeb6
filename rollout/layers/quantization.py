"""Online FP8 (W8A8) quantization of linear layers: ``quantization="fp8"`` (SGLang's and vLLM's name).

Weights are quantized when they are loaded (from disk, by a weight update, or by dummy init) from the
Hugging Face tensor in the model dtype:

- weight: float8_e4m3fn, one float32 scale per output row, ``scale = amax(|row|) · (1/448)`` over the
  *full* HF row, so the stored values do not depend on the tensor-parallel split;
- activations: float8_e4m3fn with one dynamic scale per token (row), computed per call (under tensor
  parallelism a row-parallel layer, o_proj or down_proj, scales each rank's slice of the row: one
  scale per token per rank, as SGLang's and vLLM's per-token fp8 does);
- product: ``(x_q @ w_q^T) * x_scale * w_scale`` accumulated in float32, output in the model dtype.

On CUDA (sm90: row-wise ``torch._scaled_mm``) the product is ``fp8_linear``'s choice of kernel and the
activation quantization is one Triton kernel, or part of the norm / SiLU·mul kernel before the projection
(``Fp8Activation``, ``rollout.kernels.fused_quant``); elsewhere the same arithmetic runs in float32 torch ops (the CPU reference).
Quantization is deterministic (IEEE division, round-to-nearest-even cast), so a trainer can compute the
served tensors exactly: ``weight_sync.fingerprint(..., quantization="fp8")``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Scales are amax * (float32 1/448), a correctly rounded multiply that torch (CPU and CUDA) and Triton
# all compute alike (torch turns a division by a Python scalar into this multiply on CUDA but not on CPU).
INV_FP8_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))
# Where Triton's fp8_gemm beats torch._scaled_mm's CUTLASS kernels (tools/bench_fp8_gemm.py, H200).
TRITON_GEMM_MAX_TOKENS = 16
_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # rows of zeros get this scale instead of 0
# Longest rows that rollout.kernels.fused_quant's norm and SiLU·mul kernels quantize (held in registers).
FUSED_QUANT_MAX_COLS = 32768
# The Hugging Face weights an fp8 engine stores quantized (the projections of every decoder layer).
_QUANTIZED_WEIGHT = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def is_quantized_weight(hf_name: str) -> bool:
    """Whether ``hf_name`` is stored as fp8 + row scales under ``quantization="fp8"``."""
    return bool(_QUANTIZED_WEIGHT.search(hf_name))


def scale_name(hf_name: str) -> str:
    """The name under which a quantized weight's row scales appear in fingerprints."""
    return hf_name + "_scale"


def fp8_row_scales(w: torch.Tensor) -> torch.Tensor:
    """float32 [rows]: ``max(amax(|row|) · (1/448), min)`` of a 2-D ``w``."""
    if w.dim() != 2:
        raise ValueError(f"fp8 row quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    return (w.detach().abs().amax(dim=1).float() * INV_FP8_MAX).clamp_min(_MIN_SCALE)


def quantize_fp8_rows(w: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn tensor, float32 scales [rows]) with ``w ≈ q * scale[:, None]`` for a 2-D ``w``;
    ``scale`` (default ``fp8_row_scales(w)``) lets a column slice use its full rows' scales."""
    scale = fp8_row_scales(w) if scale is None else scale
    q = (w.detach().float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_fp8_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [T, K], float32 scales [T, 1]): dynamic per-token quantization of a 2-D ``x``."""
    if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1:
        from rollout.kernels.quant import per_token_quant_fp8

        return per_token_quant_fp8(x)
    return quantize_fp8_tokens_torch(x)


def quantize_fp8_tokens_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_fp8_tokens`` in torch ops (any device; the reference for the Triton kernel): each token
    is a row, quantized as ``quantize_fp8_rows`` quantizes a weight's rows."""
    q, scale = quantize_fp8_rows(x)
    return q, scale.unsqueeze(1)


@dataclass(frozen=True)
class Fp8Activation:
    """Activations already quantized per token by the kernel that produced them
    (``rollout.kernels.fused_quant``): ``q`` float8_e4m3fn [T, K], ``scale`` float32 [T, 1], and the
    model ``dtype`` the projection returns."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def fused_quant_supports(cols: int) -> bool:
    """Whether the fused norm / SiLU·mul + quantization kernels take rows of ``cols`` elements."""
    return 0 < cols <= FUSED_QUANT_MAX_COLS


def fp8_linear(x: torch.Tensor | Fp8Activation, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(weight)^T + bias`` with x quantized per token (here, or already: ``Fp8Activation``);
    ``weight`` fp8 [N, K], scales [N].

    CUDA: up to ``TRITON_GEMM_MAX_TOKENS`` tokens the Triton ``fp8_gemm`` (bandwidth-bound decode),
    above that ``torch._scaled_mm`` with row-wise scales; elsewhere float32 torch ops.
    """
    if isinstance(x, Fp8Activation):
        shape, dtype, (xq, xs) = x.shape, x.dtype, (x.q, x.scale)
    else:
        shape, dtype = x.shape, x.dtype
        xq, xs = quantize_fp8_tokens(x.reshape(-1, shape[-1]))
    if xq.is_cuda and xq.shape[0] <= TRITON_GEMM_MAX_TOKENS:
        from rollout.kernels.fp8_gemm import fp8_gemm

        out = fp8_gemm(xq, xs, weight, weight_scale, dtype)
    elif xq.is_cuda:
        out = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale.view(1, -1), out_dtype=dtype)
    else:
        out = ((xq.float() @ weight.float().t()) * xs * weight_scale.view(1, -1)).to(dtype)
    if bias is not None:
        out = out + bias
    return out.view(*shape[:-1], weight.shape[0])


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale[:, None]`` in ``dtype`` (what the engine effectively multiplies by)."""
    return (q.float() * scale.view(-1, 1)).to(dtype)


def reference_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """What ``fp8_linear`` computes, in float32 torch ops (the reference for tests and GPU checks)."""
    xq, xs = quantize_fp8_tokens_torch(x.reshape(-1, x.shape[-1]))
    out = F.linear(xq.float() * xs, dequantize_fp8_rows(weight, weight_scale))
    if bias is not None:
        out = out + bias.float()
    return out.view(*x.shape[:-1], weight.shape[0])
