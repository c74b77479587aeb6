"""Where a trainer process that joins an engine's weight-update group runs, and over which backend.

Used by ``rollout-smoke``, ``python -m weight_sync.bench`` and the GRPO bench's distributed trainer. The
engine's TP ranks run on ``cuda:base`` ... ``cuda:base + tp_size - 1`` (``base`` the index of its device).
NCCL cannot put two ranks of one communicator on one GPU (``ncclInvalidUsage: Duplicate GPU detected``), so
the trainer takes the GPU after the engine's; where there is none it shares the engine's first GPU and the
group runs over gloo, which broadcasts CUDA tensors through host memory (slower, the same bytes arrive).
A CPU engine gets a CPU trainer over gloo.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerPlacement:
    device: str              # the trainer's device, e.g. "cuda:1" or "cpu"
    backend: str             # the weight-update group's backend: "nccl" or "gloo"
    shares_engine_gpu: bool  # the trainer's GPU is one of the engine's TP ranks'


def trainer_placement(engine_device: str, tp_size: int, trainer_device: str | None = None,
                      backend: str | None = None) -> TrainerPlacement:
    """The trainer's device (``trainer_device``, else the GPU after the engine's, else the engine's first GPU,
    else the CPU) and the group's backend (``backend``, else NCCL between different GPUs, gloo otherwise).
    Raises ``ValueError`` for NCCL with a CPU trainer or with a trainer on one of the engine's GPUs, and for a
    trainer GPU this machine does not have."""
    import torch

    if trainer_device is not None:
        wanted = torch.device(trainer_device)
        if wanted.type == "cuda" and (wanted.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"--trainer-device {trainer_device}: this machine has {torch.cuda.device_count()} "
                             "CUDA device(s)")
    engine = torch.device(engine_device)
    if engine.type != "cuda":
        device = trainer_device or "cpu"
        shares = False
    else:
        base = engine.index or 0
        if trainer_device is None:
            after = base + tp_size
            trainer_device = f"cuda:{after}" if torch.cuda.device_count() > after else f"cuda:{base}"
        device = trainer_device
        trainer = torch.device(device)
        shares = trainer.type == "cuda" and base <= (trainer.index or 0) < base + tp_size
    apart = engine.type == "cuda" and device.startswith("cuda") and not shares  # two GPUs: NCCL can join them
    backend = backend or ("nccl" if apart else "gloo")
    if backend == "nccl" and not apart:
        raise ValueError(f"NCCL cannot join a trainer on {device} to an engine on {engine_device} with TP {tp_size}: "
                         "it needs a GPU of its own (pass --trainer-device cuda:N, or --backend gloo)")
    return TrainerPlacement(device, backend, shares)
