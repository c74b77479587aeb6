"""Tests for rollout.kernels.rope (fused RoPE + KV-pool write) against RotaryEmbedding in torch.

Without a CUDA device the kernel runs under Triton's CPU interpreter (see ``triton_interpreter``).
"""

from __future__ import annotations

import copy

from triton_interpreter import DEVICE  # first: sets up the interpreter before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from rollout.distributed import TPGroup  # noqa: E402
from rollout.layers.linear import QKVParallelLinear  # noqa: E402
from rollout.layers.rotary import RotaryEmbedding  # noqa: E402
from rollout.kernels.rope import rope_and_store_kv  # noqa: E402

MAX_POSITIONS = 4096
NUM_SLOTS = 96
SENTINEL = -3.5
SHAPES = [(4, 2), (8, 8), (3, 1)]


def make_rotary(head_dim: int, dtype: torch.dtype) -> RotaryEmbedding:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return RotaryEmbedding(head_dim, MAX_POSITIONS, inv_freq, 1.0, dtype, DEVICE)


def fused_qkv_views(t: int, hq: int, hk: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    """q [t, hq, d], k/v [t, hk, d] as strided views of one fused qkv output, as LlamaAttention makes them."""
    proj = QKVParallelLinear(8, d, hq, hk, False, TPGroup(), dtype, DEVICE)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype=dtype, device=DEVICE)
    q, k, v = proj.split(qkv)
    return q.reshape(t, hq, d), k.reshape(t, hk, d), v.reshape(t, hk, d)


def reference(rotary: RotaryEmbedding, positions, q, k, dtype):
    """RotaryEmbedding.forward on float32 copies of the model-dtype inputs and caches, cast back once."""
    rotary32 = copy.deepcopy(rotary).float()
    q_ref, k_ref = rotary32(positions, q.float(), k.float())
    return q_ref.to(dtype), k_ref.to(dtype)


def make_case(t: int, hq: int, hk: int, d: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = fused_qkv_views(t, hq, hk, d, dtype, gen)
    positions = torch.randint(0, MAX_POSITIONS, (t,), generator=gen).to(DEVICE)
    loc = (torch.randperm(NUM_SLOTS, generator=gen)[:t] + 1).to(DEVICE)
    k_buf = torch.full((NUM_SLOTS + 1, hk, d), SENTINEL, dtype=dtype, device=DEVICE)
    v_buf = torch.full_like(k_buf, SENTINEL)
    return q, k, v, positions, loc, k_buf, v_buf


def tolerances(dtype: torch.dtype) -> dict:
    # bf16: both sides round one float32 result once; the GPU rounds to nearest even like torch, but
    # Triton's interpreter truncates fp32 -> bf16, so allow 1 ulp
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("hq,hk", SHAPES)
def test_matches_rotary_embedding(dtype, head_dim, hq, hk):
    t = 37
    rotary = make_rotary(head_dim, dtype)
    q, k, v, positions, loc, k_buf, v_buf = make_case(t, hq, hk, head_dim, dtype, seed=hq * 100 + head_dim)
    assert not q.is_contiguous() and q.storage_offset() == 0 and k.storage_offset() == hq * head_dim
    q_out = rope_and_store_kv(q, k, v, positions, rotary.cos_cache, rotary.sin_cache, k_buf, v_buf, loc)
    q_ref, k_ref = reference(rotary, positions, q, k, dtype)
    assert q_out.shape == q.shape and q_out.dtype == dtype and q_out.is_contiguous()
    torch.testing.assert_close(q_out, q_ref, **tolerances(dtype))
    torch.testing.assert_close(k_buf[loc], k_ref, **tolerances(dtype))
    torch.testing.assert_close(v_buf[loc], v, atol=0, rtol=0)


@pytest.mark.parametrize("t,hq,hk,head_dim", [(1, 32, 8, 128), (3, 40, 20, 128), (2, 72, 36, 64)])
def test_many_heads_span_several_programs(t, hq, hk, head_dim):
    """Head counts above one program's tile (partial last q and k blocks), down to a single token."""
    dtype = torch.bfloat16
    rotary = make_rotary(head_dim, dtype)
    q, k, v, positions, loc, k_buf, v_buf = make_case(t, hq, hk, head_dim, dtype, seed=hq + t)
    q_out = rope_and_store_kv(q, k, v, positions, rotary.cos_cache, rotary.sin_cache, k_buf, v_buf, loc)
    q_ref, k_ref = reference(rotary, positions, q, k, dtype)
    torch.testing.assert_close(q_out, q_ref, **tolerances(dtype))
    torch.testing.assert_close(k_buf[loc], k_ref, **tolerances(dtype))
    torch.testing.assert_close(v_buf[loc], v, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_kv_rows_untouched(dtype):
    hq, hk, d, t = 4, 2, 64, 20
    rotary = make_rotary(d, dtype)
    q, k, v, positions, loc, k_buf, v_buf = make_case(t, hq, hk, d, dtype, seed=7)
    rope_and_store_kv(q, k, v, positions, rotary.cos_cache, rotary.sin_cache, k_buf, v_buf, loc)
    untouched = torch.ones(NUM_SLOTS + 1, dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert (k_buf[untouched] == SENTINEL).all() and (v_buf[untouched] == SENTINEL).all()
    assert not (k_buf[loc] == SENTINEL).all()


def test_writes_given_q_out_in_place():
    hq, hk, d, t, dtype = 8, 8, 128, 5, torch.bfloat16
    rotary = make_rotary(d, dtype)
    q, k, v, positions, loc, k_buf, v_buf = make_case(t, hq, hk, d, dtype, seed=11)
    q_out = torch.full((t, hq, d), SENTINEL, dtype=dtype, device=DEVICE)
    returned = rope_and_store_kv(q, k, v, positions, rotary.cos_cache, rotary.sin_cache, k_buf, v_buf, loc,
                                 q_out=q_out)
    assert returned is q_out
    torch.testing.assert_close(q_out, reference(rotary, positions, q, k, dtype)[0], **tolerances(dtype))


def test_close_to_torch_bf16_path():
    """Against the production path (RotaryEmbedding in bf16, rounding each intermediate): a few bf16 ulps."""
    hq, hk, d, t, dtype = 4, 2, 128, 24, torch.bfloat16
    rotary = make_rotary(d, dtype)
    q, k, v, positions, loc, k_buf, v_buf = make_case(t, hq, hk, d, dtype, seed=3)
    q_out = rope_and_store_kv(q, k, v, positions, rotary.cos_cache, rotary.sin_cache, k_buf, v_buf, loc)
    q_torch, k_torch = rotary(positions, q, k)
    torch.testing.assert_close(q_out, q_torch, atol=4e-2, rtol=2e-2)
    torch.testing.assert_close(k_buf[loc], k_torch, atol=4e-2, rtol=2e-2)


# The hardware conversion must round to nearest exactly as torch does (tests/triton_interpreter makes the
# CPU interpreter's float8 casts do the same; gpu_checks/run_gpu.sh kernels runs this file on a GPU).
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_float8_kv_buffers_get_k_and_v_rounded_once(fp8, model_dtype):
    """An fp8 KV pool: rope(k) computed in float32 and v, each rounded once to the float8 type."""
    hq, hk, d, t = 8, 2, 128, 29
    rotary = make_rotary(d, model_dtype)
    q, k, v, positions, loc, _, _ = make_case(t, hq, hk, d, model_dtype, seed=5)
    k_buf = torch.zeros((NUM_SLOTS + 1, hk, d), dtype=fp8, device=DEVICE)
    v_buf = torch.zeros_like(k_buf)
    q_out = rope_and_store_kv(q, k, v, positions, rotary.cos_cache, rotary.sin_cache, k_buf, v_buf, loc)
    rotary32 = copy.deepcopy(rotary).float()
    q_ref, k_ref = rotary32(positions, q.float(), k.float())
    torch.testing.assert_close(q_out, q_ref.to(model_dtype), **tolerances(model_dtype))
    torch.testing.assert_close(k_buf[loc].float(), k_ref.to(fp8).float(), atol=0, rtol=0)
    torch.testing.assert_close(v_buf[loc].float(), v.float().to(fp8).float(), atol=0, rtol=0)
    assert (k_buf[0] == 0).all() and int((k_buf.float().abs().sum((1, 2)) > 0).sum()) == t


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_k_out_gets_rope_k_unrounded_beside_a_float8_pool(model_dtype):
    """With k_out: rope(k) in the model dtype (what a fresh prefill attends to) and, in the pool, the same
    values rounded once to float8; q and v as without it."""
    hq, hk, d, t = 8, 2, 128, 29
    rotary = make_rotary(d, model_dtype)
    q, k, v, positions, loc, _, _ = make_case(t, hq, hk, d, model_dtype, seed=6)
    k_buf = torch.zeros((NUM_SLOTS + 1, hk, d), dtype=torch.float8_e4m3fn, device=DEVICE)
    v_buf = torch.zeros_like(k_buf)
    k_out = torch.full(k.shape, SENTINEL, dtype=model_dtype, device=DEVICE)
    q_out = rope_and_store_kv(q, k, v, positions, rotary.cos_cache, rotary.sin_cache, k_buf, v_buf, loc,
                              k_out=k_out)
    rotary32 = copy.deepcopy(rotary).float()
    q_ref, k_ref = rotary32(positions, q.float(), k.float())
    torch.testing.assert_close(q_out, q_ref.to(model_dtype), **tolerances(model_dtype))
    torch.testing.assert_close(k_out, k_ref.to(model_dtype), **tolerances(model_dtype))
    k_pool = k_buf[loc].float()  # the pool holds k_out's values rounded once more, to float8
    torch.testing.assert_close(k_pool, k_ref.to(torch.float8_e4m3fn).float(), atol=0, rtol=0)
    torch.testing.assert_close(v_buf[loc].float(), v.float().to(torch.float8_e4m3fn).float(), atol=0, rtol=0)
    with pytest.raises(ValueError, match="k_out"):
        rope_and_store_kv(q, k, v, positions, rotary.cos_cache, rotary.sin_cache, k_buf, v_buf, loc,
                          k_out=k_out[:, :1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,hq,hk,head_dim", [(37, 4, 2, 128), (3, 40, 20, 128), (5, 8, 8, 64)])
def test_qk_norm_fused_before_rope(dtype, t, hq, hk, head_dim):
    """Qwen3's q/k norm in the kernel: rope(RMSNorm(q)) and rope(RMSNorm(k)) as the torch path computes the
    norms (RMSNorm's float32 statistics and two roundings), k into the pool and k_out, v copied untouched."""
    from rollout.layers.norm import RMSNorm

    eps = 1e-6
    rotary = make_rotary(head_dim, dtype)
    q, k, v, positions, loc, k_buf, v_buf = make_case(t, hq, hk, head_dim, dtype, seed=hq * 7 + t)
    q, k = q * 3, k * 0.25  # statistics away from 1, so a missing norm shows
    gen = torch.Generator().manual_seed(t)
    q_norm, k_norm = RMSNorm(head_dim, eps, dtype, DEVICE), RMSNorm(head_dim, eps, dtype, DEVICE)
    q_norm.weight.data.copy_(torch.rand(head_dim, generator=gen) + 0.5)
    k_norm.weight.data.copy_(torch.rand(head_dim, generator=gen) + 0.5)
    k_out = torch.full(k.shape, SENTINEL, dtype=dtype, device=DEVICE)
    q_out = rope_and_store_kv(q, k, v, positions, rotary.cos_cache, rotary.sin_cache, k_buf, v_buf, loc,
                              k_out=k_out, q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight, norm_eps=eps)
    q_ref, k_ref = reference(rotary, positions, q_norm(q), k_norm(k), dtype)
    torch.testing.assert_close(q_out, q_ref, **tolerances(dtype))
    torch.testing.assert_close(k_buf[loc], k_ref, **tolerances(dtype))
    torch.testing.assert_close(k_out, k_ref, **tolerances(dtype))
    torch.testing.assert_close(v_buf[loc], v, atol=0, rtol=0)
    unnormed, _ = reference(rotary, positions, q, k, dtype)
    assert (q_out.float() - unnormed.float()).abs().max() > 0.5


def test_qk_norm_weights_checked():
    hq, hk, d, t, dtype = 4, 2, 64, 3, torch.float32
    rotary = make_rotary(d, dtype)
    q, k, v, positions, loc, k_buf, v_buf = make_case(t, hq, hk, d, dtype, seed=1)
    w = torch.ones(d, device=DEVICE)
    args = (q, k, v, positions, rotary.cos_cache, rotary.sin_cache, k_buf, v_buf, loc)
    with pytest.raises(ValueError, match="both"):
        rope_and_store_kv(*args, q_norm_weight=w)
    with pytest.raises(ValueError, match="norm weights"):
        rope_and_store_kv(*args, q_norm_weight=w, k_norm_weight=torch.ones(d + 2, device=DEVICE))
