"""Who holds a colocated trainer's memory after ``update_weights_from_tensor`` (CUDA IPC), on a GPU.

torch keeps a shared block allocated while a receiver maps it (its IPC reference count; a block the sender
frees meanwhile waits in its "limbo"). The engine keeps mappings of the tensors it is sent twice (a
trainer's parameters) until a push without them or its shutdown. This probe checks each of those points
from the trainer's side, with ``torch.cuda.memory_allocated()`` after ``torch.cuda.ipc_collect()``:

  1. parameters pushed three times, then sleep(2) / wake_up(): the engine still maps them (kept);
  2. a push of fresh copies, then the originals freed: their memory comes back (mappings closed);
  3. the engine shut down, then the copies freed: nothing stays allocated.

    python gpu_checks/check_ipc_lifetime.py
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def allocated_after_collect() -> int:
    gc.collect()
    torch.cuda.ipc_collect()
    return torch.cuda.memory_allocated()


def main() -> int:
    from tests.tiny_models import make_tiny_checkpoint
    from transformers import AutoModelForCausalLM

    from rollout import Engine

    path = make_tiny_checkpoint(os.path.join(tempfile.mkdtemp(), "tiny"), dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ok = True
    with Engine(path, device="cuda", dtype="bfloat16", enable_memory_saver=True, mem_fraction_static=0.2) as engine:
        for _ in range(3):
            engine.update_weights_from_tensor(list(model.named_parameters()))
        engine.sleep(level=2)
        engine.wake_up(tags=["weights"])
        engine.update_weights_from_tensor(list(model.named_parameters()))
        engine.wake_up()
        base = allocated_after_collect()
        print(f"1. pushed 4 times across sleep(2): trainer allocated {base} B (parameters {nbytes} B)")
        copies = [(n, p.detach().clone()) for n, p in model.named_parameters()]
        engine.update_weights_from_tensor(copies)
        del model
        freed = allocated_after_collect()
        print(f"2. fresh copies pushed, originals freed: allocated {freed} B (copies alone {nbytes} B)")
        ok &= freed <= nbytes + (1 << 20)
    del engine
    copies.clear()
    left = allocated_after_collect()
    print(f"3. engine shut down, copies freed: allocated {left} B")
    ok &= left == 0
    print("OK" if ok else "FAILED: the engine kept trainer memory mapped")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
