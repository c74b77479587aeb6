"""Rotary position embedding with the same inverse frequencies and cos/sin rounding as transformers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_inv_freq(model_raw_config: dict[str, Any], rope: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] float32, attention scaling) for the checkpoint's rope type."""
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        base = float(rope["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)), 1.0
    if "dynamic" in rope_type or rope_type == "longrope":  # transformers recomputes these by sequence length
        raise ValueError(f"rope_type {rope_type!r} depends on the sequence length (transformers recomputes its "
                         "frequencies per forward) and is not supported")
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    raw = {k: v for k, v in model_raw_config.items() if k not in ("architectures", "transformers_version")}
    hf_config = AutoConfig.for_model(**raw)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    if 2 * inv_freq.numel() != head_dim:  # e.g. a partial rotary factor, which these rope types do not apply here
        raise ValueError(f"rope_type {rope_type!r} gives {inv_freq.numel()} frequencies for a head of {head_dim}: "
                         "a partial rotary factor with this rope type is not supported")
    return inv_freq.float(), float(scaling)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, Hq, D] and k [T, Hk, D] at integer ``positions`` [T] (neox/HF layout)."""

    def __init__(self, head_dim: int, max_positions: int, inv_freq: torch.Tensor, scaling: float,
                 dtype: torch.dtype, device: Any = None) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", (emb.cos() * scaling).to(dtype).to(device), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * scaling).to(dtype).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
