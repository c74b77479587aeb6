"""Tests for rollout.kernels.decode_gemm (decode-sized projections with the norm, SiLU·mul and residual add
folded in) against torch: RMSNorm's own path (Hugging Face's arithmetic) and float64 matmuls.

Without a CUDA device the kernels run under Triton's CPU interpreter (see ``triton_interpreter``), which
reports 8 SMs here, so the K-split paths (and their in-kernel reduction) run on small shapes.
"""

from __future__ import annotations

from triton_interpreter import DEVICE  # first: sets up the interpreter before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rollout.kernels.decode_gemm import (BLOCK_N, DecodeGemmScratch, choose_split, decode_gemm,  # noqa: E402
                                         start_rows)
from rollout.layers.norm import RMSNorm  # noqa: E402

DTYPE = torch.bfloat16
EPS = 1e-6


def rand(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(DTYPE).to(DEVICE)


def close_bf16(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within one bf16 rounding of a float64 result (the float32 sums differ in order only)."""
    torch.testing.assert_close(actual.double(), expected.double(), atol=2e-2, rtol=1e-2)


def matmul64(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return h.double() @ w.double().T


@pytest.mark.parametrize("m,n,k", [(1, 64, 256), (5, 128, 1024), (16, 256, 512), (64, 64, 1024)])
def test_plain_matches_matmul(m, n, k):
    gen = torch.Generator().manual_seed(m * 7 + n)
    x, w = rand(m, k, gen=gen), rand(n, k, gen=gen, scale=k ** -0.5)
    scratch = DecodeGemmScratch(512, torch.device(DEVICE))
    start_rows(torch.zeros(m, BLOCK_N, dtype=DTYPE, device=DEVICE), scratch)
    y = decode_gemm(x, w, scratch)
    assert y.shape == (m, n) and y.dtype == DTYPE
    close_bf16(y, matmul64(x, w))
    assert not scratch.counters.any(), "the reducing program leaves its counter at zero"


def test_split_rule():
    """Qwen3-0.6B's projections on 132 SMs at 16 rows: what one H100 ran fastest (tools/exp_decode_gemm.py)."""
    assert [choose_split(64, 1024, 16, 132), choose_split(48, 1024, 16, 132, silu_mul=True),
            choose_split(16, 3072, 16, 132)] == [4, 2, 8]
    assert [choose_split(64, 1024, 64, 132), choose_split(16, 3072, 64, 132)] == [2, 4]  # 64 rows: halved
    assert choose_split(1, 256, 4, 8) == 1  # each program keeps at least 256 of K
    assert choose_split(1, 512, 4, 8) == 2 and choose_split(1, 576, 4, 8) == 1  # whole BLOCK_K steps


def test_bias():
    gen = torch.Generator().manual_seed(3)
    x, w, b = rand(3, 128, gen=gen), rand(128, 128, gen=gen, scale=0.1), rand(128, gen=gen)
    scratch = DecodeGemmScratch(512, torch.device(DEVICE))
    close_bf16(decode_gemm(x, w, scratch, bias=b), matmul64(x, w) + b.double())


@pytest.mark.parametrize("m", [1, 7])
def test_norm_prologue_is_rmsnorm(m):
    """h = RMSNorm(x) exactly as the torch RMSNorm computes it, then the matmul."""
    gen = torch.Generator().manual_seed(m)
    hidden, n = 256, 128
    x, w = rand(m, hidden, gen=gen, scale=3.0), rand(n, hidden, gen=gen, scale=hidden ** -0.5)
    norm = RMSNorm(hidden, EPS, DTYPE, DEVICE)
    norm.weight.data.copy_(rand(hidden, gen=gen))
    scratch = DecodeGemmScratch(512, torch.device(DEVICE))
    ss = start_rows(x, scratch)
    torch.testing.assert_close(ss.parts.sum(1), x.float().pow(2).sum(1), rtol=1e-6, atol=1e-5)
    y = decode_gemm(x, w, scratch, norm=(ss, norm.weight, EPS))
    close_bf16(y, matmul64(norm(x), w))


def test_silu_mul_epilogue():
    gen = torch.Generator().manual_seed(11)
    m, hidden, inter = 4, 512, 128
    x, w = rand(m, hidden, gen=gen), rand(2 * inter, hidden, gen=gen, scale=hidden ** -0.5)
    norm_w = rand(hidden, gen=gen)
    scratch = DecodeGemmScratch(512, torch.device(DEVICE))
    ss = start_rows(x, scratch)
    y = decode_gemm(x, w, scratch, norm=(ss, norm_w, EPS), silu_mul=True)
    assert y.shape == (m, inter)
    norm = RMSNorm(hidden, EPS, DTYPE, DEVICE)
    norm.weight.data.copy_(norm_w)
    gate_up = matmul64(norm(x), w).to(DTYPE).float()  # the GEMM's rounded outputs, as silu_and_mul reads them
    gate, up = gate_up.chunk(2, dim=-1)
    close_bf16(y, F.silu(gate) * up)


def test_residual_epilogue_updates_stream_and_sums():
    """r += x @ W.T in place (rounded as a bf16 add), and the new rows' sums of squares for the next norm."""
    gen = torch.Generator().manual_seed(5)
    m, k, hidden = 6, 512, 128
    x, w = rand(m, k, gen=gen), rand(hidden, k, gen=gen, scale=k ** -0.5)
    r = rand(m, hidden, gen=gen, scale=2.0)
    r0 = r.clone()
    scratch = DecodeGemmScratch(512, torch.device(DEVICE))
    ss = start_rows(r, scratch)
    out = decode_gemm(x, w, scratch, residual=(r, ss))
    assert out.data_ptr() == r.data_ptr()
    close_bf16(r, matmul64(x, w) + r0.double())
    assert ss.parts.shape == (m, hidden // BLOCK_N)
    torch.testing.assert_close(ss.parts, r.float().pow(2).view(m, -1, BLOCK_N).sum(-1), rtol=1e-6, atol=1e-5)


def test_start_rows_zeroes_counters():
    scratch = DecodeGemmScratch(256, torch.device(DEVICE))
    scratch.counters.fill_(3)
    start_rows(torch.ones(2, 128, dtype=DTYPE, device=DEVICE), scratch)
    assert not scratch.counters.any()


def test_bad_shapes_are_refused():
    scratch = DecodeGemmScratch(128, torch.device(DEVICE))
    x = torch.zeros(65, 128, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="rows"):
        decode_gemm(x, torch.zeros(64, 128, dtype=DTYPE, device=DEVICE), scratch)
    with pytest.raises(ValueError, match="multiple"):
        decode_gemm(x[:4], torch.zeros(60, 128, dtype=DTYPE, device=DEVICE), scratch)
    with pytest.raises(ValueError, match="width"):
        decode_gemm(x[:4], torch.zeros(192, 128, dtype=DTYPE, device=DEVICE), scratch)


# ------------------------------------------------------------------------------ the model's decode path


def _runner(path: str):
    from rollout.config import EngineConfig, ModelConfig
    from rollout.distributed import TPGroup
    from rollout.model_executor.model_runner import ModelRunner

    config = EngineConfig(path, dtype="bfloat16", device=DEVICE, max_total_tokens=256, max_running_requests=8)
    return ModelRunner(config, ModelConfig.from_path(path), TPGroup(), torch.device(DEVICE))


def _prefill_and_decode(runner, prompts: list[list[int]], next_ids: list[int]) -> torch.Tensor:
    """Prefill ``prompts`` (rows 0..B-1), then one decode step of ``next_ids``: its logits [B, vocab]."""
    from rollout.model_executor.forward_batch import ForwardMode
    from rollout.model_executor.model_runner import StepInput

    rows, positions, slots, lens = list(range(len(prompts))), [], [], [len(p) for p in prompts]
    base = [1 + 32 * r for r in rows]
    for r, p in zip(rows, prompts):
        positions += list(range(len(p)))
        slots += [base[r] + i for i in range(len(p))]
    slots_t = torch.tensor(slots, dtype=torch.int64)
    runner.req_to_token.write_many([r for r, p in zip(rows, prompts) for _ in p], positions, slots_t, device=False)
    runner.forward(StepInput(ForwardMode.EXTEND, rows, [t for p in prompts for t in p], positions, slots_t, lens, lens))
    runner.last_token_ids[rows] = torch.tensor(next_ids, device=DEVICE)
    new_slots = torch.tensor([b + n for b, n in zip(base, lens)])
    runner.req_to_token.write_many(rows, lens, new_slots, device=False)  # as the scheduler's alloc_decode
    step = StepInput(ForwardMode.DECODE, rows, None, lens, new_slots, [n + 1 for n in lens], [1] * len(rows))
    return runner.forward(step)[0].float()


def _hf_logits(path: str, prompts: list[list[int]], next_ids: list[int]) -> torch.Tensor:
    """transformers in float32 on the same (bf16) weights: the last position's logits of prompt + next id."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.cat([model(torch.tensor([p + [t]])).logits[:, -1] for p, t in zip(prompts, next_ids)])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_decode_step_through_decode_gemm_is_as_close_to_transformers_as_the_layer_path(tmp_path, arch):
    """A bf16 decode step with every layer in 6 kernels (norm folded into QKV and gate_up, SiLU·mul into
    gate_up, the residual adds into O and down) against transformers in float32: within the error of the
    same step through the layers' own modules (qwen2: QKV bias; qwen3: q/k norm)."""
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path / arch), arch, dtype=torch.bfloat16, seed=3)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    next_ids = [7, 11, 13]
    hf = _hf_logits(path, prompts, next_ids)
    runner = _runner(path)
    layers = _prefill_and_decode(runner, prompts, next_ids)
    assert runner.model.model.decode_gemm_supported(runner.model_cfg, runner.tp, None)
    runner.model.model.enable_decode_gemm(8, runner.device)
    fused = _prefill_and_decode(runner, prompts, next_ids)
    err_layers = (layers - hf).abs().max().item()
    err_fused = (fused - hf).abs().max().item()
    print(f"{arch}: max |logits - transformers fp32| layers {err_layers:.3e} decode_gemm {err_fused:.3e}")
    assert err_fused <= 1.5 * err_layers + 1e-2, (err_fused, err_layers)
    assert torch.equal(fused.argmax(-1), hf.argmax(-1))
    assert (fused - layers).abs().max().item() < 0.1
