"""When Python's cyclic garbage collector may run in the engine's processes.

A full (generation 2) collection walks every tracked object of the process: after torch, transformers and a
model are loaded that takes tens to hundreds of milliseconds, and it starts whenever enough allocations have
accumulated, e.g. in the middle of submitting a batch of requests (one ``submit`` held 72 ms on the development
CPU; a caller's full collection takes 70-110 ms on an H100 machine, where the bench's first prefill steps once
waited 168 ms for the rest of the batch). So, as vLLM and SGLang do:

- ``freeze_heap()``: each subprocess (and the HTTP server's process), once started, moves everything it has
  allocated so far into the permanent generation (``gc.freeze``), so later collections never walk the model,
  the modules or torch's objects again;
- ``deferred_gc()``: the caller's process submits a batch of requests with the collector paused and lets it
  run afterwards, while the engine works (the caller's own heap is left as it is, not frozen).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


def freeze_heap() -> None:
    """Collect once, then exempt every object alive now from later collections."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def deferred_gc() -> Iterator[None]:
    """Pause automatic collection for the block (if it was on); it is back on, as before, on exit."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
