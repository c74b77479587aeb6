"""Trainer side of a weight push: plan flat buckets, announce them to every engine, broadcast, collect acks.

An *engine handle* is anything with the engine's update calls that return a future (an in-process
``rollout.Engine`` with ``async_op=True``, the HTTP client in ``rollout.client``, or a Ray actor
wrapped by ``trainer_adapters``): ``update_weights_from_distributed(..., async_op=True)`` and
``update_weight(..., async_op=True)`` returning objects with ``.result(timeout)``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from rollout.dtypes import dtype_name

DEFAULT_BUCKET_BYTES = 1 << 30


@dataclass
class SyncReport:
    """What a push did and how fast: ``gbps`` is payload bytes / wall time (GB/s, 1e9)."""

    mode: str
    num_tensors: int
    num_buckets: int
    bytes: int
    seconds: float
    weight_version: str | None
    engine_results: list[Any] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9

    def summary(self) -> str:
        return (f"{self.mode}: {self.num_tensors} tensors in {self.num_buckets} bucket(s), "
                f"{self.bytes / 1e6:.1f} MB in {self.seconds:.3f} s = {self.gbps:.2f} GB/s")


def plan_buckets(named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of at most ``bucket_bytes`` each (a larger tensor gets its own)."""
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if current and size + n > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, t))
        size += n
    if current:
        buckets.append(current)
    return buckets


class WeightSender:
    """Pushes ``(name, tensor)`` pairs from trainer rank 0 into engines that joined ``group``.

    ``mode="bucket"`` (default) sends flat buckets of about ``bucket_bytes`` with SGLang's
    ``flattened_bucket`` layout, announcing each bucket to every engine without waiting, so the
    broadcasts run back to back; ``mode="per_tensor"`` follows OpenRLHF: one ``update_weight`` call and
    one broadcast per tensor. Tensors are cast to ``dtype`` (the engine's) before sending when given.
    """

    def __init__(self, engines: Sequence[Any], group: Any, group_name: str = "weight_update_group",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, mode: str = "bucket",
                 dtype: torch.dtype | None = None, timeout: float | None = None) -> None:
        if mode not in ("bucket", "per_tensor"):
            raise ValueError(f"mode must be 'bucket' or 'per_tensor', got {mode!r}")
        self.engines = list(engines)
        self.group = group
        self.group_name = group_name
        self.bucket_bytes = bucket_bytes
        self.mode = mode
        self.dtype = dtype
        self.timeout = timeout
        self._flat: torch.Tensor | None = None

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None) -> SyncReport:
        """Push every tensor; the update completes (cache flush, version bump) with the last one."""
        named = [(n, self._prepare(t)) for n, t in named_tensors]
        if not named:
            raise ValueError("nothing to send")
        buckets = plan_buckets(named, self.bucket_bytes) if self.mode == "bucket" else [[item] for item in named]
        return self.send_buckets(buckets, len(buckets), weight_version)

    def send_buckets(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], num_buckets: int,
                     weight_version: str | None = None) -> SyncReport:
        """Push buckets that are produced lazily, e.g. gathered one bucket at a time from a sharded model.

        Each bucket is consumed (flattened and broadcast, or sent tensor by tensor in ``per_tensor``
        mode) before the next one is requested, so only one gathered bucket needs to exist at a time.
        ``num_buckets`` says which bucket is the last: it completes the update (cache flush, version
        bump). In ``bucket`` mode a bucket is sent as given (plan it with ``plan_buckets``); in
        ``per_tensor`` mode its tensors go one ``update_weight`` call each.
        """
        if num_buckets < 1:
            raise ValueError("nothing to send")
        start = time.perf_counter()
        results: list[Any] = []
        pending: list[Any] = []
        count = ntensors = nbytes = 0
        for i, bucket in enumerate(buckets):
            if i >= num_buckets:
                raise ValueError(f"got more than the announced {num_buckets} buckets")
            named = [(n, self._prepare(t)) for n, t in bucket]
            if not named:
                raise ValueError(f"bucket {i} is empty")
            last = i == num_buckets - 1
            if self.mode == "bucket":
                pending.extend(self._send_bucket(named, last, weight_version))
            else:
                results.extend(self._send_tensors(named, last, weight_version))
            count += 1
            ntensors += len(named)
            nbytes += sum(t.numel() * t.element_size() for _, t in named)
        if count != num_buckets:
            raise ValueError(f"got {count} buckets, {num_buckets} were announced (the update is incomplete)")
        results.extend(f.result(self.timeout) for f in pending)
        seconds = time.perf_counter() - start
        return SyncReport(self.mode, ntensors, count, nbytes, seconds, weight_version, results)

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], last: bool, version: str | None) -> list[Any]:
        """Announce one flat bucket to every engine without waiting, then broadcast it; returns futures."""
        names = [n for n, _ in bucket]
        dtypes = [dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        pending = [engine.update_weights_from_distributed(
            names, dtypes, shapes, group_name=self.group_name, flush_cache=last,
            weight_version=version if last else None, load_format="flattened_bucket", async_op=True)
            for engine in self.engines]
        dist.broadcast(self._flatten([t for _, t in bucket]), src=0, group=self.group)
        return pending

    def _send_tensors(self, named: list[tuple[str, torch.Tensor]], last: bool, version: str | None) -> list[Any]:
        """OpenRLHF's pattern, one tensor at a time; ``last`` marks the final tensor as ``empty_cache``. With a
        ``version`` the final tensor goes as a one-tensor SGLang call that completes the update under that
        version, so no other version is ever visible (``update_weight`` takes none: it would bump first)."""
        results = []
        for i, (name, t) in enumerate(named):
            end = last and i == len(named) - 1
            futures = [self._announce_tensor(engine, name, t, end, version) for engine in self.engines]
            dist.broadcast(t, src=0, group=self.group)
            results.extend(f.result(self.timeout) for f in futures)
        return results

    def _announce_tensor(self, engine: Any, name: str, t: torch.Tensor, end: bool, version: str | None) -> Any:
        dtype, shape = dtype_name(t.dtype), list(t.shape)
        if end and version is not None:
            return engine.update_weights_from_distributed([name], [dtype], [shape], group_name=self.group_name,
                                                          flush_cache=True, weight_version=version, load_format=None,
                                                          async_op=True)
        return engine.update_weight(name, dtype, shape, empty_cache=end, async_op=True)

    def _prepare(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        if self.dtype is not None and t.dtype != self.dtype:
            t = t.to(self.dtype)
        return t.contiguous()

    def _flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Pack a bucket into a buffer reused across buckets and pushes (the broadcast is synchronous)."""
        from rollout.weights.buckets import flatten

        n = sum(t.numel() * t.element_size() for t in tensors)
        device = tensors[0].device
        if self._flat is None or self._flat.numel() < n or self._flat.device != device:
            self._flat = None
            self._flat = torch.empty(n, dtype=torch.uint8, device=device)  # buckets are about equal: rarely grows
        return flatten(tensors, out=self._flat)
