"""Engine vs transformers after a live weight update, on the GPU paths CPU CI cannot run (CI has no GPU:
run this on the GPU machine and record the printed table in docs/).

    python gpu_checks/check_update_paths.py --preset qwen3-0.6b
    python gpu_checks/check_update_paths.py --preset qwen3-0.6b --variants graphs,fp8-weights

Each variant starts an engine on the checkpoint and generates from the prompts (which fills the prefix cache
and, for CUDA-graph variants, replays graphs captured over the old weights), then pushes a second set of
weights with ``update_weights_from_tensor`` (CUDA tensors, so the CUDA IPC path; the ``sleep`` variant
releases and resumes the engine's memory first; the ``embed-only`` variant pushes only the embedding of a
tied model; the ``in-order`` variant pushes the ``state_dict`` in two calls, the last one its last tensor),
generates the same prompts again (greedy, top-20 logprobs) and compares them teacher-forced with
transformers holding the new weights, with ``check_logits``' metrics, and with a fresh engine of the same
options started on a checkpoint of the new weights. Variants that store weights or K/V differently compare
with a transformers model that computes the same way (``tests/reference.py``).

Verdict: the updated engine must equal the fresh one (same greedy tokens, top-20 logprobs within 1e-3
relative), and, except for fp8 weights, be within ``--tolerance`` of transformers. (fp8 weights round each
activation to fp8, so a bf16 difference anywhere moves a logprob by far more than bf16 does: transformers
computing the same fp8 projections is ~1e-1 from itself in float32, ``docs/benchmarks.md``; there the
fresh engine is the reference.) A stale graph, a cached prefix from the old weights, a quantized copy not
refreshed or a tied head left behind shows up as an error of order one. Exits 1 if any variant fails.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_logits import TOP, EngineRun, _model_path, _prompts, compare_runs, compare_with_hf  # noqa: E402

VARIANTS = {  # name -> engine options
    "graphs": {},
    "eager": {"disable_cuda_graph": True},
    "piecewise": {"enable_piecewise_cuda_graph": True},
    "fp8-weights": {"quantization": "fp8"},
    "fp8-kv": {"kv_cache_dtype": "fp8_e4m3"},
    "saver": {"enable_memory_saver": True},
    "sleep": {"enable_memory_saver": True},
    "embed-only": {},
    "in-order": {},
}


def new_weights(model: torch.nn.Module, seed: int, only_embedding: bool) -> None:
    """Move every parameter (or only the input embedding) by noise of its own scale, in place."""
    g = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only_embedding and p is not model.get_input_embeddings().weight:
                continue
            scale = p.float().std() if p.numel() > 1 else p.float().abs() + 1e-3
            p.add_((torch.randn(p.shape, generator=g, device=p.device) * scale).to(p.dtype))


def run_variant(path: str, name: str, prompts: list[list[int]], new_tokens: int,
                named: list[tuple[str, torch.Tensor]] | None, tp_size: int = 1) -> EngineRun:
    """Variant ``name`` on ``path``: with ``named``, generate, push ``named``, generate again; without,
    a fresh engine's one generation."""
    from rollout import Engine, SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True, logprobs=TOP)
    with Engine(path, dtype="bfloat16", device="cuda", mem_fraction_static=0.4, skip_tokenizer_init=True,
                tp_size=tp_size, **VARIANTS[name]) as engine:
        if named is not None:
            engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            if name == "sleep":
                engine.sleep()
                engine.wake_up()
            if name == "in-order":  # a state_dict in two calls; a tied head last loads nothing (no 2nd version)
                first = engine.update_weights_from_tensor(named[:-1], flush_cache=False)
                last = engine.update_weights_from_tensor(named[-1:], weight_version="new")
                print(f"in-order: the first call complete {first['complete']} (version {first['weight_version']}); "
                      f"the last ({named[-1][0]}) loaded {last['loaded']} tensors", flush=True)
            else:
                engine.update_weights_from_tensor(named, weight_version="new")
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        replays = engine.get_step_stats()["graph_replays"]
    versions = {o.weight_version for o in outs}
    print(f"{name} ({'updated' if named is not None else 'fresh'}): weight versions {sorted(versions)}, decode "
          f"graph replays {replays}", flush=True)
    run = EngineRun(1, [o.outputs[0].token_ids for o in outs], [o.outputs[0].token_logprobs for o in outs],
                    [[[(t, lp.logprob) for t, lp in d.items()] for d in o.outputs[0].logprobs] for o in outs], 0.0)
    gc.collect()
    torch.cuda.empty_cache()
    return run


def reference(path: str, name: str, seed: int):
    """transformers with the new weights, computing as variant ``name`` stores weights and K/V."""
    from transformers import AutoModelForCausalLM

    from reference import fp8_quantized_projections, rounded_kv_attention

    extra = {"attn_implementation": rounded_kv_attention(torch.float8_e4m3fn)} if name == "fp8-kv" else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **extra).to("cuda").eval()
    new_weights(model, seed, only_embedding=name == "embed-only")
    return fp8_quantized_projections(model) if name == "fp8-weights" else model


def main() -> int:
    from rollout.config import ModelConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None)
    src.add_argument("--preset", default=None)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp-size", type=int, default=1, help="the engines' TP size (2: two GPUs, NCCL between ranks)")
    p.add_argument("--tolerance", type=float, default=2e-2)
    args = p.parse_args()
    path = _model_path(args)
    prompts = _prompts(ModelConfig.from_path(path).vocab_size, args.num_seqs, args.seed)
    print(f"model {path}; {torch.cuda.get_device_name()} x{torch.cuda.device_count()}, TP={args.tp_size}, torch "
          f"{torch.__version__}; {len(prompts)} prompts, "
          f"{args.new_tokens} greedy tokens each, before and after the update", flush=True)
    failed = []
    for name in args.variants.split(","):
        ref = reference(path, name, args.seed + 1)
        named = [(n, t.detach()) for n, t in ref.state_dict().items()]  # bf16 (fp8: only the forward quantizes)
        if name == "embed-only":
            embed = ref.get_input_embeddings().weight
            named = [(n, t) for n, t in named if t.data_ptr() == embed.data_ptr()][:1]
        run = run_variant(path, name, prompts, args.new_tokens, named, args.tp_size)
        with tempfile.TemporaryDirectory() as saved:
            ref.save_pretrained(saved)
            fresh = run_variant(saved, name, prompts, args.new_tokens, None, args.tp_size)
        same = compare_runs(fresh, run)
        r = compare_with_hf(ref, prompts, run)
        ok = same["top20_rel"] <= 1e-3 and same["identical_sequences"] == len(prompts)
        ok = ok and (name == "fp8-weights" or max(r["top20_rel"], r["chosen_rel"]) <= args.tolerance)
        if not ok:
            failed.append(name)
        print(f"{'PASS' if ok else 'FAIL'} {name}: vs a fresh engine top20 rel {same['top20_rel']:.2e}, "
              f"{same['identical_sequences']}/{len(prompts)} greedy sequences identical; vs transformers top20 rel "
              f"{r['top20_rel']:.2e}, chosen rel {r['chosen_rel']:.2e}, max |Δ| {r['max_abs']:.3f}, argmax "
              f"{r['argmax']}/{r['tokens']}", flush=True)
        del ref, named
        gc.collect()
        torch.cuda.empty_cache()
    print(("FAIL: " + ", ".join(failed)) if failed else "PASS: every variant")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
