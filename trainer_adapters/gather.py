"""Full tensors from a trainer's model, bucket by bucket: the part every trainer rank runs.

A ``ParamSource`` knows each parameter's Hugging Face name, full shape and dtype without gathering
anything, so buckets are planned up front (the same plan on every rank); then ``gathered(plan)``
yields one bucket of full tensors at a time. For sharded models the gather is a collective, so
every trainer rank iterates over the same plan; only the sending rank uses the tensors.

This file covers modules whose parameters are plain tensors (a ``transformers`` model, DDP, an
Accelerate-prepared model, ``torch.compile``). ``fsdp2.py`` and ``zero3.py`` cover sharded ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from trainer_adapters.names import hf_named_parameters, unwrap_model
from weight_sync.sender import plan_buckets


@dataclass(frozen=True)
class ParamMeta:
    """One parameter as the engine will receive it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class ParamSource:
    """Parameters of a plain module (no sharding): the tensors are already full on every rank.

    ``owns_buckets``: a yielded bucket's tensors stay valid until the iterator has moved on twice (FSDP2's
    two buffer sets), so the next bucket may be gathered and sent while the engines still read this one.
    False here (nothing is gathered: the tensors are the parameters) and for ZeRO-3 (leaving a bucket
    releases its gather)."""

    kind = "module"
    owns_buckets = False

    def __init__(self, model: Any) -> None:
        self.model = unwrap_model(model)
        self.params = self._named(self.model)
        if not self.params:
            raise ValueError(f"{type(model).__name__} has no parameters to send")
        names = [n for n, _ in self.params]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"parameter names collide after removing wrapper prefixes: {dupes[:3]}")

    @staticmethod
    def _named(model: Any) -> list[tuple[str, torch.nn.Parameter]]:
        return hf_named_parameters(model)

    def metas(self) -> list[ParamMeta]:
        return [ParamMeta(n, tuple(self.full_shape(p)), p.dtype) for n, p in self.params]

    def full_shape(self, p: torch.Tensor) -> torch.Size:
        return p.shape

    def plan(self, mode: str, bucket_bytes: int, dtype: torch.dtype | None = None) -> list[list[int]]:
        """Indices of the parameters in each bucket: buckets of at most ``bucket_bytes`` (as sent, after
        the cast to ``dtype``), or one parameter each in ``per_tensor`` mode."""
        if mode == "per_tensor":
            return [[i] for i in range(len(self.params))]
        metas = [(str(i), torch.empty(m.shape, dtype=dtype or m.dtype, device="meta"))
                 for i, m in enumerate(self.metas())]
        return [[int(i) for i, _ in bucket] for bucket in plan_buckets(metas, bucket_bytes)]

    def gathered(self, plan: list[list[int]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """One bucket of (HF name, full tensor) at a time; every trainer rank must iterate in step."""
        for bucket in plan:
            yield [(self.params[i][0], self.full_tensor(self.params[i][1])) for i in bucket]

    def full_tensor(self, p: torch.Tensor) -> torch.Tensor:
        return p.detach()

    def named_full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, gathered one at a time (for fingerprints and checks; collective when sharded)."""
        for bucket in self.gathered([[i] for i in range(len(self.params))]):
            yield from ((n, t.clone()) for n, t in bucket)
