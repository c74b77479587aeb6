"""Offline throughput benchmark (the nano-vllm protocol): random token-id prompts, ``ignore_eos``, one timed
``Engine.generate`` call; optionally the same prompts through ``transformers`` ``generate`` as a baseline.

Command line::

    python -m rollout.bench                                   # SmolLM2-135M, 256 prompts x 1024 in / 1024 out
    python -m rollout.bench --random-range                    # lengths uniform in [100, 1024] (nano-vllm)
    python -m rollout.bench --preset llama-3.1-8b --num-prompts 256 --random-range --batch1-steps 64
    python -m rollout.bench --preset tiny --num-prompts 16 --input-len 32 --output-len 16 --hf-baseline

Besides tokens/s it reports the mean decode-step time at the steady batch size (and at batch size 1 with
``--batch1-steps``) against a memory-bandwidth floor: (weight bytes a decode step reads on one TP rank +
KV bytes read at that step) / the device-to-device copy bandwidth the bench measures itself.

``--preset NAME`` benchmarks a random-weight checkpoint with a real model's shapes (bf16 safetensors and a
synthetic word-level tokenizer), written once into ``<cache_root>/presets/NAME`` (or ``--preset-dir``); the
engine then runs with ``skip_tokenizer_init=True`` (token ids only, no detokenizer process). With ``--model``
the engine loads the model's tokenizer and detokenizes as in normal use.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from benchmarks.engine_run import run_engine
from benchmarks.hf_baseline import run_hf
from benchmarks.memory_floor import measure_copy_bandwidth, model_bytes
from benchmarks.presets import PRESET_NAMES, write_preset
from benchmarks.report import build_report, format_report
from benchmarks.workload import make_workload
from rollout.config import (ATTENTION_BACKENDS, DECODE_ATTENTION_BACKENDS, KV_CACHE_DTYPES, QUANTIZATION_METHODS,
                            ModelConfig, kv_cache_torch_dtype)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rollout.bench", description=" ".join(__doc__.split("\n\n")[0].split()))
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="local HF model dir (default: SmolLM2-135M-Instruct)")
    src.add_argument("--preset", choices=PRESET_NAMES, default=None,
                     help="benchmark a random-weight checkpoint with this model's real shapes")
    p.add_argument("--preset-dir", default=None, help="where presets are cached (default <cache>/presets)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: random weights drawn by the engine itself (vLLM's name; a preset then writes "
                        "only its config and tokenizer)")
    p.add_argument("--workload", choices=("fixed", "grpo"), default="fixed",
                   help="grpo: N samples per prompt, lognormal output lengths, prefix sharing (benchmarks/grpo.py)")
    p.add_argument("--n", type=int, default=8, help="grpo: samples per prompt")
    p.add_argument("--output-median", type=int, default=None, help="grpo: median output length (default cap / 4)")
    p.add_argument("--output-sigma", type=float, default=1.0, help="grpo: sigma of the lognormal output lengths")
    p.add_argument("--rl-steps", type=int, default=0,
                   help="grpo: K rollout steps with a weight push between them, drained and in flight")
    p.add_argument("--rl-sync", choices=("tensor", "distributed"), default="tensor",
                   help="grpo --rl-steps: push from a colocated trainer (update_weights_from_tensor) or from a "
                        "trainer process on another device (init_process_group + update_weights_from_distributed)")
    p.add_argument("--trainer-device", default=None,
                   help="grpo --rl-sync distributed: the trainer's device (default: the GPU after the engine's, "
                        "or cpu)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--random-range", action="store_true",
                   help="draw input and output lengths uniformly from [--min-len, --max-len]")
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.6, help="0 = greedy (default 0.6, as nano-vllm)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="auto: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--cuda-graph-max-bs", type=int, default=None)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV pool size in tokens (overrides --mem-fraction-static): a KV-tight setup, e.g. colocated")
    p.add_argument("--decode-balance-ratio", type=float, default=None,
                   help="engine option: cut decode requests into pieces by length at this longest/mean ratio "
                        "(default 4; 0: always; inf: never)")
    p.add_argument("--schedule-conservativeness", type=float, default=None,
                   help="KV admission's reserve for the running requests (engine default 0.3; 0: one page each)")
    p.add_argument("--disable-cascade-attn", action="store_true",
                   help="decode reads a shared prompt once per request (default: once per group, cascade decode)")
    p.add_argument("--enable-piecewise-cuda-graph", action="store_true",
                   help="engine option: extend (prefill) steps replay piecewise CUDA graphs")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=None)
    p.add_argument("--decode-attention-backend", choices=DECODE_ATTENTION_BACKENDS, default=None,
                   help="decode kernel under the flashinfer backend (default auto: triton)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                   help="KV cache storage type (default auto: the model dtype); fp8 halves the KV bytes")
    p.add_argument("--page-size", type=int, default=None,
                   help="KV slots per page (default 1; --decode-attention-backend xqa needs 16, 32, 64 or 128)")
    p.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None,
                   help="online weight quantization (fp8: W8A8 projections; default none: the model dtype)")
    p.add_argument("--enable-mixed-chunk", action="store_true", help="prefill steps also decode the running requests")
    p.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="longest prompt piece one step computes (default: the engine's, 8192)")
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="prompt tokens per extend step (default: the engine's, 16384)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="a short untimed generate first (default on)")
    p.add_argument("--batch1-steps", type=int, default=0,
                   help="also time N decode steps of one request alone (batch size 1)")
    p.add_argument("--hf-baseline", action="store_true", help="also run transformers generate on the same prompts")
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--profile", action="store_true",
                   help="record a torch.profiler trace of some of the timed run's steps (not with --rl-steps) "
                        "(Engine.start_profile) and print where their GPU time went; the run's timings include "
                        "the profiler's cost")
    p.add_argument("--profile-dir", default=None, help="where traces go (default $ROLLOUT_TORCH_PROFILER_DIR or /tmp)")
    p.add_argument("--profile-start-step", type=int, default=20,
                   help="the timed run's step (prefill steps included) the trace starts at")
    p.add_argument("--profile-num-steps", type=int, default=10)
    p.add_argument("--profile-activities", default=None,
                   help="comma-separated: CPU, GPU (default both on CUDA); GPU alone adds the least host-side cost")
    p.add_argument("--profile-with-stack", action="store_true", help="record Python stacks of the host's ops")
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1 or args.hf_batch_size < 1:
        p.error("--num-prompts, --input-len, --output-len and --hf-batch-size must be >= 1")
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    if args.temperature < 0 or args.batch1_steps < 0:
        p.error("--temperature and --batch1-steps must be >= 0")
    if args.workload == "grpo" and (args.n < 1 or args.rl_steps < 0 or args.output_sigma < 0 or args.hf_baseline
                                    or (args.output_median is not None and args.output_median < 1)):
        p.error("--workload grpo needs --n >= 1, --rl-steps >= 0, --output-median >= 1, --output-sigma >= 0 and "
                "no --hf-baseline")
    if args.workload != "grpo" and (args.rl_steps or args.output_median is not None):
        p.error("--rl-steps and --output-median apply to --workload grpo only")
    if args.workload == "grpo" and (args.batch1_steps or not args.warmup):
        p.error("--workload grpo always warms up and has no batch-1 probe: no --batch1-steps or --no-warmup")
    if (args.rl_sync != "tensor" or args.trainer_device) and not (args.workload == "grpo" and args.rl_steps):
        p.error("--rl-sync and --trainer-device apply to --workload grpo --rl-steps K only")
    if args.profile and (args.rl_steps or args.profile_start_step < 0 or args.profile_num_steps < 1):
        p.error("--profile needs --profile-start-step >= 0, --profile-num-steps >= 1 and no --rl-steps")
    if args.trainer_device and args.rl_sync != "distributed":
        p.error("--trainer-device needs --rl-sync distributed")
    if args.load_format == "dummy" and (args.hf_baseline or not args.preset):
        p.error("--load-format dummy needs --preset and no --hf-baseline (transformers would load other weights)")


def _resolve_model(args: argparse.Namespace) -> str:
    if args.preset:
        return write_preset(args.preset, args.preset_dir, seed=0, weights=args.load_format != "dummy")
    if args.model:
        return args.model
    from rollout.default_model import ensure_default_model

    return ensure_default_model()


def _resolve_device(device: str | None) -> str:
    import torch

    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the table (and write ``--json``). Returns the exit code."""
    import torch

    args = parse_args(argv)
    model_path = _resolve_model(args)
    device = _resolve_device(args.device)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    if args.workload == "grpo":
        return _main_grpo(args, model_path, device, dtype)
    cfg = ModelConfig.from_path(model_path)
    length_range = (args.min_len, args.max_len) if args.random_range else None
    work = make_workload(args.num_prompts, cfg.vocab_size, args.seed, args.input_len, args.output_len, length_range)
    engine = run_engine(args, model_path, device, dtype, work)
    bandwidth = measure_copy_bandwidth(device)
    hf = (run_hf(model_path, device, dtype, work, args.temperature, args.hf_batch_size, args.warmup)
          if args.hf_baseline else None)
    model_dtype = getattr(torch, dtype)
    kv_dtype = kv_cache_torch_dtype(args.kv_cache_dtype or "auto", model_dtype)
    mb = model_bytes(cfg, args.tp_size, model_dtype.itemsize, kv_dtype.itemsize, args.quantization)
    report = build_report(args, model_path, device, dtype, work, engine, mb, bandwidth, hf)
    print(format_report(report), flush=True)
    _write_json(args.json, report)
    return 0


def _write_json(path: str | None, report: dict) -> None:
    """Write ``--json`` (when given)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2) + "\n")


def _main_grpo(args: argparse.Namespace, model_path: str, device: str, dtype: str) -> int:
    from benchmarks.engine_run import engine_options
    from benchmarks.grpo import format_grpo, run_grpo

    report = run_grpo(args, model_path, device, dtype, engine_options(args))
    print(format_grpo(report), flush=True)
    _write_json(args.json, report)
    exact = [report[m]["fingerprint_equal"] for m in ("drain", "in_flight") if m in report]
    return 0 if all(exact) else 1  # RL steps: the pushed weights must be the engine's, bit for bit


if __name__ == "__main__":
    sys.exit(main())
