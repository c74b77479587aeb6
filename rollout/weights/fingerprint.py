"""A fingerprint of model weights in Hugging Face naming and layout, computable from any sharding.

Each tensor's digest is a pair of sums, over its elements, of two independent 32-bit hashes of
(flat index in the full HF tensor, the element's bits). Sums decompose over any partition of the
elements, so each TP rank sums its own shard (with global indices) and the parts add up to the
digest of the full tensor: the engine's fused, sharded weights and the trainer's plain tensors give
the same fingerprint exactly when every element is bit-identical (a difference goes unnoticed with
probability about 2**-64). The fingerprint is a SHA-256 over (name, shape, dtype, digest) in name order.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Mapping

import torch

from rollout.dtypes import dtype_name

_M32 = 0xFFFFFFFF
_KEY = 0x9E3779B1
_CHUNK = 1 << 24
_SALTS = ((0x9E3779B9, 0x21F0AAAD, 0x735A2D97), (0x85EBCA6B, 0x7FEB352D, 0x846CA68B))


def _bits32(t: torch.Tensor) -> torch.Tensor:
    """Each element's raw bits folded to 32 bits, as int64 (same on every device)."""
    size = t.element_size()
    if t.dtype == torch.bool:
        return t.to(torch.int64)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    bits = t.contiguous().view(as_int).to(torch.int64)
    if size == 8:
        return (bits ^ (bits >> 32)) & _M32
    return bits & ((1 << (8 * size)) - 1)


def _digest_torch(bits: torch.Tensor, idx: torch.Tensor) -> tuple[int, int]:
    """Σ mix32((idx·K mod 2³²) ⊕ salt ⊕ bits) for two salts, in int64 arithmetic (any device)."""
    key = (idx * _KEY) & _M32
    out = []
    for salt, m1, m2 in _SALTS:
        x = key ^ salt ^ bits
        x = x ^ (x >> 16)
        x = (x * m1) & _M32
        x = x ^ (x >> 15)
        x = (x * m2) & _M32
        x = x ^ (x >> 15)
        out.append(int(x.sum().item()))
    return out[0], out[1]


def _digest_numpy(part: torch.Tensor, row0: int, row_stride: int, offset: int) -> tuple[int, int]:
    """The same sums as the torch path with native uint32 arithmetic (several times faster on CPU)."""
    import numpy as np

    rows, cols = part.shape
    size = part.element_size()
    if part.dtype == torch.bool or size == 8:
        b = _bits32(part).numpy().astype(np.uint32)
    else:
        as_int = {1: np.uint8, 2: np.uint16, 4: np.uint32}[size]
        # a copy: a numpy view would pin the size of the weights' storage (the CPU memory saver resizes it)
        b = part.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[size]).clone().numpy().view(as_int)
        b = b.astype(np.uint32, copy=size != 4)
    starts = (np.arange(row0, row0 + rows, dtype=np.uint64) * np.uint64(row_stride) + np.uint64(offset))
    idx = (starts.astype(np.uint32)[:, None] + np.arange(cols, dtype=np.uint32)[None, :])
    key = idx * np.uint32(_KEY)
    out = []
    for salt, m1, m2 in _SALTS:
        x = key ^ np.uint32(salt)
        x ^= b
        x ^= x >> np.uint32(16)
        x *= np.uint32(m1)
        x ^= x >> np.uint32(15)
        x *= np.uint32(m2)
        x ^= x >> np.uint32(15)
        out.append(int(x.sum(dtype=np.uint64)))
    return out[0], out[1]


def partial_digest(view: torch.Tensor, full_shape: tuple[int, ...], dim: int | None, start: int,
                   use_numpy: bool | None = None) -> tuple[int, int]:
    """Digest contribution of ``view`` = ``full.narrow(dim, start, view.shape[dim])`` (dim None: all of it)."""
    full_shape = tuple(full_shape)
    if dim is None or view.dim() == 0:
        view, full_shape, dim, start = view.reshape(-1), (view.numel(),), 0, 0
    use_numpy = view.device.type == "cpu" if use_numpy is None else use_numpy
    outer = _prod(full_shape[:dim])
    inner = _prod(full_shape[dim + 1:])
    length = view.shape[dim]
    width = length * inner
    block = view.reshape(outer, width)
    row_stride = full_shape[dim] * inner
    step, col_step = max(1, _CHUNK // max(1, width)), max(1, min(width, _CHUNK))  # parts of ≤ _CHUNK elements
    cols = torch.arange(col_step, device=view.device, dtype=torch.int64)
    sums = [0, 0]
    for o in range(0, outer, step):
        for c in range(0, width, col_step):
            part = block[o:o + step, c:c + col_step]
            offset = start * inner + c
            if use_numpy:
                s1, s2 = _digest_numpy(part, o, row_stride, offset)
            else:
                rows = torch.arange(o, o + part.shape[0], device=view.device, dtype=torch.int64)
                idx = ((rows[:, None] * row_stride + offset) & _M32) + cols[None, :part.shape[1]]
                s1, s2 = _digest_torch(_bits32(part).reshape(-1), idx.reshape(-1))
            sums[0] += s1
            sums[1] += s2
    return sums[0], sums[1]


def _prod(xs: tuple[int, ...]) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def combine(entries: Iterable[tuple[str, tuple[int, ...], str, int, int]]) -> str:
    """SHA-256 hex over (name, shape, dtype, digest) entries, sorted by name."""
    sha = hashlib.sha256()
    for name, shape, dtype, s1, s2 in sorted(entries):
        sha.update(f"{name}|{list(shape)}|{dtype}|{s1 & (2**64 - 1):016x}{s2 & (2**64 - 1):016x}\n".encode())
    return sha.hexdigest()


def fingerprint(model_or_tensors: Any, dtype: torch.dtype | str | None = None,
                names: Iterable[str] | None = None, quantization: str | None = None) -> str:
    """The fingerprint of a trainer-side model (its ``named_parameters``) or of ``(name, tensor)`` pairs.

    ``dtype`` casts each tensor first (pass the engine's dtype when the trainer keeps float32 master
    weights and the engine serves bfloat16). ``names`` restricts the set (default: all parameters).
    Buffers the engine computes itself (a rotary ``inv_freq`` in a ``state_dict``) are left out, as the
    engine stores none.
    ``quantization`` is the engine's (``"fp8"``): the weights it stores quantized enter as the fp8
    values and row scales the engine computes from them (``rollout.layers.quantization``). Expert
    parameters of MoE models may come in any naming (per expert, transformers 5's fused tensors, Mixtral's).
    """
    from rollout.weights.weight_map import HFWeightMap

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    tensors = [(n, t) for n, t in _named_tensors(model_or_tensors) if not HFWeightMap.is_ignored(n)]
    wanted = set(names) if names is not None else None
    entries = []
    with torch.no_grad():
        for name, tensor in tensors:
            if wanted is not None and name not in wanted:
                continue
            t = tensor.detach()
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            if dtype is not None:
                t = t.to(dtype)
            for entry_name, entry in _stored_tensors_of(name, t, quantization):
                s1, s2 = partial_digest(entry, tuple(entry.shape), None, 0)
                entries.append((entry_name, tuple(entry.shape), dtype_name(entry.dtype), s1, s2))
    return combine(entries)


def _stored_tensors_of(name: str, t: torch.Tensor, quantization: str | None) -> list[tuple[str, torch.Tensor]]:
    """The fingerprint entries of one trainer tensor: expert parameters in the one naming the engine uses
    (``expert_names.fingerprint_entries``; a fused tensor as its experts' slices), each as stored."""
    from rollout.weights.expert_names import fingerprint_entries

    return [stored for entry in fingerprint_entries(name, t) for stored in _stored_tensors(*entry, quantization)]


def _stored_tensors(name: str, t: torch.Tensor, quantization: str | None) -> list[tuple[str, torch.Tensor]]:
    """What an engine with ``quantization`` stores for HF tensor ``name``: itself, or fp8 values + scales."""
    if quantization is None:
        return [(name, t)]
    from rollout.layers.quantization import is_quantized_weight, quantize_fp8_rows, scale_name

    if quantization != "fp8":
        raise ValueError(f"unknown quantization {quantization!r}")
    if not is_quantized_weight(name):
        return [(name, t)]
    q, scale = quantize_fp8_rows(t)
    return [(name, q), (scale_name(name), scale)]


def _named_tensors(obj: Any) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a model's ``named_parameters`` (under the engine's names: the components of a
    DDP, DeepSpeed, ``torch.compile`` or activation-checkpointing wrapper dropped), a mapping or pairs. A tied
    ``lm_head.weight`` that is another name of the embedding (the same elements of the same storage, as in a tied
    model's ``state_dict``) counts once, as ``named_parameters`` counts a tied parameter once and the engine stores
    it once. Any other names count each, even over one tensor (a trainer's dict giving several norms one tensor,
    or ``expand``ed views of one value): the engine stores a parameter per name."""
    if hasattr(obj, "named_parameters"):
        from rollout.weights.wrapper_names import hf_named_parameters

        return hf_named_parameters(obj)
    pairs = list(obj.items()) if isinstance(obj, Mapping) else list(obj)
    seen: dict[tuple, str] = {}
    out = []
    for name, t in pairs:
        key = _alias_key(t)
        if key is not None and _tied_names(name, seen.get(key)):
            continue
        if key is not None:
            seen.setdefault(key, name)
        out.append((name, t))
    return out


def _tied_names(name: str, earlier: str | None) -> bool:
    """``name`` and ``earlier`` are the tied head and embedding (in either order): one parameter's two names."""
    from rollout.weights.weight_map import TIED_EMBEDDING, TIED_HEAD

    return {name, earlier} == {TIED_HEAD, TIED_EMBEDDING}


def _alias_key(t: Any) -> tuple | None:
    """What makes two tensors the same elements (None when that cannot be told: no storage). A DTensor (an FSDP2
    ``state_dict`` gives a tied head and embedding as two DTensor objects over one local shard) is keyed by its
    local shard, even an empty one (FSDP2 pads every rank's shard), its placements and its global shape, so every
    rank counts the same tensors (each counted one is a ``full_tensor()`` collective)."""
    try:
        if hasattr(t, "full_tensor"):
            local = _storage_key(t.to_local())
            return None if local is None else ("dtensor", local, tuple(t.placements), tuple(t.shape))
        return None if t.numel() == 0 else _storage_key(t)
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


def _storage_key(t: torch.Tensor) -> tuple | None:
    """Where ``t``'s elements live: its storage, offset, shape, strides and dtype (None without a storage)."""
    if t.is_meta or t.layout != torch.strided or t.untyped_storage().nbytes() == 0:
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def combine_fingerprint(parts_per_rank: list[list[tuple[str, Any, str, int, int]]],
                        shapes: dict[str, tuple[int, ...]]) -> str:
    """An engine's fingerprint from its TP ranks' partial digests (``WeightUpdater.fingerprint_parts``):
    each distinct shard counted once, in HF naming and layout."""
    sums: dict[str, list] = {}
    seen: set[tuple[str, Any]] = set()
    for parts in parts_per_rank:
        for name, shard, dtype, s1, s2 in parts:
            if (name, shard) in seen:
                continue
            seen.add((name, shard))
            entry = sums.setdefault(name, [dtype, 0, 0])
            entry[1] += s1
            entry[2] += s2
    return combine((name, shapes[name], d, a, b) for name, (d, a, b) in sums.items())
