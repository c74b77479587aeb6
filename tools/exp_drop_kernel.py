"""Upper bound of fusing one small kernel away: the decode step of ``gpu_checks/profile_step.py`` with that kernel
not launched at all (its output left as uninitialized memory, so the numbers it computes are garbage; timing only).

    python tools/exp_drop_kernel.py --drop rope --preset qwen3-0.6b --batch 256 --context 600
    python tools/exp_drop_kernel.py --drop none --preset qwen3-0.6b --batch 256 --context 600   # the same, intact

``--drop rope``: q/k norm + rope + KV store (``rope_and_store_kv``: what fusing it into decode attention could
save at most); ``--drop silu_mul``: SiLU·mul (what a GEMM epilogue could save at most). Every other argument goes
to ``profile_step.py``. Compare the "overlapped as the scheduler runs them" lines of runs in turn on one GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _empty_like_out(q: torch.Tensor, *args, q_out: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """``rope_and_store_kv``'s output buffer, no kernel (k_out stays unwritten: use no fresh-KV backend)."""
    return torch.empty(q.shape, dtype=q.dtype, device=q.device) if q_out is None else q_out


def _empty_half(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``silu_and_mul``'s output shape [T, N / 2], no kernel."""
    return torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)


def drop(name: str) -> None:
    """Replace the named kernel's launcher with an allocation (the model imports both at call time)."""
    if name == "rope":
        import rollout.kernels.rope as rope

        rope.rope_and_store_kv = _empty_like_out
    elif name == "silu_mul":
        import flashinfer.activation

        flashinfer.activation.silu_and_mul = _empty_half
    elif name != "none":
        raise ValueError(f"unknown kernel {name!r}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drop", default="rope", choices=["none", "rope", "silu_mul"])
    args, rest = p.parse_known_args()
    drop(args.drop)
    sys.path.insert(0, os.path.join(_ROOT, "gpu_checks"))
    sys.path.insert(0, _ROOT)
    import profile_step

    sys.argv = ["profile_step.py", *rest]
    profile_step.main()


if __name__ == "__main__":
    main()
