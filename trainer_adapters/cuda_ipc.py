"""Colocated trainer and engine on the same GPU: weights shared by CUDA IPC handle (OpenRLHF's
``update_weight_cuda_ipc`` path), no NCCL group and no copy through the host.

Each trainer rank puts a copy of the (gathered) tensor on its own GPU and shares it with
``reduce_tensor``; the handles are all-gathered into ``{GPU UUID: handle}``, the sending rank passes
that dict to every engine, and each engine opens the handle of the GPU it runs on.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist


def get_physical_gpu_id(device: Any = None) -> str:
    """The UUID of a CUDA device (default: the current one), the key OpenRLHF uses for IPC handles."""
    index = torch.device(device).index if device is not None else None
    if index is None:
        index = torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def ipc_handles(tensor: torch.Tensor, group: Any = None) -> dict[str, Any]:
    """``{GPU UUID: reduce_tensor(tensor)}`` over every trainer rank (an all-gather when distributed).
    Keep ``tensor`` alive until the engines have loaded it."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not tensor.is_cuda:
        raise ValueError("CUDA IPC needs a CUDA tensor")
    mine = {get_physical_gpu_id(tensor.device): reduce_tensor(tensor)}
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return mine
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    merged: dict[str, Any] = {}
    for part in everyone:
        merged.update(part)
    return merged


def push_cuda_ipc(model: Any, engines: Sequence[Any] | None, *, dtype: torch.dtype | None = None,
                  backend: str = "auto", src_rank: int = 0, timeout: float | None = None) -> dict[str, Any] | None:
    """Push every parameter to colocated engines by CUDA IPC, one ``update_weight_cuda_ipc`` call per
    tensor (the last one completes the update). Call on every trainer rank; returns {tensors, bytes,
    seconds} on ``src_rank``, None elsewhere. Each rank's copy lives on its current CUDA device.

    When an engine refuses a tensor, ``src_rank`` waits for its calls in flight, stops sending and still runs
    every remaining gather, handle all-gather and barrier (the other ranks' collectives stay matched, so they
    finish their push instead of hanging), then raises the first error; the engine, left with a partial
    update, refuses requests until a complete one lands."""
    import time

    from trainer_adapters.handles import as_engine
    from trainer_adapters.senders import param_source

    source = param_source(model, backend)
    rank = dist.get_rank() if dist.is_initialized() else 0
    handles = [as_engine(e) for e in engines or []]
    if rank == src_rank and not handles:
        raise ValueError("the sending rank needs the engines")
    plan = source.plan("per_tensor", 0, dtype)
    start, nbytes, error = time.perf_counter(), 0, None
    device = _cuda_device()
    for k, bucket in enumerate(source.gathered(plan)):
        (name, full), = bucket
        weight = full.to(device=device, dtype=dtype or full.dtype).clone()
        shared = ipc_handles(weight)  # an all-gather: every rank, every tensor, failed or not
        if rank == src_rank and error is None:
            try:
                _send_ipc(handles, name, weight, shared, k == len(plan) - 1, timeout)
                nbytes += weight.numel() * weight.element_size()
            except Exception as e:  # noqa: BLE001 - raised once every rank's collectives are done
                error = e
        if dist.is_initialized():
            dist.barrier()  # the other ranks keep their copies alive until the engines have loaded them
        torch.cuda.synchronize()
        del weight, shared
    if error is not None:
        raise error
    if rank != src_rank:
        return None
    return {"tensors": len(plan), "bytes": nbytes, "seconds": time.perf_counter() - start}


def _cuda_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _send_ipc(handles: list[Any], name: str, weight: torch.Tensor, shared: dict[str, Any], last: bool,
              timeout: float | None) -> None:
    """One tensor to every engine; after a failure, the other engines' calls are awaited before it is raised
    (they read ``weight``, which the caller frees next)."""
    futures: list[Any] = []
    try:
        for e in handles:
            futures.append(e.update_weight_cuda_ipc(name, weight.dtype, list(weight.shape), shared,
                                                    empty_cache=last, async_op=True))
        for f in futures:
            f.result(timeout)
    except BaseException:
        _settle(futures, timeout)
        raise


def _settle(futures: list[Any], timeout: float | None) -> None:
    """Wait for engine calls still running after a failure (their own errors are the engine's report)."""
    for f in {id(f): f for f in futures}.values():
        try:
            f.result(timeout)
        except Exception:  # noqa: BLE001 - the first failure is the one raised
            pass


def push_colocated(model: Any, engines: Sequence[Any] | None, *, bucket_bytes: int | None = None,
                   dtype: torch.dtype | None = None, backend: str = "auto", weight_version: str | None = None,
                   timeout: float | None = None) -> dict[str, Any] | None:
    """Push every parameter into engines on this rank's GPU with ``update_weights_from_tensor`` (SGLang's
    and verl's colocated path): one call per bucket of gathered full tensors, shared by CUDA IPC handle
    (through one shared-memory buffer on CPU).

    Call on every trainer rank (the gathers of a sharded model are collective), each with the engines
    colocated with it (none on ranks without one). ``bucket_bytes=None`` sends the whole model in one
    call when its parameters are already full (a plain module: nothing is gathered or copied, the
    engines read the trainer's own tensors); sharded models (FSDP2, ZeRO-3) are gathered bucket by
    bucket (default 1 GiB). FSDP2 gathers and sends the next bucket while the engines load the current one
    (two gathered buckets alive at a time, so the engines never wait for the trainer between buckets); ZeRO-3
    holds one (its gather ends when the iteration moves on). The last call completes the update (cache
    flush, version bump). Returns {tensors, buckets, bytes, seconds, results} where engines were given, None
    elsewhere. When an engine call fails, this rank waits for its calls in flight, gathers the remaining
    buckets without sending them (the other ranks' collectives stay matched, so they finish their push
    instead of hanging) and raises the first error; the engine, left with a partial update, refuses
    requests until a complete one lands.
    """
    import time

    from trainer_adapters.handles import as_engine
    from trainer_adapters.senders import param_source
    from weight_sync.sender import DEFAULT_BUCKET_BYTES

    source = param_source(model, backend)
    handles = [as_engine(e) for e in engines or []]
    whole = bucket_bytes is None and source.kind == "module"
    plan = [list(range(len(source.params)))] if whole else source.plan(
        "bucket", DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes, dtype)
    start, nbytes, results = time.perf_counter(), 0, []
    buckets = source.gathered(plan)
    pending = futures = None
    try:
        bucket = next(buckets)
        for k in range(len(plan)):
            if dtype is not None:
                bucket = [(n, t.to(dtype)) for n, t in bucket]
            last = k == len(plan) - 1
            futures = [e.update_weights_from_tensor(bucket, flush_cache=last, async_op=True,
                                                    weight_version=weight_version if last else None)
                       for e in handles]
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            # where the source's buckets outlive one more step of the iteration, the engines always have the
            # next bucket queued: bucket k+1 is gathered (into bucket k-1's memory, once the engines are done
            # with it) and sent while they load bucket k; else the next gather waits until they are done. The
            # last next() ends the iteration on every rank (a ZeRO-3 gather context is left collectively)
            if source.owns_buckets:
                if pending is not None:
                    results.append([f.result(timeout) for f in pending])
                pending = futures
            else:
                results.append([f.result(timeout) for f in futures])
            bucket = next(buckets, None)
        if pending is not None:
            results.append([f.result(timeout) for f in pending])
    except BaseException:
        _settle((pending or []) + (futures or []), timeout)  # no gather may reuse memory an engine still reads
        raise
    finally:
        for _ in buckets:  # after a failure, keep gathering so the other ranks' collectives are matched
            pass
    if not handles:
        return None
    return {"tensors": len(source.params), "buckets": len(plan), "bytes": nbytes,
            "seconds": time.perf_counter() - start, "results": results}
