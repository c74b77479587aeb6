"""Online fp8 (W8A8) quantization: the quantizers, the Triton kernels (CPU interpreter here), and an
fp8 engine against transformers running the same fake-quantized arithmetic, through weight updates,
fingerprints and tensor parallelism."""

from __future__ import annotations

import copy

from triton_interpreter import DEVICE  # first: sets up the interpreter before triton is imported

import pytest
import torch
import torch.nn.functional as F

import weight_sync
from conftest import prompts_of_lengths
from reference import fp8_quantized_projections
from rollout import Engine, SamplingParams
from rollout.config import EngineConfig
from rollout.layers.quantization import (FP8_MAX, dequantize_fp8_rows, fp8_linear, is_quantized_weight,
                                         quantize_fp8_rows, quantize_fp8_tokens, quantize_fp8_tokens_torch,
                                         reference_linear)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_row_quantization_maps_each_row_max_to_448_and_rounds_to_nearest():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(33, 70, generator=g) * torch.logspace(-3, 2, 33)[:, None]
    w[5] = 0.0
    q, scale = quantize_fp8_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (33,)
    qf = q.float()
    nonzero = [r for r in range(33) if r != 5]
    assert torch.equal(qf[nonzero].abs().amax(1), torch.full((32,), FP8_MAX))
    assert (qf[5] == 0).all() and scale[5] > 0
    exact = w / scale[:, None]
    # nearest fp8 value: no representable neighbour is closer (e4m3: 3 mantissa bits)
    assert ((qf - exact).abs() <= exact.abs() * 2.0**-4 + 2.0**-9).all()
    err = (dequantize_fp8_rows(q, scale) - w).norm() / w.norm()
    assert err < 0.03


def test_a_column_slice_with_its_full_rows_scales_quantizes_like_the_whole():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_fp8_rows(w)
    part, part_scale = quantize_fp8_rows(w[:, 16:48], scale)
    assert torch.equal(_bits(part), _bits(q[:, 16:48])) and part_scale is scale


@pytest.mark.parametrize("rows,cols", [(1, 64), (7, 1000), (3, 2500), (2, 9000)])
def test_triton_per_token_quant_is_bit_identical_to_torch(rows, cols):
    from rollout.kernels.quant import per_token_quant_fp8

    g = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=g) * torch.logspace(-2, 3, rows)[:, None]).bfloat16()
    x[0, :3] = 0.0
    if rows > 2:
        x[2] = 0.0
    x = x.to(DEVICE)
    q, s = per_token_quant_fp8(x)
    q_ref, s_ref = quantize_fp8_tokens_torch(x)
    assert torch.equal(s, s_ref) and s.shape == (rows, 1)
    assert torch.equal(_bits(q), _bits(q_ref))


@pytest.mark.parametrize("m,n,k", [(1, 96, 256), (5, 40, 384), (16, 64, 128), (19, 72, 200)])
def test_triton_fp8_gemm_matches_the_float32_product(m, n, k):
    from rollout.kernels.fp8_gemm import GemmLaunch, fp8_gemm

    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    wq, ws = quantize_fp8_rows(w)
    xq, xs = quantize_fp8_tokens_torch(x)
    ref = reference_linear(x, wq, ws)
    launch = GemmLaunch(block_m=16, block_n=32, block_k=128, num_stages=2)
    out = fp8_gemm(xq.to(DEVICE), xs.to(DEVICE), wq.to(DEVICE), ws.to(DEVICE), torch.float32, launch).cpu()
    assert out.shape == (m, n)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out_bf16 = fp8_gemm(xq.to(DEVICE), xs.to(DEVICE), wq.to(DEVICE), ws.to(DEVICE), torch.bfloat16, launch).cpu()
    assert torch.equal(out_bf16, out.to(torch.bfloat16))
    default = fp8_gemm(xq.to(DEVICE), xs.to(DEVICE), wq.to(DEVICE), ws.to(DEVICE), torch.float32).cpu()
    torch.testing.assert_close(default, ref, rtol=1e-5, atol=1e-5)


def test_fp8_linear_on_cpu_is_the_reference_arithmetic():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 48, generator=g)
    w = torch.randn(24, 48, generator=g) * 0.1
    bias = torch.randn(24, generator=g)
    wq, ws = quantize_fp8_rows(w)
    out = fp8_linear(x, wq, ws, bias)
    assert out.shape == (2, 5, 24)
    torch.testing.assert_close(out, reference_linear(x, wq, ws, bias), rtol=1e-5, atol=1e-5)
    assert (out - F.linear(x, w, bias)).norm() / F.linear(x, w, bias).norm() < 0.05
    xq, xs = quantize_fp8_tokens(x.reshape(-1, 48))
    assert xq.dtype == torch.float8_e4m3fn and xs.shape == (10, 1)


def test_quantized_weight_names():
    assert is_quantized_weight("model.layers.3.self_attn.k_proj.weight")
    assert is_quantized_weight("model.layers.0.mlp.down_proj.weight")
    for name in ("model.layers.0.self_attn.q_proj.bias", "model.embed_tokens.weight", "lm_head.weight",
                 "model.layers.0.input_layernorm.weight", "model.norm.weight"):
        assert not is_quantized_weight(name)


def test_config_refuses_an_unknown_quantization(tiny_dir):
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model_path=tiny_dir("llama"), quantization="int4")


# ---- the engine ---------------------------------------------------------------------------------------


def worst_logprob_gap(hf_model, prompts, outs) -> float:
    """Largest |engine logprob - transformers' teacher-forced logprob| over the engine's output tokens."""
    from reference import hf_logprobs

    worst = 0.0
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0]
        ref = hf_logprobs(hf_model, prompt, got.token_ids)
        worst = max(worst, *(abs(a - b) for a, b in zip(got.token_logprobs, ref)))
    return worst


def load_hf(path: str, fake_quant: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if fake_quant:
        fp8_quantized_projections(model)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fp8_engine_logprobs_match_fake_quantized_transformers(arch, tiny_dir):
    path = tiny_dir(arch)
    prompts = prompts_of_lengths([3, 17, 40, 9], seed=2)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, logprobs=0, seed=5)
    with Engine(path, dtype="float32", device="cpu", quantization="fp8") as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    gap_quant = worst_logprob_gap(load_hf(path, fake_quant=True), prompts, outs)
    gap_plain = worst_logprob_gap(load_hf(path, fake_quant=False), prompts, outs)
    assert gap_quant < 2e-3, gap_quant
    assert gap_plain > 10 * gap_quant, "the engine should differ from the unquantized model by fp8 error"


def test_fp8_weight_updates_fingerprints_and_tp2(tiny_dir):
    """Updates land quantized exactly as the trainer-side fingerprint predicts, at TP=1 and TP=2, and
    both then compute what fake-quantized transformers computes on the new weights."""
    path = tiny_dir("llama")
    model = load_hf(path, fake_quant=False)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=0)
    prompts = prompts_of_lengths([5, 12, 30], seed=4)
    with Engine(path, dtype="float32", device="cpu", quantization="fp8", keep_weight_copy=True) as tp1, \
            Engine(path, dtype="float32", device="cpu", quantization="fp8", tp_size=2) as tp2:
        fp_disk = weight_sync.fingerprint(model, quantization="fp8")
        assert tp1.weights_fingerprint() == tp2.weights_fingerprint() == fp_disk
        assert fp_disk != weight_sync.fingerprint(model)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.05)
        for engine in (tp1, tp2):
            engine.update_weights_from_tensor(list(model.named_parameters()))
        fp_new = weight_sync.fingerprint(model, quantization="fp8")
        assert fp_new != fp_disk
        assert tp1.weights_fingerprint() == tp2.weights_fingerprint() == fp_new
        name = "model.layers.1.mlp.down_proj.weight"
        wq, ws = quantize_fp8_rows(dict(model.named_parameters())[name].detach())
        expect = dequantize_fp8_rows(wq, ws)[:50].tolist()
        assert tp1.get_weights_by_name(name, 50) == tp2.get_weights_by_name(name, 50) == expect
        outs = [e.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False) for e in (tp1, tp2)]
        tp1.rollback_weights()  # the kept copy holds the fp8 values and their scales
        assert tp1.weights_fingerprint() == fp_disk
        tp2.update_weights_from_disk(path)  # a reload quantizes like the first load
        assert tp2.weights_fingerprint() == fp_disk
    for tp_size, out in zip((1, 2), outs):
        reference = copy.deepcopy(model)
        fp8_quantized_projections(reference, tp_size)
        assert worst_logprob_gap(reference, prompts, out) < 2e-3, tp_size
