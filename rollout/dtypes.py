"""Dtype names: the one place that turns torch dtypes into the names that travel in messages and JSON
("bfloat16", never "torch.bfloat16") and back. ``dtype_name`` needs no torch import (``rollout.client``
uses only the standard library)."""

from __future__ import annotations

from typing import Any


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` or "torch.bfloat16" or "bfloat16" → "bfloat16"."""
    return str(dtype).replace("torch.", "")


def parse_dtype(dtype: Any):
    """A torch dtype from a torch dtype or a name such as "bfloat16" / "torch.bfloat16"; ValueError otherwise."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        found = getattr(torch, dtype_name(dtype), None)
        if isinstance(found, torch.dtype):
            return found
    raise ValueError(f"unknown dtype {dtype!r}")
