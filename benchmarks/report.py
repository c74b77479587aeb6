"""The bench's report: everything measured as one JSON-ready dict, and the table printed from it."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from dataclasses import asdict
from typing import Any

from benchmarks.engine_run import EngineRun, StepTiming
from benchmarks.memory_floor import ModelBytes, floor_ms, run_decode_floor_s
from benchmarks.workload import RunResult, Workload


def _step_report(timing: StepTiming | None, mb: ModelBytes, bandwidth: float) -> dict[str, Any] | None:
    if timing is None:
        return None
    floor = floor_ms(mb, timing.mean_kv_tokens, bandwidth, timing.batch_size)
    return {**asdict(timing), "floor_ms": floor, "step_over_floor": timing.mean_step_ms / floor,
            "kv_bytes_read": timing.mean_kv_tokens * mb.kv_bytes_per_token,
            "weight_bytes_read": mb.bytes_read(timing.batch_size), "experts_read": mb.expected_experts(timing.batch_size)}


BATCH_BANDS = (16, 64, 128, 256, 512)  # upper ends of the decode batch-size bands; larger batches form the last


def decode_by_batch(decode_stats: dict[Any, dict[str, float]], mb: ModelBytes,
                    bandwidth: float) -> list[dict[str, Any]]:
    """The measured decode steps (``Engine.get_step_stats()["decode"]``: per batch size its steps, seconds and
    KV tokens) summed over batch-size bands: steps, seconds, and the seconds the same steps need at the
    bandwidth floor. Says which batch sizes hold the run's time above its floor (the tail's small batches,
    or the full ones). Bands without steps are left out."""
    bands: list[dict[str, Any]] = []
    lo = 1
    for hi in (*BATCH_BANDS, None):
        steps = seconds = floor_s = 0.0
        for b, s in decode_stats.items():
            b = int(b)
            if b >= lo and (hi is None or b <= hi) and s["steps"]:
                steps += s["steps"]
                seconds += s["seconds"]
                floor_s += s["steps"] * floor_ms(mb, s["kv_tokens"] / s["steps"], bandwidth, b) / 1000.0
        if steps:
            bands.append({"batch": [lo, hi], "steps": int(steps), "seconds": seconds, "floor_s": floor_s,
                          "over_floor": seconds / floor_s if floor_s else None})
        lo = (hi or 0) + 1
    return bands


def _run_floor(args: argparse.Namespace, work: Workload, engine: EngineRun, mb: ModelBytes,
               bandwidth: float) -> dict[str, Any]:
    """The whole run's decode steps at the bandwidth floor (``run_decode_floor_s``) against the measured
    decode time (elapsed minus prefill), and the output tok/s the run would reach with its measured prefill
    and every decode step at the floor."""
    from rollout.config import EngineConfig

    slots = args.max_running_requests or EngineConfig.max_running_requests
    floor_s, steps = run_decode_floor_s(mb, [len(p) for p in work.prompts], work.output_lens, bandwidth, slots)
    prefill_s = (engine.step_stats.get("prefill") or {}).get("seconds", 0.0)
    decode_s = engine.result.elapsed_s - prefill_s
    return {"decode_floor_s": floor_s, "decode_steps": steps, "decode_s": decode_s,
            "decode_over_floor": decode_s / floor_s if floor_s else None,
            "output_tok_s_at_floor": work.output_tokens / (floor_s + prefill_s) if floor_s + prefill_s else None}


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} ({os.cpu_count()} CPUs)" if names else platform.processor()
    except OSError:
        return platform.processor() or "cpu"


def build_report(args: argparse.Namespace, model_path: str, device: str, dtype: str, work: Workload,
                 engine: EngineRun, mb: ModelBytes, bandwidth: float, hf: RunResult | None) -> dict[str, Any]:
    """Everything the bench measured, as one JSON-ready dict (the printed table shows the same numbers)."""
    import torch
    import transformers

    workload = {"num_prompts": len(work.prompts), "temperature": args.temperature, "seed": args.seed,
                "input_len": None if args.random_range else args.input_len,
                "output_len": None if args.random_range else args.output_len,
                "random_range": [args.min_len, args.max_len] if args.random_range else None}
    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "model": model_path, "preset": args.preset, "device": device, "device_name": _device_name(device),
        "dtype": dtype, "kv_cache_dtype": args.kv_cache_dtype or "auto", "quantization": args.quantization,
        "page_size": args.page_size or 1,
        "tp_size": args.tp_size,
        "decode_attention_backend": args.decode_attention_backend or "auto",
        "workload": workload,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "engine": engine.result.to_dict(),
        "memory": {"copy_bandwidth_gb_s": bandwidth / 1e9, **asdict(mb), "kv_cache_tokens": engine.kv_tokens,
                   "kv_cache_gib": engine.kv_tokens * mb.kv_bytes_per_token / 2**30},
        "run_floor": _run_floor(args, work, engine, mb, bandwidth),
        "decode_by_batch": decode_by_batch(engine.step_stats.get("decode") or {}, mb, bandwidth),
        "decode_steady": _step_report(engine.steady, mb, bandwidth),
        "decode_batch1": _step_report(engine.batch1, mb, bandwidth),
        "prefill": engine.step_stats.get("prefill"),
        "mixed_steps": engine.step_stats.get("mixed_steps", 0),
        "retractions": engine.step_stats.get("retractions", 0),
        "graph_replays": engine.step_stats.get("graph_replays", {}),
        "extend_graph_replays": engine.step_stats.get("extend_graph_replays", 0),
        "hf": hf.to_dict() if hf else None,
        "engine_over_hf": engine.result.output_tok_s / hf.output_tok_s if hf else None,
    }
    return report


def format_report(r: dict[str, Any]) -> str:
    """The human-readable table of a report dict."""
    w = r["workload"]
    lens = (f"lengths uniform in [{w['random_range'][0]}, {w['random_range'][1]}]" if w["random_range"]
            else f"input {w['input_len']}, output {w['output_len']} tokens")
    lines = [f"model {r['model']} | {r['device_name']} | {r['dtype']} | weights {r.get('quantization') or r['dtype']} | "
             f"KV {r.get('kv_cache_dtype', 'auto')} | "
             f"tp {r['tp_size']} | decode attention {r.get('decode_attention_backend', 'auto')} | "
             f"page size {r.get('page_size', 1)}",
             f"workload: {w['num_prompts']} prompts, {lens}, temperature {w['temperature']}, seed {w['seed']}",
             f"{'':<22}{'engine':>14}{'hf generate':>14}"]
    e, h = r["engine"], r["hf"] or {}
    for key, label, fmt in (("num_requests", "requests", "{:.0f}"), ("input_tokens", "input tokens", "{:.0f}"),
                            ("output_tokens", "output tokens", "{:.0f}"), ("elapsed_s", "elapsed (s)", "{:.2f}"),
                            ("output_tok_s", "output tok/s", "{:.1f}"), ("total_tok_s", "total tok/s", "{:.1f}")):
        hf_val = fmt.format(h[key]) if key in h else "-"
        lines.append(f"{label:<22}{fmt.format(e[key]):>14}{hf_val:>14}")
    if r["engine_over_hf"] is not None:
        lines.append(f"engine / hf output tok/s: {r['engine_over_hf']:.2f}x  (hf batches run to their longest "
                     f"output; hf counts only each prompt's requested output tokens)")
    m = r["memory"]
    lines.append(f"copy bandwidth {m['copy_bandwidth_gb_s']:.1f} GB/s (read+write); weights read per step "
                 f"{m['weight_bytes_read'] / 1e6:.1f} MB{' + routed experts' if m['num_experts'] else ''} of {m['weight_bytes'] / 1e6:.1f} MB per rank; "
                 f"KV {m['kv_bytes_per_token']} B/token/rank")
    lines.append(f"KV cache {m['kv_cache_tokens']} tokens ({m['kv_cache_gib']:.1f} GiB per rank)")
    pre = r.get("prefill") or {}
    if pre.get("steps"):
        lines.append(f"prefill: {pre['tokens']} tokens in {pre['steps']} steps, {pre['seconds']:.2f} s "
                     f"({pre['tokens'] / max(pre['seconds'], 1e-9):.0f} tok/s; the scheduler "
                     f"{pre.get('launch_seconds', 0):.2f} s scheduling and launching them, "
                     f"{pre.get('wait_seconds', 0):.2f} s waiting for them); {r.get('mixed_steps', 0)} of them "
                     f"mixed with decode; {r.get('retractions', 0)} retractions; "
                     f"{r.get('extend_graph_replays', 0)} replayed from piecewise CUDA graphs")
    if r.get("graph_replays"):
        lines.append(f"decode steps replayed from each CUDA graph variant: {r['graph_replays']}")
    f = r.get("run_floor")
    if f and f["decode_floor_s"]:
        lines.append(f"whole run: {f['decode_s']:.2f} s besides prefill, decode floor {f['decode_floor_s']:.2f} s "
                     f"({f['decode_steps']} steps at the bandwidth floor), {f['decode_over_floor']:.2f}x; with this "
                     f"prefill and every step at the floor: {f['output_tok_s_at_floor']:.0f} output tok/s")
    bands = r.get("decode_by_batch") or []
    if bands:
        lines.append("decode by batch size: " + " | ".join(
            f"{b['batch'][0]}-{b['batch'][1] or ''}: {b['steps']} steps {b['seconds']:.2f} s"
            + (f" ({b['over_floor']:.2f}x floor)" if b["over_floor"] else "") for b in bands))
    for key in ("decode_steady", "decode_batch1"):
        s = r[key]
        if s is not None:
            lines.append(f"decode step (batch {s['batch_size']}, {s['steps']} steps, mean KV {s['mean_kv_tokens']:.0f}"
                         f" tokens): {s['mean_step_ms']:.2f} ms; bandwidth floor {s['floor_ms']:.2f} ms; "
                         f"step/floor {s['step_over_floor']:.2f}"
                         + (f"; experts read per layer {s['experts_read']:.1f} of {m['num_experts']}, weights read "
                            f"{s['weight_bytes_read'] / 1e6:.1f} MB" if m["num_experts"] else ""))
    return "\n".join(lines)
