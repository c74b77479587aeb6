"""The CPU path imports neither triton nor flashinfer: a fresh process builds a ModelRunner on the CPU, runs
a prefill and a decode step through it, and then finds neither package (nor any Triton kernel module) in
``sys.modules``. Piecewise CUDA graphs, asked for, are left off there (the eager forward runs)."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import sys

import torch

from rollout.config import EngineConfig, ModelConfig
from rollout.distributed import TPGroup
from rollout.layers.sampling_info import SamplingRow
from rollout.model_executor.forward_batch import ForwardMode
from rollout.model_executor.model_runner import ModelRunner, StepInput
from rollout.sampling_params import SamplingParams

path = sys.argv[1]
config = EngineConfig(path, dtype="float32", device="cpu", max_running_requests=2, max_total_tokens=64,
                      context_length=32, enable_piecewise_cuda_graph=True)
runner = ModelRunner(config, ModelConfig.from_path(path), TPGroup(), torch.device("cpu"))
prompt = [3, 4, 5, 6]
slots = torch.arange(1, 1 + len(prompt), dtype=torch.int64)
runner.req_to_token.write(0, 0, slots)
row = SamplingRow(SamplingParams(temperature=0.0), seed=0, output_len=0, prompt_token_ids=prompt,
                  output_token_ids=[], eos_token_ids=[])
info = runner.sampling_info([row])
prefill = StepInput(ForwardMode.EXTEND, [0], prompt, list(range(len(prompt))), slots, [len(prompt)], [len(prompt)])
first = runner.run_step(prefill, [0], info).wait().next_token_ids
new_slot = torch.tensor([1 + len(prompt)], dtype=torch.int64)
runner.req_to_token.write_many([0], [len(prompt)], new_slot, device=False)
decode = StepInput(ForwardMode.DECODE, [0], None, [len(prompt)], new_slot, [len(prompt) + 1], [1])
second = runner.run_step(decode, [0], info).wait().next_token_ids
assert first.shape == (1,) and second.shape == (1,)
heavy = sorted(m for m in sys.modules
               if m.split(".")[0] in ("triton", "flashinfer") or m.startswith("rollout.kernels."))
print(type(runner.attn_backend).__name__, runner.graph_runner is None, runner.piecewise_runner is None, heavy)
"""


def test_cpu_forward_imports_neither_triton_nor_flashinfer(tiny_dir):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tiny_dir("llama")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "TorchNativeBackend True True []", proc.stdout
