"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters are DTensors sharded over the trainer ranks.

A bucket is gathered with one ``all_gather_into_tensor`` of its row shards' bytes (FSDP2's own
copy-in / all-gather / copy-out, without its per-module grouping); parameters sharded any other way
fall back to ``DTensor.full_tensor()``, one collective each. Every trainer rank runs the same gathers in
the same order (``broadcast_to_engines`` arranges that); only the sending rank sends. FSDP2 keeps the
module's own parameter names, so no renaming beyond the usual wrappers is needed.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist

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
    owns_buckets = True  # each bucket is a fresh buffer (or ``full_tensor()`` results) that we hold

    def full_shape(self, p: torch.Tensor) -> torch.Size:
        return p.shape  # a DTensor reports its global shape

    def full_tensor(self, p: torch.Tensor) -> torch.Tensor:
        t = p.detach()
        return t.full_tensor() if is_dtensor(t) else t

    def gathered(self, plan: list[list[int]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for bucket in plan:
            params = [self.params[i][1].detach() for i in bucket]
            rows = [p for p in params if _row_sharded(p, params[0])]
            full = dict(zip(map(id, rows), gather_rows(rows))) if rows else {}
            yield [(self.params[i][0], full[id(p)] if id(p) in full else self.full_tensor(p))
                   for i, p in zip(bucket, params)]


def _row_sharded(p: Any, first: Any) -> bool:
    """A DTensor sharded on dim 0 over a 1-D mesh (FSDP2's layout), on the same mesh as ``first``."""
    from torch.distributed.tensor import Shard

    return (is_dtensor(p) and is_dtensor(first) and p.device_mesh == first.device_mesh and p.dim() > 0
            and p.shape[0] > 0 and tuple(p.placements) == (Shard(0),))


def gather_rows(params: list[Any]) -> list[torch.Tensor]:
    """Full tensors of dim-0-sharded DTensors of one 1-D mesh, with one in-place ``all_gather_into_tensor``
    of their bytes. Rank r holds rows [r*c, (r+1)*c) of each (c = ceil(rows / ranks), ``torch.chunk``'s
    split), so each rank's part is c rows long, padded (and 16-byte aligned). On one rank the results are views of the buffer;
    otherwise each is copied out of the rank-major buffer."""
    mesh = params[0].device_mesh
    ranks, rank = mesh.size(), mesh.get_local_rank()
    layout, total = [], 0
    for p in params:
        total = -(-total // 16) * 16  # aligned for any dtype's view
        row_bytes = p.numel() // p.shape[0] * p.element_size()
        chunk = -(-p.shape[0] // ranks) * row_bytes
        layout.append((total, chunk, row_bytes))
        total += chunk
    total = -(-total // 16) * 16  # so every rank's part starts 16-byte aligned too
    local = params[0].to_local()
    out = torch.empty((ranks, total), dtype=torch.uint8, device=local.device)
    mine = out[rank]
    for p, (offset, _, _) in zip(params, layout):
        part = p.to_local().contiguous().view(-1).view(torch.uint8)
        mine[offset:offset + part.numel()].copy_(part)  # contiguous to contiguous: one memcpy
    if ranks > 1:
        dist.all_gather_into_tensor(out.view(-1), mine, group=mesh.get_group())
    full = []
    for p, (offset, chunk, row_bytes) in zip(params, layout):
        n = p.shape[0] * row_bytes
        if ranks == 1:
            flat = out[0, offset:offset + n]
        else:  # the rank-major parts, back to back
            flat = torch.empty(ranks * chunk, dtype=torch.uint8, device=out.device)
            copy_bytes(flat.view(ranks, chunk), out[:, offset:offset + chunk])
            flat = flat[:n]
        full.append(flat.view(p.dtype).view(p.shape))
    return full


_WIDE = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for uint8 tensors of one shape (1-D, or 2-D with a contiguous last dim), through
    the widest integer type that their sizes, strides and addresses allow: a strided copy (not a memcpy)
    otherwise moves one byte per element."""
    last = dst.shape[-1]
    facts = [last, dst.data_ptr(), src.data_ptr(), *dst.stride()[:-1], *src.stride()[:-1]]
    for width, dtype in _WIDE.items():
        if all(f % width == 0 for f in facts):
            dst.view(dtype).copy_(src.view(dtype))
            return
    dst.copy_(src)
