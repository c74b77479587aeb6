"""Engine side of live weight updates on one TP rank: update sessions, consistency, loading, receiving.

Contract (docs/weight_sync.md):
- Names, shapes and dtypes are checked before anything is loaded; a bad update is rejected with a
  clear ``ValueError`` and the old weights keep serving. When the sender is already committed to
  broadcasting, the bytes are still received (into scratch) so that nobody hangs.
- Tensors are received whole, checked, then copied shard by shard into place (never rebinding).
- An update *session* is the set of tensors loaded since the weights were last complete. It ends
  when every parameter has been loaded, or when the caller says so (``flush_cache=True``,
  per-tensor ``empty_cache=True``, ``flush_cache()``), or with a reload from disk. While a session is
  open, new requests are held; a transfer that fails mid-session, or a session whose trainer sends
  nothing for its group's timeout, leaves the weights *inconsistent* and generation is refused until a
  complete update (or ``rollback`` to a kept copy).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rollout.dtypes import dtype_name
from rollout.weights.buckets import TensorSpec, unflatten
from rollout.weights.weight_map import HFWeightMap, same_bits


class TransferError(RuntimeError):
    """The broadcast from the trainer failed or timed out."""


@dataclass
class WeightUpdater:
    """Update sessions and the consistency state of one TP rank's weights (``state``: "consistent",
    "updating" while a session is open, "inconsistent" after a failed or abandoned one)."""

    weight_map: HFWeightMap
    device: torch.device
    keep_copy: bool = False
    session: set[str] = field(default_factory=set)
    session_deadline: float | None = None
    session_group: str | None = None   # the group whose trainer the open session waits for
    inconsistent: str | None = None
    backup: dict[str, torch.Tensor] | None = None
    _scratch: torch.Tensor | None = None
    _accepted: tuple[TensorSpec, ...] | None = None

    @property
    def state(self) -> str:
        if self.inconsistent is not None:
            return "inconsistent"
        return "updating" if self.session else "consistent"

    # ---- checks -------------------------------------------------------------------------------

    def problems(self, specs: list[TensorSpec]) -> list[str]:
        """Why these tensors cannot be loaded (empty when they can; the last accepted list is remembered,
        since a trainer announces the same tensors every step)."""
        if tuple(specs) == self._accepted:
            return []
        out = self._problems(specs)
        self._accepted = None if out else tuple(specs)
        return out

    def _problems(self, specs: list[TensorSpec]) -> list[str]:
        out = []
        for spec in specs:
            if self.weight_map.is_ignored(spec.name):  # received with the rest, then dropped (``loadable``)
                continue
            try:
                self.weight_map.check(spec.name, spec.shape)
            except ValueError as e:
                out.append(str(e))
                continue
            if not spec.dtype.is_floating_point:
                out.append(f"wrong dtype for {spec.name!r}: {spec.dtype} is not a floating-point type")
        counts = Counter(s.name for s in specs)
        out += [f"parameter {n!r} appears more than once in one update" for n in sorted(counts) if counts[n] > 1]
        return out + self._overlaps(sorted(counts))

    def _overlaps(self, names: list[str]) -> list[str]:
        """Distinct names of one update that set the same stored parameter (a fused expert tensor beside one of
        its experts, Mixtral's two router names): whichever came last would win. The tied head and embedding are
        the one such pair accepted, as a ``state_dict`` carries both (their values are compared on arrival)."""
        wm = self.weight_map
        setters: dict[str, list[str]] = {}
        for name in names:
            if wm.full_shape(name) is not None:  # unknown names are reported already
                for target in wm.covered(name):
                    setters.setdefault(target, []).append(name)
        clashes = {tuple(sent) for sent in setters.values()
                   if len(sent) > 1 and set(wm.tied_pair(sent) or ()) != set(sent)}
        return [f"parameters {list(sent)} set the same weights in one update (send one naming of them)"
                for sent in sorted(clashes)]

    def loadable(self, tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """``tensors`` without the buffers the engine computes itself (``HFWeightMap.is_ignored``): a trainer's
        ``state_dict()`` may carry a rotary ``inv_freq``, which vLLM and SGLang skip as well."""
        return [(name, t) for name, t in tensors if not self.weight_map.is_ignored(name)]

    def holds(self, hf_name: str, tensor: torch.Tensor) -> bool:
        """This rank's stored part of ``hf_name`` has the bits of ``tensor``'s part cast to the stored dtype (loading
        it would change nothing; fp8-stored weights: never, they are requantized on load)."""
        view, spec = self.weight_map.local_view(hf_name)
        return view.dtype.itemsize > 1 and same_bits(view, spec.take(tensor).to(view.device))

    def nonfinite(self, tensors: list[tuple[str, torch.Tensor]]) -> list[str]:
        """The names whose values are not finite as the engine would store them: a value finite as sent may not
        be in the serving dtype (a bfloat16 1e5 is inf in float16), which the load's cast would make it."""
        out = []
        for name, t in tensors:
            stored = self.weight_map.stored_dtype(name)
            if stored.is_floating_point and stored.itemsize > 1 and stored != t.dtype:  # fp8 is scaled, never cast
                t = t.to(stored)
            if not bool(torch.isfinite(t).all()):
                out.append(name)
        return out

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

    def drop_scratch(self) -> None:
        """Free the receive buffer (the engine is giving its memory back: ``release_memory_occupation``); the next
        ``receive`` allocates it again."""
        self._scratch = None

    # ---- sessions -----------------------------------------------------------------------------

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy each tensor's shard into place and add it to the open session."""
        if self.keep_copy and not self.session and self.inconsistent is None:
            self.backup = {n: p.detach().to("cpu", copy=True) for n, p in self.weight_map.params.items()}
        self.weight_map.load_all(tensors)
        self.session.update(n for name, _ in tensors for n in self.weight_map.covered(name))

    def touch_deadline(self, group_name: str | None, timeout_s: float) -> None:
        """An update call just loaded tensors: an open session now expires ``timeout_s`` from now."""
        self.session_deadline = time.monotonic() + timeout_s if self.session else None
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

    def mark_inconsistent(self, reason: str, mixed: bool = True) -> None:
        """Refuse generation until a complete update; ``mixed``: some parameters of an update were loaded
        (said in the reason)."""
        loaded = len(self.session)
        mix = (f"; {loaded} of {len(self.weight_map.shapes)} parameters had been updated, so the weights are a "
               "mix of two versions") if mixed else ""
        self.inconsistent = (f"{reason}{mix}. Send a complete update (every parameter), reload from disk, or "
                             "roll back")
        self.session_deadline = None

    def discard(self, reason: str) -> None:
        """The weights' memory lost its contents (released without a copy): what an open or failed session had
        loaded is gone too, so only a complete update (every parameter) makes the weights whole again."""
        self.session.clear()
        self.mark_inconsistent(reason, mixed=False)

    def rollback(self) -> None:
        if self.backup is None:
            raise ValueError("no kept copy of the weights to roll back to (start the engine with keep_weight_copy=True)")
        for name, saved in self.backup.items():
            self.weight_map.params[name].data.copy_(saved)
        self.session.clear()
        self.inconsistent = None
        self.session_deadline = None

    # ---- verification -------------------------------------------------------------------------

    def fingerprint_parts(self) -> list[tuple[str, Any, str, int, int]]:
        """Partial digests of every stored tensor (fp8 weights: their values and, as
        ``scale_name(name)``, their row scales) for ``rollout.weights.fingerprint.combine_fingerprint``."""
        from rollout.layers.quantization import scale_name
        from rollout.weights.fingerprint import partial_digest

        out = []
        for name in self.weight_map.shapes:
            view, spec = self.weight_map.local_view(name)
            full = self.weight_map.shapes[name]
            s1, s2 = partial_digest(view, full, spec.dim, spec.start)
            key = self.weight_map.fingerprint_name(name)
            out.append((key, (spec.dim, spec.start, spec.length), dtype_name(view.dtype), s1, s2))
            scales = self.weight_map.local_scale_view(name)
            if scales is not None:
                sview, sspec = scales
                s1, s2 = partial_digest(sview, (full[0],), sspec.dim, sspec.start)
                out.append((scale_name(key), (sspec.dim, sspec.start, sspec.length), dtype_name(sview.dtype), s1, s2))
        return out

    def local_tensor(self, name: str) -> tuple[torch.Tensor, Any]:
        """This rank's part of ``name`` on the CPU (fp8 weights: dequantized to float32) and its shard."""
        view, spec = self.weight_map.local_view(name)
        scales = self.weight_map.local_scale_view(name)
        if scales is not None:
            from rollout.layers.quantization import dequantize_fp8_rows

            view = dequantize_fp8_rows(view, scales[0])
        return view.detach().to("cpu", copy=True), (spec.dim, spec.start, spec.length)


def assemble(parts: list[tuple[torch.Tensor, Any]], full_shape: tuple[int, ...]) -> torch.Tensor:
    """The full HF tensor from the ranks' (view, (dim, start, length)) parts (``WeightUpdater.local_tensor``)."""
    dim = parts[0][1][0]
    if dim is None:
        return parts[0][0]
    unique = {shard[1]: view for view, shard in parts}
    return torch.cat([unique[s] for s in sorted(unique)], dim=dim).reshape(full_shape)
