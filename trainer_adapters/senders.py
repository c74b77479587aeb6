"""One call to push a trainer's weights into engines: ``broadcast_to_engines(model, engines, group)``.

Works for a plain ``nn.Module`` / ``transformers`` model, an Accelerate-prepared model (DDP or not),
FSDP2 (``fully_shard``) and DeepSpeed (ZeRO-3 gathered per bucket; ZeRO-1/2 as is). Every trainer rank
calls it (sharded models gather collectively); only ``src_rank`` (the trainer's rank 0, which joined the
weight-update group as its rank 0) talks to the engines and broadcasts. The transfer itself is
``weight_sync.WeightSender``: flat buckets by default, OpenRLHF's per-tensor calls with
``mode="per_tensor"``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from rollout.dtypes import parse_dtype
from trainer_adapters.fsdp2 import FSDP2Source, is_fsdp1, is_fsdp2
from trainer_adapters.gather import ParamSource
from trainer_adapters.handles import as_engine
from trainer_adapters.zero3 import ZeRO3Source, is_deepspeed
from weight_sync.sender import DEFAULT_BUCKET_BYTES, SyncReport, WeightSender

BACKENDS = ("auto", "module", "accelerate", "fsdp2", "deepspeed")
MODES = ("bucket", "per_tensor")


def param_source(model: Any, backend: str = "auto") -> ParamSource:
    """The gatherer for ``model``'s wrapping. ``backend`` is one of ``BACKENDS``; "auto" and "accelerate"
    detect DeepSpeed, FSDP2 or a plain module (Accelerate wraps in one of those, or in DDP)."""
    if backend not in BACKENDS:
        raise ValueError(f"unsupported trainer backend {backend!r}; supported: {', '.join(BACKENDS)}")
    if is_fsdp1(model):
        raise ValueError("FSDP1 (FullyShardedDataParallel) models are not supported: wrap the model with FSDP2 "
                         "(torch.distributed.fsdp.fully_shard) or use DeepSpeed ZeRO-3")
    detected = "deepspeed" if is_deepspeed(model) else "fsdp2" if is_fsdp2(model) else "module"
    if backend in ("auto", "accelerate"):
        backend = detected
    elif backend != detected and not (backend == "deepspeed" and detected == "module"):
        raise ValueError(f"backend={backend!r} was asked for, but the model looks like {detected!r}")
    return {"module": ParamSource, "fsdp2": FSDP2Source, "deepspeed": ZeRO3Source}[backend](model)


def broadcast_to_engines(model: Any, engines: Sequence[Any] | None, group: Any = None, *,
                         group_name: str = "weight_update_group", mode: str = "bucket",
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | str | None = None,
                         weight_version: str | None = None, backend: str = "auto", timeout: float | None = None,
                         src_rank: int = 0) -> SyncReport | None:
    """Push every parameter of ``model`` (under its Hugging Face name) into ``engines``.

    ``engines``: Ray actor handles of ``EngineActor``, ``LocalActor``s, in-process ``rollout.Engine``s or
    ``weight_sync.remote.RemoteEngine``s, all joined to ``group`` (named ``group_name``) with this
    process as rank 0. Call it on every trainer rank; ranks other than ``src_rank`` may pass
    ``engines=None, group=None``: they only take part in the gathers and get None back. ``dtype`` casts
    before sending (the engine casts to its own dtype anyway). Returns the ``SyncReport`` on ``src_rank``.
    The last bucket (or tensor) completes the update: the engines flush their prefix caches and move to
    ``weight_version`` (or the next version).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    source = param_source(model, backend)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == src_rank and (group is None or not engines):
        raise ValueError("the sending rank needs the engines and the weight-update group it joined")
    plan = source.plan(mode, bucket_bytes, dtype)
    buckets = source.gathered(plan)
    if rank != src_rank:
        for _ in buckets:
            pass
        return None
    sender = WeightSender([as_engine(e) for e in engines], group, group_name, bucket_bytes=bucket_bytes,
                          mode=mode, dtype=dtype, timeout=timeout)
    try:
        return sender.send_buckets(buckets, len(plan), weight_version)
    finally:
        for _ in buckets:  # after a failure, keep gathering so the other ranks' collectives are matched
            pass


def full_named_parameters(model: Any, backend: str = "auto") -> list[tuple[str, torch.Tensor]]:
    """Every parameter, full, under its Hugging Face name (collective when sharded: call on every rank)."""
    return list(param_source(model, backend).named_full_tensors())


def trainer_fingerprint(model: Any, dtype: torch.dtype | str | None = None, backend: str = "auto",
                        quantization: str | None = None) -> str:
    """``weight_sync.fingerprint`` of the full weights; equals the engines' ``weights_fingerprint()`` after
    a sync exactly when they hold the same weights (pass the engine's dtype and quantization).
    Collective when sharded."""
    from rollout.weights.fingerprint import fingerprint

    return fingerprint(full_named_parameters(model, backend), dtype=dtype, quantization=quantization)
