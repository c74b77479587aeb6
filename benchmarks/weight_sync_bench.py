"""``python -m weight_sync.bench``: how close a full weight push comes to the raw broadcast of its bytes.

In one run, between the same trainer process (rank 0) and the same engine: (1) raw broadcasts of the
model's bytes in buckets into a scratch buffer (the transport's ceiling), (2) the full bucketed sync
(announce, receive, shard loading, cache flush, acknowledgement), (3) OpenRLHF-style per-tensor sync.
The figure is sync time / raw time. Weights are random with the real shapes of ``--preset``.

    python -m weight_sync.bench --preset llama-3.1-8b --dtype bfloat16            # GPU: engine cuda:0, trainer cuda:1
    python -m weight_sync.bench --preset tiny --device cpu --dtype float32         # CPU, gloo
    python -m weight_sync.bench --preset llama-3.1-8b --colocated tensor          # same GPU, CUDA IPC
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import statistics
import sys
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="weight_sync.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", help="random-weight model with real shapes (see rollout.bench)")
    p.add_argument("--model", default=None, help="a local HF directory instead of a preset")
    p.add_argument("--device", default=None)
    p.add_argument("--trainer-device", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--backend", default=None, choices=("gloo", "nccl"))
    p.add_argument("--bucket-mb", type=float, default=1024.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-per-tensor", action="store_true")
    p.add_argument("--no-verify", action="store_true", help="skip the fingerprint comparison after the sync")
    p.add_argument("--json", default=None)
    p.add_argument("--colocated", default=None, choices=("tensor", "fsdp2"),
                   help="same-GPU push (update_weights_from_tensor) instead of the broadcast; see colocated_push")
    return p.parse_args(argv)


def _trainer(args: argparse.Namespace, model_path: str, device: str, backend: str, port: int, conn: Any,
             results: Any) -> None:
    try:
        results.put(_bench(args, model_path, device, backend, port, conn))
    except Exception as e:  # noqa: BLE001
        import traceback

        results.put({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})


def _sync_cuda(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _bench(args: argparse.Namespace, model_path: str, device: str, backend: str, port: int, conn: Any) -> dict:
    import torch
    import torch.distributed as dist

    import weight_sync
    from rollout.config import ModelConfig
    from rollout.weights.weight_map import trainer_hf_shapes
    from weight_sync.remote import RemoteEngine

    engine = RemoteEngine(conn)
    dtype = getattr(torch, args.dtype)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    named = [(n, torch.randn(s, generator=gen, device=device, dtype=torch.float32).to(dtype) * 0.02)
             for n, s in trainer_hf_shapes(ModelConfig.from_path(model_path)).items()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    bucket = int(args.bucket_mb * (1 << 20))
    group = weight_sync.join_engines([engine], "bench", backend=backend, tp_size=args.tp_size, port=port, timeout=600)

    chunk = min(bucket, nbytes)
    n_chunks = -(-nbytes // chunk)
    flat = torch.empty(chunk, dtype=torch.uint8, device=device)
    raw = []
    for _ in range(args.repeats + 1):  # the first run warms up the communicator
        fut = engine.benchmark_receive(chunk, n_chunks, "bench", async_op=True)
        _sync_cuda(device)
        start = time.perf_counter()
        for _ in range(n_chunks):
            dist.broadcast(flat, src=0, group=group)
        fut.result()
        raw.append(time.perf_counter() - start)
    raw = raw[1:]

    sender = weight_sync.WeightSender([engine], group, "bench", bucket_bytes=bucket, mode="bucket")
    bucketed = []
    for _ in range(args.repeats):
        _sync_cuda(device)
        rep = sender.send(named)
        bucketed.append((rep.seconds, rep.num_buckets, rep.engine_results))
    out: dict[str, Any] = {"bytes": nbytes, "tensors": len(named), "bucket_bytes": bucket, "raw_s": raw,
                           "bucket_s": [b[0] for b in bucketed], "buckets": bucketed[0][1],
                           "engine_side_s": [sum(r["seconds"] for r in b[2]) for b in bucketed],
                           "engine_breakdown": {k: sum(r.get(k, 0.0) for r in bucketed[-1][2])
                                                for k in ("validate_s", "receive_s", "load_s", "flush_s")}}
    if not args.skip_per_tensor:
        per = weight_sync.WeightSender([engine], group, "bench", mode="per_tensor")
        _sync_cuda(device)
        out["per_tensor_s"] = per.send(named).seconds
    if not args.no_verify:
        out["fingerprint_equal"] = engine.weights_fingerprint() == weight_sync.fingerprint(named)
    out["version"] = engine.get_weight_version()
    weight_sync.leave_engines([engine], group, "bench")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from rollout import Engine
    from rollout.ipc import free_port
    from weight_sync.placement import trainer_placement
    from weight_sync.remote import serve_engine

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model_path = args.model or _preset(args.preset)
    if args.colocated:
        return _colocated(args, model_path, device)
    try:
        place = trainer_placement(device, args.tp_size, args.trainer_device, args.backend)
    except ValueError as e:
        print(f"weight_sync.bench: error: {e}", file=sys.stderr)
        return 2
    backend, trainer_device = place.backend, place.device
    ctx = mp.get_context("spawn")
    port = free_port()
    print(f"weight_sync.bench: {args.model or args.preset}, {args.dtype}, engine {device} tp={args.tp_size}, "
          f"trainer {trainer_device}, {backend}, buckets {args.bucket_mb:g} MiB", flush=True)
    with Engine(model_path, tp_size=args.tp_size, dtype=args.dtype, device=device, max_total_tokens=1024,
                skip_tokenizer_init=True, load_format="auto" if args.model else "dummy") as engine:
        mine, theirs = ctx.Pipe()
        serve_engine(engine, mine)
        results = ctx.Queue()
        proc = ctx.Process(target=_trainer, args=(args, model_path, trainer_device, backend, port, theirs, results),
                           daemon=True)
        proc.start()
        r = _wait(proc, results)
        proc.join(30)
    if "error" in r:
        print(f"FAILED: {r['error']}\n{r.get('traceback', '')}")
        return 1
    report = _report(r)
    print(report["text"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in report.items() if k != "text"} | {"raw": r, "args": vars(args)}, f, indent=2)
    return 0 if r.get("fingerprint_equal", True) else 1


def _colocated(args: argparse.Namespace, model_path: str, device: str) -> int:
    from benchmarks import colocated_push

    print(f"weight_sync.bench: {args.model or args.preset}, {args.dtype}, colocated ({args.colocated}) on {device}",
          flush=True)
    r = colocated_push.run(args, model_path, device)
    print(colocated_push.report(r, args.colocated))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"raw": r, "args": vars(args)}, f, indent=2, default=str)
    return 0 if r["fingerprint_equal"] else 1


def _preset(name: str) -> str:
    """A config-only directory for ``name``: the engine starts with dummy weights, the sync replaces them."""
    import tempfile

    from benchmarks.presets import preset_config

    path = tempfile.mkdtemp(prefix=f"wsbench-{name}-")
    with open(f"{path}/config.json", "w") as f:
        json.dump(preset_config(name), f)
    return path


def _wait(proc: Any, results: Any) -> dict[str, Any]:
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            if not proc.is_alive():
                return {"error": f"the trainer exited with code {proc.exitcode}"}


def _report(r: dict[str, Any]) -> dict[str, Any]:
    gb = r["bytes"] / 1e9
    raw, sync = min(r["raw_s"]), min(r["bucket_s"])
    rows = [("raw broadcast (same bytes, same buckets)", raw), ("bucketed sync (full update)", sync)]
    if "per_tensor_s" in r:
        rows.append(("per-tensor sync (OpenRLHF style)", r["per_tensor_s"]))
    lines = [f"  {r['tensors']} tensors, {gb:.3f} GB, {r['buckets']} bucket(s)"]
    lines += [f"  {name:<42} {t:8.3f} s  {gb / t:8.2f} GB/s  {t / raw:6.2f}x raw" for name, t in rows]
    parts = ", ".join(f"{k[:-2]} {v:.3f} s" for k, v in r["engine_breakdown"].items())
    lines.append(f"  engine-side time inside the bucketed sync: {statistics.median(r['engine_side_s']):.3f} s ({parts})")
    if "fingerprint_equal" in r:
        lines.append(f"  fingerprints equal after the sync: {r['fingerprint_equal']} (weight version {r['version']})")
    return {"text": "\n".join(lines), "gb": gb, "raw_s": raw, "bucket_s": sync, "ratio": sync / raw,
            "per_tensor_s": r.get("per_tensor_s")}


if __name__ == "__main__":
    sys.exit(main())
