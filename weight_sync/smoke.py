"""``rollout-smoke``: an end-to-end check of an installation's rollout + live weight sync.

Starts the engine, starts a separate trainer process holding the same checkpoint in transformers,
rolls out a batch, lets the trainer take a real optimizer step on it, syncs the new weights, rolls out
again and checks: fingerprints equal, greedy outputs equal transformers' on the new weights, logprob
parity (of both rollouts), weight versions. Exit status 0 only if every check passed.

    rollout-smoke [--model DIR] [--tp-size N] [--backend gloo|nccl] [--mode bucket|per-tensor|disk|tensor]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import sys
import time
from typing import Any

from rollout.ipc import free_port

MODES = ("bucket", "per-tensor", "disk", "tensor")
SHARED_GPU_MEM_FRACTION = 0.5  # the engine's share of a GPU it shares with the trainer (weights + KV cache)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollout-smoke", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument("--tp-size", type=_at_least(1), default=1)
    p.add_argument("--device", default=None, help="engine device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--backend", default=None, choices=("gloo", "nccl"), help="default: nccl on GPU, gloo on CPU")
    p.add_argument("--mode", default="bucket", choices=MODES)
    p.add_argument("--bucket-mb", type=_positive_float, default=1024.0)
    p.add_argument("--trainer-device", default=None,
                   help="default: the GPU after the engine's; else the engine's first GPU, over gloo (NCCL cannot "
                        "put two ranks on one GPU), with the engine at half the GPU's memory")
    p.add_argument("--num-prompts", type=_at_least(1), default=8)
    p.add_argument("--max-new-tokens", type=_at_least(1), default=32)
    p.add_argument("--lr", type=_positive_float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logprob-tol", type=_positive_float, default=None,
                   help="max |Δlogprob| and greedy near-tie gap allowed (default: 1e-4 for float32; for 16-bit dtypes "
                        "0.1, or twice transformers' own 16-bit error against float32 on the same tokens if larger)")
    return p.parse_args(argv)


def _at_least(lo: int) -> Any:
    """An argparse type: an int >= ``lo`` (a bad value is a usage error, exit 2, not a failed smoke run)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from rollout import Engine
    from rollout.config import EngineConfig, ModelConfig
    from rollout.default_model import ensure_default_model
    from rollout.launcher import check_devices
    from weight_sync.placement import trainer_placement
    from weight_sync.remote import serve_engine
    from weight_sync.smoke_trainer import SmokeConfig, run

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        place = trainer_placement(device, args.tp_size, args.trainer_device, args.backend)
        check_devices(EngineConfig(model_path="", tp_size=args.tp_size, dtype=args.dtype, device=device))
    except (ValueError, RuntimeError) as e:  # RuntimeError: torch.device's, for a string that names no device
        print(f"rollout-smoke: error: {e}", file=sys.stderr)
        return 2
    model = args.model or ensure_default_model()
    backend, trainer_device = place.backend, place.device
    try:
        moe = ModelConfig.from_path(model).is_moe  # compare with the engine's routing replayed (docs/moe.md)
    except ValueError as e:  # no config.json, an architecture the engine does not serve
        print(f"rollout-smoke: error: --model {model}: {e}", file=sys.stderr)
        return 2
    cfg = SmokeConfig(model, args.mode, args.bucket_mb, args.dtype, trainer_device, backend, free_port(),
                      args.tp_size, args.num_prompts, args.max_new_tokens, args.lr, args.seed, replay_routing=moe)
    ctx = mp.get_context("spawn")
    started = time.perf_counter()
    # a trainer on the engine's GPU needs room for its model, gradients and optimizer state
    memory = {"mem_fraction_static": SHARED_GPU_MEM_FRACTION} if place.shares_engine_gpu else {}
    with Engine(model, tp_size=args.tp_size, dtype=args.dtype, device=device, enable_return_routed_experts=moe,
                **memory) as engine:
        mine, theirs = ctx.Pipe()
        serve_engine(engine, mine)
        results = ctx.Queue()
        trainer = ctx.Process(target=run, args=(cfg, theirs, results), daemon=True, name="rollout-smoke-trainer")
        trainer.start()
        report = _wait(trainer, results)
        trainer.join(30)
    report["total_seconds"] = time.perf_counter() - started
    if place.shares_engine_gpu:
        print(f"rollout-smoke: no GPU after the engine's, so the trainer shares {trainer_device} and the weights go "
              f"over {backend} (NCCL cannot put two ranks on one GPU); the engine took {SHARED_GPU_MEM_FRACTION:g} "
              "of the GPU's memory")
    return _print_report(args, engine.model_config.architecture, device, backend, trainer_device, report)




def _wait(trainer: Any, results: Any) -> dict[str, Any]:
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            if not trainer.is_alive():
                return {"error": f"the trainer process exited with code {trainer.exitcode}"}


def _print_report(args: argparse.Namespace, arch: str, device: str, backend: str, trainer_device: str,
                  r: dict[str, Any]) -> int:
    print(f"rollout-smoke: {args.model or 'SmolLM2-135M-Instruct'} ({arch}), tp={args.tp_size}, engine on {device}, "
          f"trainer on {trainer_device}, dtype={args.dtype}, mode={args.mode}, backend={backend}")
    if "error" in r:
        print(f"  [FAIL] the smoke test could not run: {r['error']}\n{r.get('traceback', '')}")
        return 1
    r1, s = r["rollout1"], r["sync"]
    print(f"  rollout 1: {r1['sequences']} sequences, {r1['tokens']} tokens in {r1['seconds']:.2f} s, "
          f"weight version {r1['version']}; logprob parity max |Δ| {r['parity_before']['max']:.2e}")
    print(f"  trainer step: loss {r['loss']:.3f}, weights changed: {r['weights_changed']}")
    print(f"  sync ({s['mode']}): {s['tensors']} tensors in {s['buckets']} bucket(s), {s['bytes'] / 1e6:.1f} MB "
          f"in {s['seconds']:.3f} s = {s['gbps']:.2f} GB/s")
    before, after = r["parity_before"], r["parity_after"]
    tol_before, tol_before_note = logprob_tolerance(args.logprob_tol, args.dtype, before)
    tol, tol_note = logprob_tolerance(args.logprob_tol, args.dtype, after)
    checks = [
        ("logprob parity before sync", before["max"] <= tol_before,
         f"max |Δ| {before['max']:.2e} over {before['tokens']} tokens of rollout 1 ({tol_before_note})"
         + _routing_note(before)),
        ("weights changed by training", r["weights_changed"], ""),
        ("fingerprints equal", r["fp_engine"] == r["fp_trainer"],
         f"engine {r['fp_engine'][:12]}, trainer {r['fp_trainer'][:12]}"),
        ("greedy == transformers", r["greedy_equal"] == r["greedy_total"]
         or (r["greedy_max_gap"] <= tol and not r["greedy_cut_short"]),
         f"{r['greedy_equal']}/{r['greedy_total']} prompts identical; every engine token is transformers' "
         f"argmax within {r['greedy_max_gap']:.1e} (a divergence only at a near-tie below tol passes)"
         + (f"; {r['greedy_cut_short']} stopped early (a prefix of transformers' output, no stop token)"
            if r["greedy_cut_short"] else "")),
        ("logprob parity", after["max"] <= tol,
         f"max |Δ| {after['max']:.2e}, mean {after['mean']:.2e} over {after['tokens']} tokens ({tol_note})"
         + _routing_note(after)),
        ("weight version", r["version_after"] != r["version_before"] and r["output_versions"] == [r["version_after"]],
         f"{r['version_before']} -> {r['version_after']}; outputs carry {r['output_versions']}"),
    ]
    for name, ok, detail in checks:
        print(f"  [{'PASS' if ok else 'FAIL'}] {name:<28} {detail}")
    print(f"  answer after the update: {r['sample_answer'][:70]!r}")
    passed = all(ok for _, ok, _ in checks)
    print(f"{'OK: all checks passed' if passed else 'FAILED'} ({r['total_seconds']:.1f} s)")
    return 0 if passed else 1


def logprob_tolerance(given: float | None, dtype: str, parity: dict[str, Any]) -> tuple[float, str]:
    """The logprob and greedy-gap tolerance and how it was set: ``given`` (``--logprob-tol``) as it is;
    float32 1e-4; 16-bit 0.1, or twice transformers' own 16-bit error against float32 on the same tokens
    (``parity["ref_max"]``) where that is larger. Two 16-bit implementations of one model differ by up to
    the sum of their roundings, which grow with the logits' size (large models, random tiny ones), so a
    fixed bound alone fails correct engines there; the engine's distance from float32 is printed beside."""
    if given is not None:
        return given, f"tol {given:g}"
    if dtype == "float32":
        return 1e-4, "tol 0.0001"
    ref = parity.get("ref_max")
    if ref is None:
        return 0.1, "tol 0.1"
    tol = max(0.1, 2 * ref)
    return tol, (f"tol {tol:.3g} = max(0.1, 2 x transformers' own {dtype} error {ref:.2e}); engine vs float32 "
                 f"{parity['fp32_max']:.2e}")


def _routing_note(parity: dict[str, Any]) -> str:
    """For a mixture-of-experts model: the comparison replayed the engine's routing; how often it differed."""
    if not parity.get("routing_rows"):
        return ""
    return (f"; engine's routing replayed: {parity['routing_differ']} of {parity['routing_rows']} (token, layer) "
            "expert choices differ from transformers' own (router near-ties)")


if __name__ == "__main__":
    sys.exit(main())
