"""GPU-only checks (CI has no GPU): run on the GPU machine and record the printed numbers in docs/.

    python gpu_checks/check_attention_and_engine.py [--part attention,engine]

attention: FlashInfer vs the torch-native backend on random paged inputs in bf16 (fresh prefill,
prefix hits with chunked extends, decode), max |Δ| relative to the output scale.
engine: ``check_logits.py`` with its defaults (a small random Llama-shaped model in bf16 through the
engine, teacher-forced against transformers); run that script directly for other models and TP sizes.
"""

from __future__ import annotations

import argparse
import sys

import torch


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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--part", default="attention,engine")
    p.add_argument("--num-seqs", type=int, default=32)
    args = p.parse_args()
    parts = args.part.split(",")
    if "attention" in parts:
        check_attention()
    if "engine" in parts:
        from check_logits import main as check_logits

        sys.argv = [sys.argv[0], "--num-seqs", str(args.num_seqs)]
        check_logits()


if __name__ == "__main__":
    main()
