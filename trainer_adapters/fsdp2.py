"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters are DTensors sharded over the trainer ranks.

A bucket is gathered with one ``all_gather_into_tensor`` of its row shards' bytes (FSDP2's own
copy-in / all-gather / copy-out, without its per-module grouping); parameters sharded any other way
fall back to ``DTensor.full_tensor()``, one collective each. Every trainer rank runs the same gathers in
the same order (``broadcast_to_engines`` arranges that); only the sending rank sends. FSDP2 keeps the
module's own parameter names, so no renaming beyond the usual wrappers is needed.

An unsharded FSDP2 module (``reshard_after_forward=False`` after a forward, or ``unshard()``) exposes its
all-gathered compute copies as its parameters: in ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``
those are bf16 copies, not the fp32 weights the optimizer updates. The source reshards every module first
(local, no collective), as FSDP2's ``state_dict()`` does, so the sharded fp32 parameters are what is sent.
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
    """Parameters of an FSDP2 model; ``full_tensor()`` is a collective over the sharding mesh.

    ``gathered`` writes its buckets in turn into two sets of buffers that live as long as the iteration, so a
    yielded bucket stays valid until the iterator has moved on twice (the next bucket can be gathered while
    the engines read this one), and a colocated engine maps each buffer once per push instead of every
    bucket's tensors (``rollout.weights.ipc_protocol``)."""

    kind = "fsdp2"
    owns_buckets = True  # each bucket stays valid for one more step of the iteration (two buffer sets)

    def __init__(self, model: Any) -> None:
        reshard(model)
        super().__init__(model)

    def full_shape(self, p: torch.Tensor) -> torch.Size:
        return p.shape  # a DTensor reports its global shape

    def full_tensor(self, p: torch.Tensor) -> torch.Tensor:
        t = p.detach()
        return t.full_tensor() if is_dtensor(t) else t

    def gathered(self, plan: list[list[int]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        params_of = [[self.params[i][1].detach() for i in bucket] for bucket in plan]
        rows_of = [[p for p in params if _row_sharded(p, params[0])] for params in params_of]
        sizes = [gather_sizes(rows) for rows in rows_of if rows]
        need = (max(s[0] for s in sizes), max(s[1] for s in sizes)) if sizes else (0, 0)
        slots = [BucketBuffers(need), BucketBuffers(need)]
        for k, (bucket, params, rows) in enumerate(zip(plan, params_of, rows_of)):
            full = dict(zip(map(id, rows), gather_rows(rows, slots[k % 2]))) if rows else {}
            yield [(self.params[i][0], full[id(p)] if id(p) in full else self.full_tensor(p))
                   for i, p in zip(bucket, params)]


def reshard(model: Any) -> None:
    """``reshard()`` every FSDP2 module of ``model``: its parameters are the sharded (master) ones again,
    whatever a forward with ``reshard_after_forward=False`` or an ``unshard()`` left. Local to this rank."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _row_sharded(p: Any, first: Any) -> bool:
    """A DTensor sharded on dim 0 over a 1-D mesh (FSDP2's layout), on the same mesh as ``first``."""
    from torch.distributed.tensor import Shard

    return (is_dtensor(p) and is_dtensor(first) and p.device_mesh == first.device_mesh and p.dim() > 0
            and p.shape[0] > 0 and tuple(p.placements) == (Shard(0),))


def _align(n: int) -> int:
    return -(-n // 16) * 16  # 16-byte aligned, for any dtype's view


def _layout(params: list[Any], ranks: int) -> tuple[list[tuple[int, int, int]], int]:
    """(offset, chunk bytes, row bytes) of each parameter in one rank's part of the gather buffer, and the
    part's size: rank r holds rows [r*c, (r+1)*c) of each (c = ceil(rows / ranks), ``torch.chunk``'s split),
    so each rank's part is c rows long, padded."""
    layout, total = [], 0
    for p in params:
        total = _align(total)
        row_bytes = p.numel() // p.shape[0] * p.element_size()
        chunk = -(-p.shape[0] // ranks) * row_bytes
        layout.append((total, chunk, row_bytes))
        total += chunk
    return layout, _align(total)  # so every rank's part starts aligned too


def _full_offsets(layout: list[tuple[int, int, int]], ranks: int) -> tuple[list[int], int]:
    """Where each parameter's full tensor (its ``ranks`` padded chunks, back to back) starts in the second
    buffer of ``gather_rows`` on several ranks, and that buffer's size."""
    offsets, end = [], 0
    for _, chunk, _ in layout:
        offsets.append(_align(end))
        end = offsets[-1] + ranks * chunk
    return offsets, end


def gather_sizes(params: list[Any]) -> tuple[int, int]:
    """Bytes ``gather_rows`` needs for ``params``: (the all-gather buffer, the full tensors beside it; 0 on one
    rank, where the full tensors are views of the all-gather buffer)."""
    ranks = params[0].device_mesh.size()
    layout, total = _layout(params, ranks)
    return ranks * total, (_full_offsets(layout, ranks)[1] if ranks > 1 else 0)


class BucketBuffers:
    """One bucket's uint8 buffers on the device, allocated at their first use at the sizes given (the largest
    bucket's ``gather_sizes``) and reused by every later bucket in this slot."""

    def __init__(self, sizes: tuple[int, int]) -> None:
        self.sizes = sizes
        self._buffers: list[torch.Tensor | None] = [None, None]

    def get(self, which: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """The first ``nbytes`` of buffer ``which`` (0: the all-gather, 1: the full tensors)."""
        buf = self._buffers[which]
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[which] = torch.empty(max(nbytes, self.sizes[which]), dtype=torch.uint8,
                                                     device=device)
        return buf[:nbytes]


def gather_rows(params: list[Any], buffers: BucketBuffers | None = None) -> list[torch.Tensor]:
    """Full tensors of dim-0-sharded DTensors of one 1-D mesh, with one in-place ``all_gather_into_tensor``
    of their bytes (``_layout``), in ``buffers`` (fresh ones unless given). On one rank the results are views
    of the all-gather buffer; otherwise each is copied out of the rank-major buffer into the second one."""
    mesh = params[0].device_mesh
    ranks, rank = mesh.size(), mesh.get_local_rank()
    layout, total = _layout(params, ranks)
    full_at, full_size = _full_offsets(layout, ranks) if ranks > 1 else ([], 0)
    local = params[0].to_local()
    buffers = BucketBuffers((ranks * total, full_size)) if buffers is None else buffers
    out = buffers.get(0, ranks * total, local.device).view(ranks, total)
    mine = out[rank]
    for p, (offset, _, _) in zip(params, layout):
        part = p.to_local().contiguous().view(-1).view(torch.uint8)
        mine[offset:offset + part.numel()].copy_(part)  # contiguous to contiguous: one memcpy
    if ranks > 1:
        dist.all_gather_into_tensor(out.view(-1), mine, group=mesh.get_group())
        dest = buffers.get(1, full_size, local.device)
    full = []
    for k, (p, (offset, chunk, row_bytes)) in enumerate(zip(params, layout)):
        n = p.shape[0] * row_bytes
        if ranks == 1:
            flat = out[0, offset:offset + n]
        else:  # the rank-major parts, back to back
            flat = dest[full_at[k]:full_at[k] + ranks * chunk]
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
