"""GPU-only checks (CI has no GPU): run on the GPU machine and record the printed numbers in docs/.

    python gpu_checks/check_attention_and_engine.py [--part attention,decode-speed,engine]

attention: FlashInfer (and, for decode, the Triton kernel) vs the torch-native backend on random paged
inputs, bf16 and fp8 (e4m3) KV pools (fresh prefill, prefix hits with chunked extends, decode), max |Δ|
relative to the output scale.
decode-speed: one layer's FlashInfer decode at batch 256 x 1,500 cached tokens (Llama-3.1-8B heads),
bf16 vs fp8 KV, tensor-core vs CUDA-core kernels: time and KV bytes read per second.
engine: ``check_logits.py`` with its defaults (a small random Llama-shaped model in bf16 through the
engine, teacher-forced against transformers); run that script directly for other models and TP sizes.
"""

from __future__ import annotations

import argparse
import sys

import torch


def check_attention() -> None:
    from rollout.attention.common import AttentionSpec
    from rollout.attention.registry import create_attention_backend
    from rollout.layers.attention import Attention
    from rollout.mem_cache.kv_pool import KVPool, ReqToTokenPool
    from rollout.model_executor.forward_batch import ForwardBatch, ForwardMode

    dev, dtype = torch.device("cuda"), torch.bfloat16
    for kv_dtype, hq, hk, d in ((dtype, 32, 8, 128), (dtype, 9, 3, 64), (torch.float8_e4m3fn, 32, 8, 128)):
        layer = Attention(0, hq, hk, d, d ** -0.5)
        torch.manual_seed(0)
        seqs = [37, 512, 1, 200, 1000, 64]
        spec = AttentionSpec(hq, hk, d, d ** -0.5, dtype, kv_dtype, dev, max_batch_size=len(seqs),
                             max_context_len=max(seqs) + 1)
        prefixes = [0, 300, 0, 150, 900, 63]  # cached tokens before this step (prefix hits / earlier chunks)
        pool = KVPool(sum(seqs) + 16, 1, hk, d, kv_dtype, dev)
        table = ReqToTokenPool(len(seqs), max(seqs) + 1, dev)
        perm = torch.randperm(sum(seqs)) + 1
        off = 0
        for i, n in enumerate(seqs):
            table.write(i, 0, perm[off:off + n])
            off += n
        pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, device=dev))
        pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, device=dev))
        for mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
            ext = [s - p for s, p in zip(seqs, prefixes)] if mode == ForwardMode.EXTEND else [1] * len(seqs)
            t = sum(ext)
            loc = torch.cat([table.slots(i, s)[s - e:] for i, (s, e) in enumerate(zip(seqs, ext))]).to(dev)
            q = torch.randn(t, hq, d, device=dev, dtype=dtype)
            k = torch.randn(t, hk, d, device=dev, dtype=dtype)
            v = torch.randn(t, hk, d, device=dev, dtype=dtype)
            backends = {"torch_native": create_attention_backend(spec, "torch_native")}
            for decode in ("flashinfer", "triton") if mode == ForwardMode.DECODE else ("flashinfer",):
                backends[f"{decode} decode" if mode == ForwardMode.DECODE else "flashinfer"] = \
                    create_attention_backend(spec, "flashinfer", decode)
            outs = {}
            for name, backend in backends.items():
                fb = ForwardBatch(mode, torch.zeros(t, dtype=torch.int64, device=dev), torch.zeros(t, device=dev),
                                  loc, torch.arange(len(seqs), device=dev), torch.tensor(seqs, device=dev), seqs, ext,
                                  pool, table.table, backend)
                backend.init_forward_metadata(fb)
                outs[name] = backend.forward(q, k, v, layer, fb).float()
            ref = outs.pop("torch_native")
            for name, out in outs.items():
                err = (ref - out).abs().max().item() / ref.abs().max().item()
                kv = str(kv_dtype).removeprefix("torch.")
                print(f"attention KV {kv:13s} heads {hq}/{hk} dim {d} {mode.value:7s} {name:17s}: "
                      f"max |Δ| / max |out| = {err:.2e}", flush=True)


def check_decode_speed(batch: int = 256, context: int = 1500, hq: int = 32, hk: int = 8, d: int = 128) -> None:
    """Median time of one layer's decode kernel over ``batch`` x ``context`` cached tokens."""
    import flashinfer

    from check_kernels import _time_ms

    dev = torch.device("cuda")
    slots = batch * context
    indptr = torch.arange(0, slots + 1, context, dtype=torch.int32, device=dev)
    indices = (torch.randperm(slots, device=dev) + 1).to(torch.int32)
    last = torch.ones(batch, dtype=torch.int32, device=dev)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    bf16, fp16, e4m3, e5m2 = torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2
    cases = [(bf16, bf16, True), (bf16, e4m3, True), (fp16, e4m3, True), (fp16, e5m2, True), (fp16, e4m3, False)]
    for q_dtype, kv_dtype, tensor_cores in cases:
        q = torch.randn(batch, hq, d, device=dev, dtype=q_dtype)
        k = torch.randn(slots + 1, 1, hk, d, device=dev).to(kv_dtype)
        v = torch.randn(slots + 1, 1, hk, d, device=dev).to(kv_dtype)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
        w.plan(indptr, indices, last, hq, hk, d, 1, q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=d ** -0.5)
        ms = _time_ms(lambda w=w, q=q, k=k, v=v: w.run(q, (k, v)))  # bound now: the loop deletes them
        gb = 2 * slots * hk * d * k.element_size() / 1e9
        print(f"decode {batch} x {context}, q {str(q_dtype).removeprefix('torch.'):8s} "
              f"KV {str(kv_dtype).removeprefix('torch.'):13s} {'tensor-core' if tensor_cores else 'CUDA-core  '}: "
              f"{ms:.3f} ms per layer, {gb / ms:.2f} TB/s of KV", flush=True)
        del q, k, v


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--part", default="attention,decode-speed,engine")
    p.add_argument("--num-seqs", type=int, default=32)
    args = p.parse_args()
    parts = args.part.split(",")
    if "attention" in parts:
        check_attention()
    if "decode-speed" in parts:
        check_decode_speed()
    if "engine" in parts:
        from check_logits import main as check_logits

        sys.argv = [sys.argv[0], "--num-seqs", str(args.num_seqs)]
        check_logits()


if __name__ == "__main__":
    main()
