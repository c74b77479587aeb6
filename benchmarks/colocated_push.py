"""``python -m weight_sync.bench --colocated tensor|fsdp2``: the same-GPU weight push of a colocated trainer.

The trainer's tensors live on the engine's GPU; a push is ``Engine.update_weights_from_tensor`` (CUDA IPC
handles: no copy through the host, no process group). ``tensor``: plain tensors, the whole model in one call.
``fsdp2``: the trainer's model is FSDP2-sharded (one rank here), gathered bucket by bucket
(``trainer_adapters.push_colocated``), as OpenRLHF's and verl's colocated paths do. The ceiling is one
device copy of the same bytes (``dst.copy_(src)`` per tensor, into one scratch buffer); the report gives GB/s
(payload bytes per second) and checks the engine's fingerprint against the trainer's.
"""

from __future__ import annotations

import argparse
import time
from typing import Any


def run(args: argparse.Namespace, model_path: str, device: str) -> dict[str, Any]:
    import torch

    import weight_sync
    from rollout import Engine

    with Engine(model_path, dtype=args.dtype, device=device, max_total_tokens=1024, skip_tokenizer_init=True,
                load_format="auto" if args.model else "dummy") as engine:
        named = trainer_tensors(model_path, device, getattr(torch, args.dtype))
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        out: dict[str, Any] = {"bytes": nbytes, "tensors": len(named), "copy_s": _copy_ceiling(named, args.repeats)}
        if args.colocated == "tensor":
            out["push_s"], out["results"] = _push_tensors(engine, named, args.repeats)
        else:
            out["push_s"], out["results"] = _push_fsdp2(engine, named, args)
        out["fingerprint_equal"] = engine.weights_fingerprint() == weight_sync.fingerprint(named)
    return out


def report(r: dict[str, Any], mode: str) -> str:
    gb = r["bytes"] / 1e9
    copy, push = min(r["copy_s"]), min(r["push_s"][1:] or r["push_s"])
    last = r["results"][-1]
    parts = ", ".join(f"{k[:-2]} {last[k] * 1e3:.1f} ms" for k in ("validate_s", "open_s", "load_s", "flush_s")
                      if k in last) + f"; all {last['seconds'] * 1e3:.1f} ms of the push's {r['push_s'][-1] * 1e3:.1f}"
    return "\n".join([
        f"  colocated push ({mode}): {r['tensors']} tensors, {gb:.3f} GB on one GPU",
        f"  device copy of the same bytes (ceiling)    {copy * 1e3:8.2f} ms  {gb / copy:8.1f} GB/s",
        f"  update_weights_from_tensor, best of {len(r['push_s']) - 1:<2}    {push * 1e3:8.2f} ms  {gb / push:8.1f} GB/s"
        f"  {push / copy:5.2f}x the copy",
        f"  every push (the first opens the IPC handles): {', '.join(f'{t * 1e3:.1f}' for t in r['push_s'])} ms",
        f"  engine side of the last push: {parts}",
        f"  fingerprints equal after the pushes: {r['fingerprint_equal']}"])


def trainer_tensors(model_path: str, device: str, dtype: Any) -> list[tuple[str, Any]]:
    """A trainer's parameters for the model at ``model_path`` on ``device``: transformers 5's names and shapes
    (``trainer_hf_shapes``), random (std 0.02, drawn in float32 from seed 0) in ``dtype``."""
    import torch

    from rollout.config import ModelConfig
    from rollout.weights.weight_map import trainer_hf_shapes

    gen = torch.Generator(device=device).manual_seed(0)
    return [(n, (torch.randn(s, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype))
            for n, s in trainer_hf_shapes(ModelConfig.from_path(model_path)).items()]


def _sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _copy_ceiling(named: list[tuple[str, Any]], repeats: int) -> list[float]:
    import torch

    # one scratch buffer of the largest tensor's size: a second copy of a 30B MoE's 61 GB would not fit beside
    # the engine's and the trainer's
    scratch = torch.empty(max(t.numel() for _, t in named), dtype=named[0][1].dtype, device=named[0][1].device)
    dsts = [scratch[:t.numel()].view(t.shape) for _, t in named]
    times = []
    for _ in range(repeats + 1):
        _sync()
        start = time.perf_counter()
        for d, (_, s) in zip(dsts, named):
            d.copy_(s)
        _sync()
        times.append(time.perf_counter() - start)
    return times[1:]


def _push_tensors(engine: Any, named: list[tuple[str, Any]], repeats: int) -> tuple[list[float], list[Any]]:
    times, results = [], []
    for _ in range(repeats + 1):
        _sync()
        start = time.perf_counter()
        results.append(engine.update_weights_from_tensor(named))
        times.append(time.perf_counter() - start)
    return times, results


def _push_fsdp2(engine: Any, named: list[tuple[str, Any]], args: argparse.Namespace) -> tuple[list[float], list[Any]]:
    """The tensors as an FSDP2-sharded module on a one-rank group, pushed bucket by bucket."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from rollout.ipc import free_port
    from trainer_adapters import push_colocated

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    module = _module_of(named)
    for child in module.children():
        fully_shard(child)
    fully_shard(module)
    times, results = [], []
    for _ in range(args.repeats + 1):
        _sync()
        start = time.perf_counter()
        results.append(push_colocated(module, [engine], bucket_bytes=int(args.bucket_mb * (1 << 20)))["results"][-1][0])
        times.append(time.perf_counter() - start)
    return times, results


def _module_of(named: list[tuple[str, Any]]) -> Any:
    """An ``nn.Module`` whose ``named_parameters`` are ``named`` (HF names), one submodule per decoder layer."""
    import torch

    root = torch.nn.Module()
    for name, t in named:
        owner, parts = root, name.split(".")
        for part in parts[:-1]:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(parts[-1], torch.nn.Parameter(t, requires_grad=False))
    return root
