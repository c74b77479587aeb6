"""Attention backends by name (``EngineConfig.attention_backend`` / ``decode_attention_backend``).

    attention_backend   decode_attention_backend   backend
    "torch_native"      (ignored)                  TorchNativeBackend (any device)
    "flashinfer"        "flashinfer"               FlashInferBackend, prefill and decode
    "flashinfer"        "triton" / "auto"          HybridAttnBackend(FlashInfer prefill, TritonAttnBackend)
    "flashinfer"        "xqa"                      HybridAttnBackend(FlashInfer prefill, XqaAttnBackend)
    "auto"              as above                   "flashinfer" for a float16 / bfloat16 model on CUDA with the ``gpu``
                                                   extra, else "torch_native"

Each factory imports its backend's module when called, so importing this module imports neither triton nor
flashinfer. The GPU backends of one engine share one ``SharedBuffers``.
"""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch

from rollout.attention.base import AttentionBackend
from rollout.attention.common import AttentionSpec, SharedBuffers
from rollout.config import ATTENTION_BACKENDS, DECODE_ATTENTION_BACKENDS, XQA_PAGE_SIZES


def has_gpu_extra() -> bool:
    """Whether the ``gpu`` extra's packages (flashinfer, triton) are installed (without importing them)."""
    return all(importlib.util.find_spec(name) is not None for name in ("flashinfer", "triton"))


# the model dtypes FlashInfer's attention (and norm / activation) kernels take; a float32 model runs the torch path
GPU_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """``name``, with "auto" resolved: "flashinfer" for a ``dtype`` model (one of ``GPU_KERNEL_DTYPES``) on a
    CUDA device when the ``gpu`` extra is installed, else "torch_native"."""
    if name == "auto":
        gpu = torch.device(device).type == "cuda" and dtype in GPU_KERNEL_DTYPES and has_gpu_extra()
        return "flashinfer" if gpu else "torch_native"
    return name


def create_attention_backend(spec: AttentionSpec, attention_backend: str = "auto",
                             decode_attention_backend: str = "auto") -> AttentionBackend:
    """The backend the two names pick (table in the module docstring) for layers of ``spec``. Raises
    ValueError for an unknown name, and for a GPU backend without a CUDA device, without the ``gpu`` extra, or
    for a float32 model."""
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {attention_backend!r}: choose one of {ATTENTION_BACKENDS}")
    if decode_attention_backend not in DECODE_ATTENTION_BACKENDS:
        raise ValueError(f"unknown decode attention backend {decode_attention_backend!r}: choose one of "
                         f"{DECODE_ATTENTION_BACKENDS}")
    name = resolve_attention_backend(attention_backend, spec.device, spec.dtype)
    return BACKENDS[name](spec, decode_attention_backend)


def _torch_native(spec: AttentionSpec, decode_name: str) -> AttentionBackend:
    from rollout.attention.torch_native import TorchNativeBackend

    return TorchNativeBackend()


def _flashinfer(spec: AttentionSpec, decode_name: str) -> AttentionBackend:
    """FlashInfer prefill with the decode backend ``decode_name`` names ("auto": triton)."""
    if torch.device(spec.device).type != "cuda":
        raise ValueError("the flashinfer attention backend needs a CUDA device")
    if not has_gpu_extra():
        raise ValueError("the flashinfer attention backend needs flashinfer and triton: "
                         "pip install 'rollout-engine[gpu]'")
    decode_name = "triton" if decode_name == "auto" else decode_name
    if decode_name == "xqa" and spec.page_size not in XQA_PAGE_SIZES:
        raise ValueError(f"decode attention backend 'xqa' needs page_size in {XQA_PAGE_SIZES}, got {spec.page_size}")
    if spec.dtype not in GPU_KERNEL_DTYPES:
        raise ValueError(f"the flashinfer attention backend needs a float16 or bfloat16 model, not {spec.dtype} "
                         "(use attention_backend='torch_native', or dtype='bfloat16')")
    return DECODE_BACKENDS[decode_name](spec, SharedBuffers(spec.device, spec.max_kv_indices))


def _flashinfer_decode(spec: AttentionSpec, shared: SharedBuffers) -> AttentionBackend:
    from rollout.attention import flashinfer_backend

    return flashinfer_backend.FlashInferBackend(spec, shared)


def _triton_decode(spec: AttentionSpec, shared: SharedBuffers) -> AttentionBackend:
    from rollout.attention import flashinfer_backend, hybrid, triton_backend

    return hybrid.HybridAttnBackend(flashinfer_backend.FlashInferBackend(spec, shared, with_decode=False),
                                    triton_backend.TritonAttnBackend(spec, shared))


def _xqa_decode(spec: AttentionSpec, shared: SharedBuffers) -> AttentionBackend:
    from rollout.attention import flashinfer_backend, hybrid, xqa_backend

    return hybrid.HybridAttnBackend(flashinfer_backend.FlashInferBackend(spec, shared, with_decode=False),
                                    xqa_backend.XqaAttnBackend(spec, shared))


# name -> factory(spec, decode backend name)
BACKENDS: dict[str, Callable[[AttentionSpec, str], AttentionBackend]] = {
    "torch_native": _torch_native,
    "flashinfer": _flashinfer,
}
# decode backend name under "flashinfer" -> factory(spec, shared buffers)
DECODE_BACKENDS: dict[str, Callable[[AttentionSpec, SharedBuffers], AttentionBackend]] = {
    "flashinfer": _flashinfer_decode,
    "triton": _triton_decode,
    "xqa": _xqa_decode,
}
