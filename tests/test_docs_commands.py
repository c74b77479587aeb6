"""Commands the docs give a user, run as written (each test failed before its fix): the tools from the
repository root, the examples on checkpoints unlike the default model, and the bench's --help."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tool", ["tools/bench_fused_moe.py", "tools/bench_fp8_gemm.py"])
def test_tools_run_as_documented_from_the_repository_root(tool):
    """tools/README.md: `python tools/bench_fused_moe.py [--sweep]`, `python tools/bench_fp8_gemm.py [--sweep]`.
    Python puts tools/, not the root, on the path, so `from tools.timing import ...` must not rely on a
    PYTHONPATH (gpu_checks/run_gpu.sh sets one; a user does not). --help stops before anything needs a GPU."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, tool, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage:" in r.stdout


def test_openrlhf_example_trainer_takes_a_tokenizer_without_a_pad_token(tiny_dir):
    """`python examples/openrlhf_style_ray.py --model DIR` with a checkpoint whose tokenizer has no pad token
    (Llama 3, the tests' tiny checkpoints) failed in the trainer's first step ("Asking to pad but the
    tokenizer does not have a padding token"), after the engines and the group were up."""
    trainer = _example("openrlhf_style_ray").Trainer(tiny_dir("llama"), "cpu")
    loss = trainer.train_step(["the sky is blue", "a cat"])
    assert loss == loss and loss > 0


def test_colocated_grpo_runs_on_the_tiny_preset(tmp_path, monkeypatch, capsys):
    """`--preset PRESET` ("a random-weight preset of benchmarks.presets") drew prompt ids from [100, 20000),
    past the vocabulary of the CPU preset `tiny` (1,024 ids): ValueError "prompt token ids out of vocabulary"
    at the first rollout."""
    monkeypatch.setenv("ROLLOUT_CACHE_DIR", str(tmp_path))
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))  # it imports grpo_toy, as `python examples/...` does
    module = _example("colocated_grpo")
    assert module.main(["--preset", "tiny", "--device", "cpu", "--steps", "1", "--prompts-per-step", "1",
                        "--group-size", "2", "--max-new-tokens", "4", "--train-layers", "1"]) == 0
    assert "step   1 |" in capsys.readouterr().out


def test_bench_help_describes_the_bench_in_whole_sentences(capsys):
    """The description was the docstring's first line, cut mid-sentence ("... random token-id prompts,
    ``ignore_eos``, one timed")."""
    from benchmarks.bench import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "one timed ``Engine.generate`` call" in out
