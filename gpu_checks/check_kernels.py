"""The Triton kernels against the torch code they replace, on the GPU, with timings (CI runs them only in
Triton's CPU interpreter).   python gpu_checks/check_kernels.py

rope: ``rope_and_store_kv`` vs ``RotaryEmbedding`` + ``KVPool.set_kv`` (bf16; Llama-3.1-8B and Qwen3 head
shapes; decode T=1/256 and a prefill chunk T=8192).
qk-norm: ``rope_and_store_kv`` with Qwen3's q/k norm weights vs the engine's previous fused path (FlashInfer's
RMSNorm on q and on k, then the rope kernel) and vs the torch RMSNorm path, Qwen3-0.6B heads.
sampling: ``fused_sample`` vs the torch ``Sampler`` on the same [B, V] logits (temperature rows with
raw and processed logprobs, greedy rows): identical tokens expected except at float near-ties.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/ of the checkout

from tools.timing import eager_ms, graph_ms  # noqa: E402


def _time_ms(fn) -> float:
    """Median time of ``fn`` in ms over 50 CUDA-event timed calls, after 5 warm-up calls."""
    return eager_ms(fn, calls=1, repeats=50, warmup=5)


def _graph_time_ms(fn, calls: int = 28) -> float:
    """GPU time of one ``fn`` in ms, replayed inside a CUDA graph of ``calls`` back-to-back calls (a decode
    step's layers; no launch overhead, as the engine's decode graph runs it); median of 20 replays."""
    return graph_ms(fn, calls=calls, repeats=20, warmup=1)


def check_rope() -> None:
    from rollout.layers.rotary import RotaryEmbedding, rope_inv_freq
    from rollout.kernels.rope import rope_and_store_kv
    from rollout.mem_cache.kv_pool import KVPool

    dev, dtype = torch.device("cuda"), torch.bfloat16
    for hq, hk, d in ((32, 8, 128), (16, 8, 128), (32, 8, 64)):
        inv, _ = rope_inv_freq({}, {"rope_type": "default", "rope_theta": 500000.0}, d)
        rotary = RotaryEmbedding(d, 8192, inv, 1.0, dtype, dev)
        for t in (1, 256, 8192):
            qkv = torch.randn(t, (hq + 2 * hk) * d, device=dev, dtype=dtype)
            q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
            q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
            pos = torch.randint(0, 8192, (t,), device=dev)
            loc = torch.randperm(16384, device=dev)[:t] + 1
            ref_pool, pool = KVPool(16384, 1, hk, d, dtype, dev), KVPool(16384, 1, hk, d, dtype, dev)

            def torch_path():
                rq, rk = rotary(pos, q, k)
                ref_pool.set_kv(0, loc, rk, v)
                return rq

            def fused_path():
                return rope_and_store_kv(q, k, v, pos, rotary.cos_cache, rotary.sin_cache, pool.k_buffers[0],
                                         pool.v_buffers[0], loc)

            ref_q, out_q = torch_path(), fused_path()
            err = max((out_q.float() - ref_q.float()).abs().max().item(),
                      (pool.k_buffers[0][loc].float() - ref_pool.k_buffers[0][loc].float()).abs().max().item())
            v_same = torch.equal(pool.v_buffers[0][loc], ref_pool.v_buffers[0][loc])
            print(f"rope heads {hq}/{hk} dim {d} T={t:5d}: max |Δ| {err:.3e} (bf16 inputs ~N(0,1)), v exact {v_same}; "
                  f"torch {_time_ms(torch_path):.4f} ms, triton {_time_ms(fused_path):.4f} ms", flush=True)


def check_qk_norm_rope() -> None:
    from rollout.layers.norm import RMSNorm
    from rollout.layers.rotary import RotaryEmbedding, rope_inv_freq
    from rollout.kernels import rope as rope_mod
    from rollout.kernels.rope import rope_and_store_kv
    from rollout.mem_cache.kv_pool import KVPool

    dev, dtype, (hq, hk, d) = torch.device("cuda"), torch.bfloat16, (16, 8, 128)
    inv, _ = rope_inv_freq({}, {"rope_type": "default", "rope_theta": 1000000.0}, d)
    rotary = RotaryEmbedding(d, 8192, inv, 1.0, dtype, dev)
    weights = [torch.rand(d, device=dev) + 0.5 for _ in range(2)]  # q's and k's, the same in every path
    torch_norms, fi_norms = ([RMSNorm(d, 1e-6, dtype, dev, fused=f) for _ in range(2)] for f in (False, True))
    for n, w in [*zip(torch_norms, weights), *zip(fi_norms, weights)]:
        n.weight.data.copy_(w)
    default_tile = rope_mod._TILE_ELEMS
    for t in (1, 32, 256, 8192):
        qkv = torch.randn(t, (hq + 2 * hk) * d, device=dev, dtype=dtype) * 3
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
        pos = torch.randint(0, 8192, (t,), device=dev)
        loc = torch.randperm(16384, device=dev)[:t] + 1
        pools = [KVPool(16384, 1, hk, d, dtype, dev) for _ in range(3)]

        def unfused(norms, pool, out=None):  # two norms (and the copies of the strided q/k views), then rope
            return rope_and_store_kv(norms[0](q), norms[1](k), v, pos, rotary.cos_cache, rotary.sin_cache,
                                     pool.k_buffers[0], pool.v_buffers[0], loc, q_out=out)

        def fused(out=None):
            return rope_and_store_kv(q, k, v, pos, rotary.cos_cache, rotary.sin_cache, pools[2].k_buffers[0],
                                     pools[2].v_buffers[0], loc, q_out=out, q_norm_weight=torch_norms[0].weight,
                                     k_norm_weight=torch_norms[1].weight, norm_eps=1e-6)

        outs = [unfused(torch_norms, pools[0]), unfused(fi_norms, pools[1]), fused()]
        for name, i in (("torch norms", 0), ("FlashInfer norms", 1)):
            err = max((outs[2].float() - outs[i].float()).abs().max().item(),
                      (pools[2].k_buffers[0][loc].float() - pools[i].k_buffers[0][loc].float()).abs().max().item())
            print(f"qk-norm+rope T={t:5d}: fused vs {name} + rope: max |Δ| {err:.3e}", flush=True)
        out = torch.empty_like(outs[2])  # graph-safe: q_out given
        graph_unfused = _graph_time_ms(lambda: unfused(fi_norms, pools[1], out))
        tiles = []
        for tile in (2048, 1024, 512, 256):  # heads * head_dim per program
            rope_mod._TILE_ELEMS = tile
            tiles.append(f"tile {tile} {_graph_time_ms(lambda: fused(out)) * 1e3:.1f} us")
        rope_mod._TILE_ELEMS = default_tile
        print(f"qk-norm+rope T={t:5d}, in a CUDA graph: FlashInfer norms + rope {graph_unfused * 1e3:.1f} us; "
              f"fused {', '.join(tiles)}", flush=True)


def check_sampling() -> None:
    from rollout.layers.sampler import Sampler
    from rollout.layers.sampling_info import SamplingBatchInfo, SamplingRow
    from rollout.sampling_params import SamplingParams

    dev = torch.device("cuda")
    for b, v in ((1, 128256), (64, 151936), (256, 128256), (256, 151936)):
        params = [SamplingParams(temperature=0.0, logprobs=0) if i % 8 == 0 else
                  SamplingParams(temperature=(0.6, 1.0, 1.3)[i % 3], logprobs=0,
                                 logprobs_mode="processed" if i % 5 == 0 else "raw") for i in range(b)]
        rows = [SamplingRow(p, seed=1000 + i, output_len=i % 37, prompt_token_ids=[], output_token_ids=[],
                            eos_token_ids=[]) for i, p in enumerate(params)]
        logits = torch.randn(b, v, device=dev) * 4
        info = SamplingBatchInfo.build(rows, v, dev)
        plain, fused = Sampler(), Sampler(fused=True)
        ref, out = plain(logits, info), fused(logits, info)
        same = (ref.next_token_ids == out.next_token_ids).float().mean().item()
        lp_err = (ref.logprobs - out.logprobs).abs().max().item()
        rank_same = torch.equal(ref.ranks, out.ranks)
        print(f"sampling B={b:3d} V={v}: tokens equal {same * 100:.1f}%, max |Δ logprob| {lp_err:.2e}, ranks equal "
              f"{rank_same}; torch {_time_ms(lambda: plain(logits, info)):.3f} ms, "
              f"triton {_time_ms(lambda: fused(logits, info)):.3f} ms", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    check_rope()
    check_qk_norm_rope()
    check_sampling()
