"""Engine vs transformers on the GPU, teacher-forced, for one or more TP sizes (CI has no GPU: run this on
the GPU machine and record the printed table in docs/).

    python gpu_checks/check_logits.py --preset llama-3.1-8b --num-seqs 32 --tp-sizes 1
    python gpu_checks/check_logits.py --preset llama-3.1-8b --num-seqs 32 --tp-sizes 1,2   # 2 GPUs

Each engine (FlashInfer, CUDA-graph decode, fused kernels, bf16) generates greedily from random prompts
with the top-20 logprobs of every generated position. transformers (bf16, sdpa) then runs the same
prompt + generated tokens in one teacher-forced forward, and at every position we compare:

- ``top20 rel``: ||lp_engine - lp_hf|| / ||lp_hf|| over the engine's top-20 tokens (max over sequences);
- ``chosen rel``: max |Δ logprob of the chosen token| / max |lp_hf| (the metric of earlier runs);
- ``max |Δ|``: the largest absolute logprob difference seen;
- ``argmax``: generated tokens that are transformers' argmax or within 0.05 of it (bf16 near-ties).

For scale, transformers' own bf16 forward is compared the same way with its float32 forward
(``--fp32-reference``, on by default): the engine's error against transformers bf16 should be of the
order of transformers bf16's own error.

With several TP sizes it also compares each engine with the first one on the common prefix of their
greedy paths (same top-20 metric). Exits 1 if a relative error exceeds ``--tolerance`` (2e-2).

With ``--kv-cache-dtype fp8_e4m3`` the engines store K/V in float8; their error against plain
transformers is then the cost of the format, and the verdict compares them with transformers bf16
whose attention reads K/V rounded the same way (``tests/reference.py``'s ``rounded_kv_attention``).

With ``--quantization fp8`` the engines store their projections in fp8 (W8A8); every transformers
reference then computes its projections the same way (``tests/reference.py``'s ``fp8_quantized_projections``),
and the error against plain transformers bf16 is printed as the cost of the format.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/ of the checkout

TOP = 20


@dataclass
class EngineRun:
    tp_size: int
    tokens: list[list[int]]
    chosen: list[list[float]]
    top: list[list[list[tuple[int, float]]]]  # per sequence, per position: (token, logprob) of the top 20
    seconds: float


def _model_path(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    if args.preset:
        from benchmarks.presets import write_preset

        return write_preset(args.preset)
    from tiny_models import make_tiny_checkpoint

    path = tempfile.mkdtemp()
    return make_tiny_checkpoint(path, "llama", dtype=torch.bfloat16, hidden_size=1024, intermediate_size=2816,
                                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, vocab_size=512,
                                max_position_embeddings=2048, initializer_range=0.02)


def _prompts(vocab: int, n: int, seed: int, lengths: tuple[int, int] = (8, 299)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lengths[0], lengths[1] + 1, (n,), generator=g)
    return [torch.randint(3, vocab - 1, (int(k),), generator=g).tolist() for k in lens]


def run_engine(path: str, tp: int, prompts: list[list[int]], new_tokens: int, device: str,
               kv_cache_dtype: str = "auto", quantization: str | None = None, **options) -> EngineRun:
    from rollout import Engine, SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True, logprobs=TOP)
    t0 = time.time()
    with Engine(path, tp_size=tp, dtype="bfloat16", device=device, max_total_tokens=1 << 16,
                skip_tokenizer_init=True, kv_cache_dtype=kv_cache_dtype, quantization=quantization, **options) as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        stats = engine.get_step_stats()
    print(f"engine TP={tp}: {stats['prefill']['steps']} extend steps, {stats['mixed_steps']} of them mixed with "
          f"decode; {stats['cascade_steps']} decode steps with shared-prefix groups ({stats['cascade_rows']} rows); "
          f"decode graph replays {stats['graph_replays']}",
          flush=True)
    run = EngineRun(tp, [o.outputs[0].token_ids for o in outs], [o.outputs[0].token_logprobs for o in outs],
                    [[[(t, lp.logprob) for t, lp in d.items()] for d in o.outputs[0].logprobs] for o in outs],
                    time.time() - t0)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return run


def hf_as_run(model, prompts: list[list[int]], like: EngineRun) -> EngineRun:
    """transformers' teacher-forced log-probabilities on ``like``'s tokens, shaped as an engine run."""
    chosen, top = [], []
    for prompt, toks in zip(prompts, like.tokens):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + toks], device=model.device)).logits[0, len(prompt) - 1:-1]
        lp = torch.log_softmax(logits.float(), -1)
        chosen.append(lp[torch.arange(len(toks)), torch.tensor(toks, device=model.device)].tolist())
        values, ids = lp.topk(TOP, dim=-1)
        top.append([list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())])
    return EngineRun(0, like.tokens, chosen, top, 0.0)


def compare_with_hf(model, prompts: list[list[int]], run: EngineRun) -> dict[str, float]:
    dev = model.device
    top_rel, chosen_rel, max_abs, ok, total = 0.0, 0.0, 0.0, 0, 0
    for prompt, toks, chosen, top in zip(prompts, run.tokens, run.chosen, run.top):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + toks], device=dev)).logits[0, len(prompt) - 1:-1].float()
        lp = torch.log_softmax(logits, -1)
        idx = torch.arange(len(toks), device=dev)
        hf_chosen = lp[idx, torch.tensor(toks, device=dev)]
        eng_chosen = torch.tensor(chosen, device=dev)
        chosen_rel = max(chosen_rel, ((hf_chosen - eng_chosen).abs().max() / lp.abs().max()).item())
        max_abs = max(max_abs, (hf_chosen - eng_chosen).abs().max().item())
        for pos, entry in enumerate(top):
            pairs = entry
            ids = torch.tensor([t for t, _ in pairs], device=dev)
            eng = torch.tensor([v for _, v in pairs], device=dev)
            ref = lp[pos, ids]
            top_rel = max(top_rel, ((eng - ref).norm() / ref.norm()).item())
            max_abs = max(max_abs, (eng - ref).abs().max().item())
        ok += int(((lp.max(-1).values - hf_chosen) < 0.05).sum().item())
        total += len(toks)
    return {"top20_rel": top_rel, "chosen_rel": chosen_rel, "max_abs": max_abs, "argmax": ok, "tokens": total}


def compare_runs(a: EngineRun, b: EngineRun) -> dict[str, float]:
    """b vs a on each sequence's common greedy prefix (top-20 logprobs of a's tokens)."""
    rel, positions, same = 0.0, 0, 0
    for ta, tb, pa, pb in zip(a.tokens, b.tokens, a.top, b.top):
        n = 0
        while n < min(len(ta), len(tb)) and ta[n] == tb[n]:
            n += 1
        same += int(n == len(ta) == len(tb))
        for pos in range(min(n + 1, len(ta), len(tb))):  # the first diverging position is still teacher-forced
            da, db = dict(pa[pos]), dict(pb[pos])
            common = [t for t in da if t in db]
            va = torch.tensor([da[t] for t in common])
            vb = torch.tensor([db[t] for t in common])
            rel = max(rel, ((va - vb).norm() / va.norm()).item())
            positions += 1
    return {"top20_rel": rel, "positions": positions, "identical_sequences": same}


def main() -> int:
    from rollout.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS, ModelConfig, kv_cache_torch_dtype

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None)
    src.add_argument("--preset", default=None)
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--tp-sizes", default="1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=2e-2)
    p.add_argument("--device", default="cuda", help="cuda (the check), or cpu for a dry run of the script")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the engines' KV cache type (transformers keeps bf16 / float32 K and V)")
    p.add_argument("--decode-attention-backend", default="auto", help="the engines' decode kernel")
    p.add_argument("--page-size", type=int, default=1, help="the engines' KV page size (xqa: 16-128)")
    p.add_argument("--disable-cuda-graph", action="store_true", help="the engines decode without CUDA graphs")
    p.add_argument("--enable-mixed-chunk", action="store_true",
                   help="the engines decode the running requests inside prefill steps (pair with a small "
                        "--max-prefill-tokens so the prompts are admitted over several steps)")
    p.add_argument("--max-prefill-tokens", type=int, default=16384, help="the engines' prompt tokens per step")
    p.add_argument("--samples-per-prompt", type=int, default=1,
                   help="send each prompt this many times (GRPO-shaped: the samples share the cached prompt, so "
                        "decode runs cascade attention over it)")
    p.add_argument("--disable-cascade-attn", action="store_true", help="the engines decode without cascade attention")
    p.add_argument("--enable-piecewise-cuda-graph", action="store_true",
                   help="the engines replay piecewise CUDA graphs for extend steps")
    p.add_argument("--decode-balance-ratio", type=float, default=4.0,
                   help="the engines' rule for cutting decode requests into pieces (default 4, the engine's; 0: every "
                        "step; inf: never)")
    p.add_argument("--prompt-lens", default="8,299", help="shortest,longest prompt (tokens)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS,
                   help="the engines' online weight quantization (references quantize the same way)")
    p.add_argument("--fp32-reference", action=argparse.BooleanOptionalAction, default=True,
                   help="also compare transformers bf16 with transformers float32 (the scale of bf16 error)")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM

    from reference import fp8_quantized_projections

    def quantized(model):
        return fp8_quantized_projections(model) if args.quantization else model

    path = _model_path(args)
    lengths = tuple(int(x) for x in args.prompt_lens.split(","))
    prompts = [p for p in _prompts(ModelConfig.from_path(path).vocab_size, args.num_seqs // args.samples_per_prompt,
                                   args.seed, lengths) for _ in range(args.samples_per_prompt)]
    args.num_seqs = len(prompts)
    runs = [run_engine(path, int(tp), prompts, args.new_tokens, args.device, args.kv_cache_dtype, args.quantization,
                       decode_attention_backend=args.decode_attention_backend, page_size=args.page_size,
                       disable_cuda_graph=args.disable_cuda_graph, enable_mixed_chunk=args.enable_mixed_chunk,
                       max_prefill_tokens=args.max_prefill_tokens, disable_cascade_attn=args.disable_cascade_attn,
                       enable_piecewise_cuda_graph=args.enable_piecewise_cuda_graph,
                       decode_balance_ratio=args.decode_balance_ratio)
            for tp in args.tp_sizes.split(",")]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(args.device).eval()
    worst = 0.0
    where = (f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}" if args.device == "cuda" else "cpu")
    print(f"model {path}; {args.num_seqs} sequences, prompts {lengths[0]}-{lengths[1]} tokens, {args.new_tokens} greedy "
          "tokens each; "
          f"{where}, torch {torch.__version__}, engine KV cache {args.kv_cache_dtype}, decode attention "
          f"{args.decode_attention_backend}, page size {args.page_size}, "
          f"weights {args.quantization or 'bf16'}")
    if args.quantization:  # the cost of the format; the references below quantize as the engines do
        for run in runs:
            r = compare_with_hf(model, prompts, run)
            print(f"TP={run.tp_size} ({args.quantization} weights) vs plain transformers bf16: top20 rel "
                  f"{r['top20_rel']:.2e}, chosen rel {r['chosen_rel']:.2e}, max |Δ| {r['max_abs']:.3f}, "
                  f"argmax {r['argmax']}/{r['tokens']}", flush=True)
        if len(runs) > 1:
            print("note: with several TP sizes the references quantize row-parallel inputs as TP=1 does")
        model = quantized(model)
    for run in runs:
        r = compare_with_hf(model, prompts, run)
        if args.kv_cache_dtype == "auto":  # else this is the cost of the KV format; the verdict uses the next
            worst = max(worst, r["top20_rel"], r["chosen_rel"])
        print(f"TP={run.tp_size} vs transformers: top20 rel {r['top20_rel']:.2e}, chosen rel {r['chosen_rel']:.2e}, "
              f"max |Δ| {r['max_abs']:.3f}, argmax {r['argmax']}/{r['tokens']} (engine run {run.seconds:.0f} s)",
              flush=True)
    if args.fp32_reference:
        hf_bf16 = hf_as_run(model, prompts, runs[0])
        del model
        gc.collect()
        model = quantized(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).eval())
        for name, run in [("transformers bf16", hf_bf16)] + [(f"TP={r.tp_size}", r) for r in runs]:
            r = compare_with_hf(model, prompts, run)
            print(f"{name} vs transformers float32: top20 rel {r['top20_rel']:.2e}, chosen rel {r['chosen_rel']:.2e}, "
                  f"max |Δ| {r['max_abs']:.3f}, argmax {r['argmax']}/{r['tokens']}", flush=True)
    if args.kv_cache_dtype != "auto":  # the same transformers model reading K/V rounded as the engine stores them
        from reference import rounded_kv_attention

        kv = kv_cache_torch_dtype(args.kv_cache_dtype, torch.bfloat16)
        del model
        gc.collect()
        model = quantized(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                               attn_implementation=rounded_kv_attention(kv)).to(args.device))
        for run in runs:
            r = compare_with_hf(model.eval(), prompts, run)
            worst = max(worst, r["top20_rel"], r["chosen_rel"])
            print(f"TP={run.tp_size} vs transformers bf16 reading {args.kv_cache_dtype} K/V: top20 rel "
                  f"{r['top20_rel']:.2e}, chosen rel {r['chosen_rel']:.2e}, max |Δ| {r['max_abs']:.3f}, "
                  f"argmax {r['argmax']}/{r['tokens']}", flush=True)
        if args.fp32_reference:  # the scale: transformers' own bf16 vs float32, both reading rounded K/V
            hf8 = hf_as_run(model, prompts, runs[0])
            del model
            gc.collect()
            model = quantized(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                   attn_implementation=rounded_kv_attention(kv))
                              .to(args.device))
            for name, run in [("transformers bf16", hf8)] + [(f"TP={r.tp_size}", r) for r in runs]:
                r = compare_with_hf(model.eval(), prompts, run)
                print(f"{name} (reading {args.kv_cache_dtype}) vs transformers float32 reading {args.kv_cache_dtype} "
                      f"K/V: top20 rel {r['top20_rel']:.2e}, chosen rel {r['chosen_rel']:.2e}, "
                      f"max |Δ| {r['max_abs']:.3f}, argmax {r['argmax']}/{r['tokens']}", flush=True)
    for run in runs[1:]:
        r = compare_runs(runs[0], run)
        worst = max(worst, r["top20_rel"])
        print(f"TP={run.tp_size} vs TP={runs[0].tp_size}: top20 rel {r['top20_rel']:.2e} over {r['positions']} "
              f"teacher-forced positions; {r['identical_sequences']}/{args.num_seqs} greedy sequences identical")
    verdict = "PASS" if worst <= args.tolerance else "FAIL"
    print(f"{verdict}: worst relative error {worst:.2e} (tolerance {args.tolerance:.0e})")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
