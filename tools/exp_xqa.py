"""Experiment: FlashInfer's XQA decode kernel (pages of 16-128 tokens) against the engine's Triton decode.

    python tools/exp_xqa.py [--page-sizes 16,32,64] [--contexts 1500,2000] [--batch 256]

One layer of Llama-3.1-8B heads (32 q / 8 KV, dim 128), float8 e4m3 pools, bf16 queries. The pool is
[num_pages, page_size, 8, 128] (NHD); each request's pages are drawn at random. The Triton kernel reads the
same pool as page-size-1 slots (slot = page * page_size + offset). Both are checked against float32
attention over the widened float8 K/V for a few requests. Times: CUDA events over 20 back-to-back calls,
median of 7. Not used by the engine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.timing import eager_ms as time_ms  # noqa: E402
from rollout.kernels.decode_attention import decode_attention, num_kv_splits  # noqa: E402


def reference(q, k, v, slots, scale) -> torch.Tensor:
    """float32 attention of one request: q [Hq, D], slots [L] into k/v [S, Hk, D]."""
    kf, vf = k[slots].float(), v[slots].float()
    group = q.shape[0] // kf.shape[1]
    kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    s = torch.einsum("hd,lhd->hl", q.float(), kf) * scale
    return torch.einsum("hl,lhd->hd", s.softmax(-1), vf)


def run(batch: int, context: int, page: int, workspace: torch.Tensor) -> None:
    import flashinfer

    dev = workspace.device
    hq, hk, d = 32, 8, 128
    scale = d ** -0.5
    per_seq = -(-context // page)
    num_pages = batch * per_seq + 1
    k = torch.randn(num_pages, page, hk, d, device=dev).to(torch.float8_e4m3fn)
    v = torch.randn(num_pages, page, hk, d, device=dev).to(torch.float8_e4m3fn)
    table = (torch.randperm(batch * per_seq, device=dev) + 1).to(torch.int32).view(batch, per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)

    def xqa():
        flashinfer.decode.trtllm_batch_decode_with_kv_cache(
            q, (k, v), workspace, table, seq_lens_u32, per_seq * page,
            bmm1_scale=scale, bmm2_scale=1.0, out=out, kv_layout="NHD", backend="xqa")

    seq_lens_u32 = seq_lens.to(torch.uint32)
    gen_out = torch.empty_like(q)
    from flashinfer.xqa import get_xqa_module

    module = get_xqa_module(q.dtype, k.dtype, page, d, hq // hk, False, q.dtype, 1)
    sms_count = torch.cuda.get_device_properties(dev).multi_processor_count
    sem, scratch = workspace[: 8 << 20], workspace[8 << 20:]

    def generic():  # XQA's generic kernel (mha.cu): K/V widened to bf16, bf16 MMAs (q not quantized)
        module.xqa(False, sms_count, hk, 0, 1.0, gen_out.unsqueeze(1), 1.0, q.unsqueeze(1), None, k, v, table,
                   per_seq * page, seq_lens_u32.unsqueeze(1), batch, 1.0, sem, scratch, True, 1, None)

    generic()
    t0 = time.perf_counter()
    xqa()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    # the same pool as page-size-1 slots for the Triton kernel
    offs = torch.arange(page, device=dev)
    slots = (table.long()[:, :, None] * page + offs).view(batch, -1)[:, :context]
    indices = slots.reshape(-1).to(torch.int32)
    indptr = torch.arange(0, batch * context + 1, context, dtype=torch.int32, device=dev)
    kf, vf = k.view(-1, hk, d), v.view(-1, hk, d)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    splits = num_kv_splits(batch, hk, sms, 1)
    counters = torch.zeros(batch * hk, dtype=torch.int32, device=dev)
    tri_out = torch.empty_like(q)

    def triton_decode():
        decode_attention(q, kf, vf, indptr, indices, scale, splits, out=tri_out, counters=counters)

    triton_decode()
    torch.cuda.synchronize()
    errs = {"xqa": 0.0, "triton": 0.0, "generic": 0.0}
    for r in range(0, batch, max(1, batch // 8)):
        ref = reference(q[r], kf, vf, slots[r], scale)
        for name, o in (("xqa", out), ("triton", tri_out), ("generic", gen_out)):
            errs[name] = max(errs[name], ((o[r].float() - ref).abs().max() / ref.abs().max()).item())
    gb = 2 * batch * context * hk * d / 1e9
    ms_x = time_ms(xqa)
    ms_t = time_ms(triton_decode)
    ms_g = time_ms(generic)
    print(f"b{batch} ctx{context} page{page:3d}: xqa {ms_x:.3f} ms ({gb / ms_x:.2f} TB/s, err {errs['xqa']:.1e}, "
          f"first call {first:.1f} s) | triton {ms_t:.3f} ms ({gb / ms_t:.2f} TB/s, err {errs['triton']:.1e}) | "
          f"generic {ms_g:.3f} ms ({gb / ms_g:.2f} TB/s, err {errs['generic']:.1e})",
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--page-sizes", default="16,32,64")
    p.add_argument("--contexts", default="1500,2000,1000")
    p.add_argument("--batch", default="256,1")
    args = p.parse_args()
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    for batch in [int(x) for x in args.batch.split(",")]:
        for context in [int(x) for x in args.contexts.split(",")]:
            for page in [int(x) for x in args.page_sizes.split(",")]:
                try:
                    run(batch, context, page, workspace)
                except Exception as e:  # noqa: BLE001
                    print(f"b{batch} ctx{context} page{page}: failed {type(e).__name__}: {e}"[:600], flush=True)


if __name__ == "__main__":
    main()
