"""GPU time of the fused fast-path sampler and of the decode index build, against their previous versions.

    python tools/bench_sampler.py [--old-sampler FILE] [--vocab 128256] [--sweep]

Sampler: ``fused_sample`` on bf16 logits [B, V] drawn as 2 x a standard normal (flat rows, as a random-weight
model gives), random rows at temperature 0.6 and greedy rows, at B = 1, 64, 256; tokens, ranks and logprobs
are checked against the torch ``Sampler``. ``--old-sampler`` times a previous ``rollout/kernels/sampling.py``
(e.g. from another checkout) on the same inputs.
``--sweep``: instead, ``fused_sample`` on random rows at B = 16, 64, 256 over its launch grid (tile 1,024-4,096,
4-16 warps, 2-8 programs per SM; GPU time, replayed from a CUDA graph as in the engine's decode step), the four
fastest settings against the default.
Index build: ``write_kv_indices`` against the torch ``kv_indices_for`` (+ cumsum) at 256 x 1,500 tokens.
Times per call: 20 back-to-back calls (CUDA events), median of 7.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.timing import eager_ms as time_ms, graph_ms  # noqa: E402
from rollout.attention.common import kv_indices_for  # noqa: E402
from rollout.kernels.decode_indices import write_kv_indices  # noqa: E402
from rollout.kernels import sampling as triton_sampling  # noqa: E402
from rollout.layers.sampler import Sampler  # noqa: E402
from rollout.layers.sampling_info import SamplingBatchInfo, SamplingRow  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402



def _rows(batch: int, greedy: bool) -> list[SamplingRow]:
    # logprobs=0: the rows ask for their token's logprob, so the torch Sampler counts ranks as fused_sample does
    return [SamplingRow(params=SamplingParams(temperature=0.0 if greedy else 0.6, logprobs=0), seed=i, output_len=7 + i,
                        prompt_token_ids=[], output_token_ids=[], eos_token_ids=[]) for i in range(batch)]


def _load(path: str):
    spec = importlib.util.spec_from_file_location("old_triton_sampling", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bench_sampler(old, vocab: int) -> None:
    dev = torch.device("cuda")
    for batch in (1, 64, 256):
        for greedy in (False, True):
            logits = (torch.randn(batch, vocab, device=dev) * 2).to(torch.bfloat16)
            info = SamplingBatchInfo.build(_rows(batch, greedy), vocab, dev)
            args = (logits, info.temperatures, info.seeds, info.positions, info.is_greedy, info.use_processed)
            ref = Sampler()(logits, info)
            ids, lps, ranks = triton_sampling.fused_sample(*args)
            same = bool((ids == ref.next_token_ids).all() and (ranks == ref.ranks).all())
            err = (lps - ref.logprobs).abs().max().item()
            line = (f"V {vocab} B {batch:3d} {'greedy' if greedy else 'T=0.6 '}: fused_sample "
                    f"{time_ms(lambda: triton_sampling.fused_sample(*args)) * 1e3:7.1f} us"
                    f" (tokens+ranks equal torch: {same}, logprob max err {err:.1e})")
            if old is not None:
                line += f"; --old-sampler {time_ms(lambda: old.fused_sample(*args)) * 1e3:7.1f} us"
            print(line, flush=True)


def sweep_sampler(vocab: int) -> None:
    """``fused_sample``'s launch grid on random rows: tile, warps per program and programs per SM."""
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for batch in (16, 64, 256):
        logits = (torch.randn(batch, vocab, device=dev) * 2).to(torch.bfloat16)
        info = SamplingBatchInfo.build(_rows(batch, False), vocab, dev)
        args = (logits, info.temperatures, info.seeds, info.positions, info.is_greedy, info.use_processed)
        ref = Sampler()(logits, info)
        default = graph_ms(lambda: triton_sampling.fused_sample(*args, count_ranks=False)) * 1e3
        cells = []
        for block in (1024, 2048, 4096):
            for warps in (4, 8, 16):
                for per_sm in (2, 4, 8):
                    kw = dict(block_size=block, num_warps=warps, num_chunks=-(-per_sm * sms // batch), count_ranks=False)
                    ids = triton_sampling.fused_sample(*args, **kw)[0]
                    t = graph_ms(lambda: triton_sampling.fused_sample(*args, **kw)) * 1e3
                    cells.append((t, block, warps, per_sm, bool((ids == ref.next_token_ids).all())))
        cells.sort()
        print(f"V {vocab} B {batch:3d} T=0.6 no ranks: default {default:6.1f} us; fastest "
              + "; ".join(f"{t:6.1f} us (block {b}, {w} warps, {p}/SM{'' if ok else ', TOKENS DIFFER'})"
                          for t, b, w, p, ok in cells[:4])
              + f"; slowest {cells[-1][0]:6.1f} us", flush=True)


def bench_indices() -> None:
    dev = torch.device("cuda")
    batch, ctx = 256, 1500
    table = torch.randint(0, 1 << 20, (batch + 1, 4096), dtype=torch.int32, device=dev)
    rows = torch.randperm(batch, device=dev) + 1
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    indptr = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
    buf = torch.zeros(batch * ctx + 1024, dtype=torch.int32, device=dev)
    total = batch * ctx

    def torch_way():
        torch.cumsum(seq_lens, 0, dtype=torch.int32, out=indptr[1:])
        return kv_indices_for(table, rows, seq_lens, total, out=buf)

    ref = torch_way().clone()
    got = write_kv_indices(table, rows, seq_lens, indptr, buf, total)
    print(f"kv indices 256 x 1500: one Triton launch {time_ms(lambda: write_kv_indices(table, rows, seq_lens, indptr, buf, total)) * 1e3:6.1f} us, "
          f"torch {time_ms(torch_way) * 1e3:6.1f} us (equal: {bool((got == ref).all())})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old-sampler", default=None, help="a previous rollout/kernels/sampling.py to time alongside")
    ap.add_argument("--vocab", type=int, default=128256, help="vocabulary size (Llama-3 128,256; Qwen3 151,936)")
    ap.add_argument("--sweep", action="store_true", help="time fused_sample's launch grid instead")
    args = ap.parse_args()
    if args.sweep:
        sweep_sampler(args.vocab)
        return
    bench_sampler(_load(args.old_sampler) if args.old_sampler else None, args.vocab)
    bench_indices()


if __name__ == "__main__":
    main()
