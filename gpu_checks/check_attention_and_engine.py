"""GPU-only checks (CI has no GPU): run on the GPU machine and record the printed numbers in docs/.

    python gpu_checks/check_attention_and_engine.py [--part attention,engine]

attention: FlashInfer vs the torch-native backend on random paged inputs in bf16 (fresh prefill,
prefix hits with chunked extends, decode), max |Δ| relative to the output scale.
engine: a random Llama-shaped model in bf16 through the engine (FlashInfer + CUDA graphs), teacher-
forced against transformers' logits (relative error), and greedy agreement.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def check_attention() -> None:
    from rollout.attention.flashinfer_backend import FlashInferBackend
    from rollout.attention.torch_native import TorchNativeBackend
    from rollout.layers.attention import Attention
    from rollout.mem_cache.kv_pool import KVPool, ReqToTokenPool
    from rollout.model_executor.forward_batch import ForwardBatch, ForwardMode

    dev, dtype = torch.device("cuda"), torch.bfloat16
    for hq, hk, d in ((32, 8, 128), (9, 3, 64)):
        layer = Attention(0, hq, hk, d, d ** -0.5)
        torch.manual_seed(0)
        seqs = [37, 512, 1, 200, 1000, 64]
        prefixes = [0, 300, 0, 150, 900, 63]  # cached tokens before this step (prefix hits / earlier chunks)
        pool = KVPool(sum(seqs) + 16, 1, hk, d, dtype, dev)
        table = ReqToTokenPool(len(seqs), max(seqs) + 1, dev)
        perm = torch.randperm(sum(seqs)) + 1
        off = 0
        for i, n in enumerate(seqs):
            table.write(i, 0, perm[off:off + n])
            off += n
        pool.k_buffers[0].normal_()
        pool.v_buffers[0].normal_()
        for mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
            ext = [s - p for s, p in zip(seqs, prefixes)] if mode == ForwardMode.EXTEND else [1] * len(seqs)
            t = sum(ext)
            loc = torch.cat([table.slots(i, s)[s - e:] for i, (s, e) in enumerate(zip(seqs, ext))]).to(dev)
            q = torch.randn(t, hq, d, device=dev, dtype=dtype)
            k = torch.randn(t, hk, d, device=dev, dtype=dtype)
            v = torch.randn(t, hk, d, device=dev, dtype=dtype)
            outs = []
            for backend in (TorchNativeBackend(), FlashInferBackend(hq, hk, d, d ** -0.5, dtype, dev, 1 << 16)):
                fb = ForwardBatch(mode, torch.zeros(t, dtype=torch.int64, device=dev), torch.zeros(t, device=dev),
                                  loc, torch.arange(len(seqs), device=dev), torch.tensor(seqs, device=dev), seqs, ext,
                                  pool, table.table, backend)
                backend.init_forward_metadata(fb)
                outs.append(backend.forward(q, k, v, layer, fb).float())
            err = (outs[0] - outs[1]).abs().max().item() / outs[0].abs().max().item()
            print(f"attention heads {hq}/{hk} dim {d} {mode.value:7s}: max |Δ| / max |out| = {err:.2e}", flush=True)


def check_engine(num_seqs: int) -> None:
    from transformers import AutoModelForCausalLM

    from rollout import Engine, SamplingParams
    from tiny_models import make_tiny_checkpoint

    path = tempfile.mkdtemp()
    make_tiny_checkpoint(path, "llama", dtype=torch.bfloat16, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, vocab_size=512,
                         max_position_embeddings=2048, initializer_range=0.02)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in torch.randint(8, 300, (num_seqs,), generator=g)]
    t0 = time.time()
    with Engine(path, dtype="bfloat16", device="cuda") as engine:
        print(f"engine up in {time.time() - t0:.1f} s", flush=True)
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=32,
                                                                                      ignore_eos=True, logprobs=0),
                               use_tqdm=False)
        stats = engine.get_step_stats()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    rel, agree = [], 0
    for p, o in zip(prompts, outs):
        toks = o.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([p + toks], device="cuda")).logits[0, len(p) - 1:-1].float()
        lp = torch.log_softmax(logits, -1)
        chosen = lp[torch.arange(len(toks)), torch.tensor(toks, device="cuda")]
        engine_lp = torch.tensor(o.outputs[0].token_logprobs, device="cuda")
        rel.append(((chosen - engine_lp).abs().max() / lp.abs().max()).item())
        agree += bool((lp.max(-1).values - chosen).max() < 0.05)
    decode = {b: round(v["seconds"] / v["steps"] * 1e3, 2) for b, v in stats["decode"].items() if v["steps"] > 3}
    print(f"engine vs transformers (bf16, {num_seqs} seqs): max relative logprob error {max(rel):.2e}; "
          f"{agree}/{num_seqs} greedy paths are transformers' argmax within 0.05; decode ms by batch {decode}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--part", default="attention,engine")
    p.add_argument("--num-seqs", type=int, default=32)
    args = p.parse_args()
    parts = args.part.split(",")
    if "attention" in parts:
        check_attention()
    if "engine" in parts:
        check_engine(args.num_seqs)


if __name__ == "__main__":
    main()
