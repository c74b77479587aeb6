"""Engine side of live weight updates, inside each scheduler (TP rank) process.

Contract (DESIGN.md §6):
- Names, shapes and dtypes are checked before anything is loaded; a bad update is rejected with a
  clear ``ValueError`` and the old weights keep serving. When the sender is already committed to
  broadcasting, the bytes are still received (into scratch) so that nobody hangs.
- Tensors are received whole, checked, then copied shard by shard into place (never rebinding).
- An update *session* is the set of tensors loaded since the weights were last complete. It ends
  when every parameter has been loaded, or when the caller says so (``flush_cache=True``,
  per-tensor ``empty_cache=True``, ``flush_cache()``), or with a reload from disk. While a session is
  open, new requests are held; a transfer that fails mid-session leaves the weights *inconsistent*
  and generation is refused until a complete update (or ``rollback_weights`` to a kept copy).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rollout.distributed import TPGroup
from rollout.models.weight_map import HFWeightMap

logger = logging.getLogger(__name__)

FLOAT_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "half": torch.float16, "float64": torch.float64}


class TransferError(RuntimeError):
    """The broadcast from the trainer failed or timed out."""


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
        return n * torch.empty((), dtype=self.dtype).element_size()


def parse_dtype(dtype: Any) -> torch.dtype:
    """A torch dtype from a torch dtype or a name such as "bfloat16" / "torch.bfloat16"."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        found = getattr(torch, dtype.replace("torch.", ""), None)
        if isinstance(found, torch.dtype):
            return found
    raise ValueError(f"unknown dtype {dtype!r}")


def parse_specs(names: Any, dtypes: Any, shapes: Any) -> list[TensorSpec]:
    """Validate the form of an update announcement (ValueError); says nothing about the model."""
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


@dataclass
class UpdateResult:
    """What one update call did."""

    loaded: int
    bytes: int
    seconds: float
    complete: bool
    weight_version: str


@dataclass
class WeightUpdater:
    """Groups, update sessions and the consistency state of one TP rank's weights."""

    weight_map: HFWeightMap
    tp: TPGroup
    device: torch.device
    keep_copy: bool = False
    groups: dict[str, Any] = field(default_factory=dict)
    group_timeouts: dict[str, float] = field(default_factory=dict)
    session: set[str] = field(default_factory=set)
    session_deadline: float | None = None
    session_group: str | None = None   # the group whose trainer the open session waits for
    inconsistent: str | None = None
    backup: dict[str, torch.Tensor] | None = None
    last_group: str | None = None
    _scratch: torch.Tensor | None = None

    @property
    def state(self) -> str:
        if self.inconsistent is not None:
            return "inconsistent"
        return "updating" if self.session else "consistent"

    # ---- groups -------------------------------------------------------------------------------

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str, timeout: float | None) -> None:
        from weight_sync.group import init_process_group

        if group_name in self.groups:
            raise ValueError(f"a weight-update group named {group_name!r} already exists; destroy it first")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend 'nccl' needs a CUDA device; use backend='gloo' on CPU")
        timeout_s = float(timeout) if timeout is not None else 600.0
        self.groups[group_name] = init_process_group(master_address, master_port, rank_offset + self.tp.rank,
                                                     world_size, group_name, backend, timeout_s)
        self.group_timeouts[group_name] = timeout_s
        self.last_group = group_name

    def destroy_group(self, group_name: str) -> None:
        from weight_sync.group import destroy_process_group

        group = self.groups.pop(group_name, None)
        if group is None:
            raise ValueError(f"no weight-update group named {group_name!r}")
        self.group_timeouts.pop(group_name, None)
        destroy_process_group(group)
        if self.last_group == group_name:
            self.last_group = next(iter(self.groups), None)

    def group(self, group_name: str | None) -> tuple[str, Any]:
        name = group_name or self.last_group
        if name is None or name not in self.groups:
            known = sorted(self.groups) or "none"
            raise ValueError(f"weight-update group {group_name!r} is not initialized (groups: {known}); "
                             "call init_process_group first")
        return name, self.groups[name]

    # ---- checks -------------------------------------------------------------------------------

    def problems(self, specs: list[TensorSpec]) -> list[str]:
        """Why these tensors cannot be loaded (empty when they can)."""
        out = []
        for spec in specs:
            try:
                self.weight_map.check(spec.name, spec.shape)
            except ValueError as e:
                out.append(str(e))
                continue
            if not spec.dtype.is_floating_point:
                out.append(f"wrong dtype for {spec.name!r}: {spec.dtype} is not a floating-point type")
        counts = Counter(s.name for s in specs)
        out += [f"parameter {n!r} appears more than once in one update" for n in sorted(counts) if counts[n] > 1]
        return out

    @staticmethod
    def nonfinite(tensors: list[tuple[str, torch.Tensor]]) -> list[str]:
        return [name for name, t in tensors if not bool(torch.isfinite(t).all())]

    # ---- receiving ----------------------------------------------------------------------------

    def receive(self, specs: list[TensorSpec], group: Any, flattened: bool) -> list[tuple[str, torch.Tensor]]:
        """Receive the announced tensors from rank 0 of ``group`` (TransferError on failure).

        The tensors are views of a reusable scratch buffer, valid until the next ``receive``.
        """
        flat = self.scratch(sum(s.nbytes for s in specs))
        try:
            if flattened:  # SGLang's flattened_bucket: every tensor's bytes back to back, one broadcast
                dist.broadcast(flat, src=0, group=group)
                return unflatten(flat, specs)
            out = unflatten(flat, specs)
            for _, buf in out:
                dist.broadcast(buf, src=0, group=group)
            return out
        except Exception as e:  # noqa: BLE001 - any communication failure
            raise TransferError(f"receiving weights failed: {type(e).__name__}: {e}") from e

    def scratch(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` on the model's device, reused across updates (fresh host
        memory costs a page fault per page; the device allocator would cache it anyway)."""
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = None
            self._scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._scratch[:nbytes]

    # ---- loading ------------------------------------------------------------------------------

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy each tensor's shard into place and add it to the open session."""
        if self.keep_copy and not self.session and self.inconsistent is None:
            self.backup = {n: p.detach().to("cpu", copy=True) for n, p in self.weight_map.params.items()}
        for name, tensor in tensors:
            self.weight_map.load(name, tensor)
            self.session.add(self.weight_map.canonical(name))

    def touch_deadline(self, group_name: str | None) -> None:
        """An update call just loaded tensors: an open session now expires one group timeout from now."""
        timeout = self.group_timeouts.get(group_name or "", 600.0)
        self.session_deadline = time.monotonic() + timeout if self.session else None
        self.session_group = group_name if self.session else None

    def session_expired(self) -> bool:
        """An open session's trainer sent nothing for its group timeout (rank 0 decides; see
        ``ExpireUpdateSession``)."""
        return self.session_deadline is not None and time.monotonic() > self.session_deadline

    @property
    def covers_all(self) -> bool:
        return self.session >= set(self.weight_map.shapes)

    def end_session(self, explicit: bool) -> bool:
        """Close the session if it is complete (all parameters) or, when consistent, if asked to."""
        if not self.session:
            return False
        if self.covers_all or (explicit and self.inconsistent is None):
            self.session.clear()
            self.inconsistent = None
            self.session_deadline = None
            return True
        return False

    def mark_inconsistent(self, reason: str) -> None:
        loaded = len(self.session)
        self.inconsistent = (f"{reason}; {loaded} of {len(self.weight_map.shapes)} parameters had been updated, so "
                             "the weights are a mix of two versions. Send a complete update (every parameter), "
                             "reload from disk, or roll back")
        self.session_deadline = None

    def rollback(self) -> None:
        if self.backup is None:
            raise ValueError("no kept copy of the weights to roll back to (start the engine with keep_weight_copy=True)")
        for name, saved in self.backup.items():
            self.weight_map.params[name].data.copy_(saved)
        self.session.clear()
        self.inconsistent = None
        self.session_deadline = None

    # ---- verification -------------------------------------------------------------------------

    def local_views(self) -> list[tuple[str, torch.Tensor, Any]]:
        """(HF name, this rank's view, ShardSpec) for every parameter."""
        return [(name, *self.weight_map.local_view(name)) for name in self.weight_map.shapes]

    def fingerprint_parts(self) -> list[tuple[str, Any, str, int, int]]:
        """Partial digests of every stored tensor (fp8 weights: their values and, as
        ``scale_name(name)``, their row scales) for ``combine_fingerprint``."""
        from rollout.layers.quantization import scale_name
        from weight_sync.fingerprint import dtype_name, partial_digest

        out = []
        for name, view, spec in self.local_views():
            full = self.weight_map.shapes[name]
            s1, s2 = partial_digest(view, full, spec.dim, spec.start)
            out.append((name, (spec.dim, spec.start, spec.length), dtype_name(view.dtype), s1, s2))
            scales = self.weight_map.local_scale_view(name)
            if scales is not None:
                sview, sspec = scales
                s1, s2 = partial_digest(sview, (full[0],), sspec.dim, sspec.start)
                out.append((scale_name(name), (sspec.dim, sspec.start, sspec.length), dtype_name(sview.dtype), s1, s2))
        return out

    def local_tensor(self, name: str) -> tuple[torch.Tensor, Any]:
        """This rank's part of ``name`` on the CPU (fp8 weights: dequantized to float32) and its shard."""
        view, spec = self.weight_map.local_view(name)
        scales = self.weight_map.local_scale_view(name)
        if scales is not None:
            from rollout.layers.quantization import dequantize_fp8_rows

            view = dequantize_fp8_rows(view, scales[0])
        return view.detach().to("cpu", copy=True), (spec.dim, spec.start, spec.length)


def unflatten(flat: torch.Tensor, specs: list[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """Views of a uint8 buffer laid out as SGLang's FlattenedTensorBucket, one per named tensor."""
    out, offset = [], 0
    for spec in specs:
        n = spec.nbytes
        part = flat[offset:offset + n]
        if offset % torch.empty((), dtype=spec.dtype).element_size():
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


def combine_fingerprint(parts_per_rank: list[list[tuple[str, Any, str, int, int]]],
                        shapes: dict[str, tuple[int, ...]]) -> str:
    """Merge the ranks' partial digests (each distinct shard once) into the HF-layout fingerprint."""
    from weight_sync.fingerprint import combine

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


def assemble(parts: list[tuple[torch.Tensor, Any]], full_shape: tuple[int, ...]) -> torch.Tensor:
    """The full HF tensor from the ranks' (view, (dim, start, length)) parts."""
    dim = parts[0][1][0]
    if dim is None:
        return parts[0][0]
    unique = {shard[1]: view for view, shard in parts}
    return torch.cat([unique[s] for s in sorted(unique)], dim=dim).reshape(full_shape)

