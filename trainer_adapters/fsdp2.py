"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters are DTensors sharded over the trainer ranks.

``DTensor.full_tensor()`` all-gathers one parameter on every rank, so every trainer rank runs the same
gathers in the same order (``broadcast_to_engines`` arranges that); only the sending rank broadcasts.
FSDP2 keeps the module's own parameter names, so no renaming beyond the usual wrappers is needed.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer_adapters.gather import ParamSource


def is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(t, DTensor)


def is_fsdp2(model: Any) -> bool:
    """True when the model (or a submodule) was wrapped by ``fully_shard``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules()) or \
        any(is_dtensor(p) for p in model.parameters())


def is_fsdp1(model: Any) -> bool:
    """FSDP1 (``FullyShardedDataParallel``) keeps flattened parameters; we do not gather those."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


class FSDP2Source(ParamSource):
    """Parameters of an FSDP2 model; ``full_tensor()`` is a collective over the sharding mesh."""

    kind = "fsdp2"

    def full_shape(self, p: torch.Tensor) -> torch.Size:
        return p.shape  # a DTensor reports its global shape

    def full_tensor(self, p: torch.Tensor) -> torch.Tensor:
        t = p.detach()
        return t.full_tensor() if is_dtensor(t) else t
