"""Where the trainer of ``rollout-smoke``, ``weight_sync.bench`` and the GRPO bench runs, and over which backend
(``weight_sync.placement``): NCCL cannot put two ranks of one communicator on one GPU, so a trainer without
a GPU of its own shares the engine's first one over gloo."""

from __future__ import annotations

import pytest
import torch

from weight_sync.placement import TrainerPlacement, trainer_placement


@pytest.mark.parametrize("engine, tp, visible, trainer, backend, expected", [
    ("cpu", 1, 0, None, None, TrainerPlacement("cpu", "gloo", False)),
    ("cuda", 1, 2, None, None, TrainerPlacement("cuda:1", "nccl", False)),
    ("cuda", 2, 4, None, None, TrainerPlacement("cuda:2", "nccl", False)),
    ("cuda:1", 2, 4, None, None, TrainerPlacement("cuda:3", "nccl", False)),
    ("cuda", 1, 1, None, None, TrainerPlacement("cuda:0", "gloo", True)),     # one GPU: shared, over gloo
    ("cuda:2", 2, 4, None, None, TrainerPlacement("cuda:2", "gloo", True)),   # no GPU after the engine's
    ("cuda", 2, 4, "cuda:1", None, TrainerPlacement("cuda:1", "gloo", True)),  # on the engine's second rank
    ("cuda", 1, 2, "cpu", None, TrainerPlacement("cpu", "gloo", False)),
    ("cuda", 1, 2, None, "gloo", TrainerPlacement("cuda:1", "gloo", False)),
])
def test_trainer_placement(engine, tp, visible, trainer, backend, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    assert trainer_placement(engine, tp, trainer, backend) == expected


@pytest.mark.parametrize("engine, visible, trainer", [("cuda", 1, None), ("cuda", 2, "cpu"), ("cpu", 0, None),
                                                      ("cuda", 2, "cuda:0")])
def test_nccl_needs_two_gpus(engine, visible, trainer, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    with pytest.raises(ValueError, match="NCCL cannot join a trainer"):
        trainer_placement(engine, 1, trainer, "nccl")


def test_smoke_reports_a_placement_error_before_starting(capsys):
    """``rollout-smoke --backend nccl`` on a CPU engine: exit 2 with the reason, no engine started."""
    from weight_sync.smoke import main

    assert main(["--device", "cpu", "--backend", "nccl"]) == 2
    assert "NCCL cannot join a trainer on cpu" in capsys.readouterr().err


@pytest.mark.parametrize("engine, visible, trainer", [("cpu", 0, "cuda:0"), ("cuda", 2, "cuda:2")])
def test_a_trainer_gpu_the_machine_lacks_is_refused(engine, visible, trainer, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    with pytest.raises(ValueError, match=f"this machine has {visible} CUDA device"):
        trainer_placement(engine, 1, trainer)


@pytest.mark.parametrize("argv, words", [(["--tp-size", "0"], "--tp-size: must be >= 1"),
                                         (["--num-prompts", "0"], "--num-prompts: must be >= 1"),
                                         (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1"),
                                         (["--bucket-mb", "-1"], "--bucket-mb: must be a finite number > 0"),
                                         (["--lr", "nan"], "--lr: must be a finite number > 0")])
def test_smoke_refuses_bad_option_values_as_usage_errors(argv, words, capsys):
    """A bad value is exit 2 with the reason before anything starts (exit 1 means a check failed)."""
    from weight_sync.smoke import main

    with pytest.raises(SystemExit) as info:
        main(["--device", "cpu", *argv])
    assert info.value.code == 2 and words in capsys.readouterr().err


def test_smoke_reports_a_missing_trainer_gpu_before_starting(capsys, monkeypatch):
    from weight_sync.smoke import main

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert main(["--device", "cpu", "--trainer-device", "cuda:0"]) == 2
    assert "this machine has 0 CUDA device(s)" in capsys.readouterr().err
