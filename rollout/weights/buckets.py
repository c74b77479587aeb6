"""What an update announces (name, dtype, shape per tensor) and SGLang's flattened-bucket layout.

A bucket is one uint8 buffer holding each announced tensor's bytes back to back, in announcement order
(SGLang's ``FlattenedTensorBucket``): the trainer ``flatten``s and broadcasts it, each engine rank
``unflatten``s views of it. ``parse_specs`` checks an announcement's form (not the model: see
``WeightUpdater.problems``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rollout.dtypes import parse_dtype


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def parse_specs(names: Any, dtypes: Any, shapes: Any) -> list[TensorSpec]:
    """Validate the form of an update announcement (ValueError naming the problem)."""
    if isinstance(names, str):
        names, dtypes, shapes = [names], [dtypes], [shapes]
    if not isinstance(names, (list, tuple)) or not names:
        raise ValueError("names must be a non-empty list of parameter names")
    if not (isinstance(dtypes, (list, tuple)) and isinstance(shapes, (list, tuple))) \
            or not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes must be lists of one length "
                         f"(got {len(names)}, {_len(dtypes)}, {_len(shapes)})")
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str):
            raise ValueError(f"parameter names must be strings, got {name!r}")
        if not isinstance(shape, (list, tuple)) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError(f"shape of {name!r} must be a list of non-negative ints, got {shape!r}")
        specs.append(TensorSpec(name, parse_dtype(dtype), tuple(shape)))
    return specs


def _len(x: Any) -> Any:
    return len(x) if isinstance(x, (list, tuple)) else type(x).__name__


def unflatten(flat: torch.Tensor, specs: list[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """Views of a uint8 buffer laid out as a flattened bucket, one per named tensor (a tensor whose offset is
    not a multiple of its element size is copied out, since a view would be misaligned)."""
    out, offset = [], 0
    for spec in specs:
        n = spec.nbytes
        part = flat[offset:offset + n]
        if offset % spec.dtype.itemsize:
            part = part.clone()
        out.append((spec.name, part.view(spec.dtype).view(spec.shape)))
        offset += n
    return out


def flatten(tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of ``unflatten``: each tensor's bytes back to back in one uint8 tensor (into ``out``,
    a large enough uint8 buffer, when given)."""
    parts = [t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors]
    if out is None:
        return torch.cat(parts)
    n = sum(p.numel() for p in parts)
    return torch.cat(parts, out=out[:n])
