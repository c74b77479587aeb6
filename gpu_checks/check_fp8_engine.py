"""The fp8 (W8A8) engine's CUDA path against transformers computing the same quantized arithmetic, in
float32 so that only the kernels can differ.   python gpu_checks/check_fp8_engine.py

A random float32 checkpoint (hidden 1024, 4 layers); the engine runs on CUDA with
``quantization="fp8"``, CUDA graphs on, torch-native attention (FlashInfer has no float32), with 1, 16
and 64 requests so decode uses the Triton fp8 GEMM (<= 16 tokens) and ``torch._scaled_mm`` (above),
prefill always the latter. transformers has its projections replaced by
``tests/reference.py``'s ``fp8_quantized_projections`` and runs in float64 (the exact reference) and
float32. fp8 activation rounding makes the network chaotic (a 1e-7 change can flip a rounding), so the
verdict is relative: the engine's logprobs must be no further from float64 than ``--factor`` times
float32 transformers' (plus ``--tolerance``). Exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

DEVICE = os.environ.get("CHECK_DEVICE", "cuda")  # cpu: a dry run of the script

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def main() -> int:
    from tiny_models import make_tiny_checkpoint
    from transformers import AutoModelForCausalLM

    from rollout import Engine, SamplingParams
    from reference import fp8_quantized_projections, hf_logprobs

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tolerance", type=float, default=1e-3, help="absolute slack of the bound")
    p.add_argument("--factor", type=float, default=2.0,
                   help="the engine may be this many times further from float64 than float32 transformers is")
    p.add_argument("--new-tokens", type=int, default=24)
    args = p.parse_args()
    path = make_tiny_checkpoint(tempfile.mkdtemp(), "llama", dtype=torch.float32, hidden_size=1024,
                                intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                                num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048,
                                initializer_range=0.02)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in torch.randint(8, 200, (64,), generator=g)]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True, logprobs=0)
    runs = {}
    with Engine(path, dtype="float32", device=DEVICE, quantization="fp8", attention_backend="torch_native",
                fused_kernels=False, max_total_tokens=1 << 15, skip_tokenizer_init=True) as engine:
        for n in (1, 16, 64):
            runs[n] = engine.generate(prompt_token_ids=prompts[:n], sampling_params=params, use_tqdm=False)
    ref32 = fp8_quantized_projections(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval())
    ref64 = fp8_quantized_projections(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).to(DEVICE).eval())
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    ok = True
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"{where}, torch {torch.__version__}; {args.new_tokens} greedy tokens per request; max |Δ logprob|:")
    for n, outs in runs.items():
        gaps = {"engine-ref64": 0.0, "ref32-ref64": 0.0, "engine-plain": 0.0}
        for prompt, out in zip(prompts, outs):
            got = out.outputs[0]
            lp64 = hf_logprobs(ref64, prompt, got.token_ids)
            for key, lps in (("engine-ref64", got.token_logprobs), ("ref32-ref64", hf_logprobs(ref32, prompt, got.token_ids))):
                gaps[key] = max(gaps[key], *(abs(a - b) for a, b in zip(lps, lp64)))
            lp_plain = hf_logprobs(plain, prompt, got.token_ids)
            gaps["engine-plain"] = max(gaps["engine-plain"], *(abs(a - b) for a, b in zip(got.token_logprobs, lp_plain)))
        bound = args.factor * gaps["ref32-ref64"] + args.tolerance
        ok &= gaps["engine-ref64"] <= bound
        print(f"{n:>3} requests: engine vs fp8 transformers float64 {gaps['engine-ref64']:.2e} (bound {bound:.2e}); "
              f"fp8 transformers float32 vs float64 {gaps['ref32-ref64']:.2e}; engine vs unquantized transformers "
              f"{gaps['engine-plain']:.2e} (the cost of fp8)")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
