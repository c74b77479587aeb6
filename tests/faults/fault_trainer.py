"""A trainer process that stops (exits or is killed) at a chosen point of a weight update.

``run(conn, path, port, scenario, timeout, results)`` is the process target: it joins a gloo group with the
engine served on ``conn`` (``weight_sync.remote``), reports ``"joined"`` on ``results``, then:

- ``after_join``: dies with no update sent;
- ``first_bucket_announced``: announces a first bucket (the engine waits for its broadcast), then SIGKILL;
- ``between_per_tensor``: three OpenRLHF-style ``update_weight(..., empty_cache=False)`` calls, then exits
  (the engine holds an open session and nobody will close it);
- ``between_buckets``: one bucket of a two-bucket SGLang update (``flush_cache=False``), then SIGKILL;
- ``second_bucket_announced``: one bucket delivered, the second announced, then SIGKILL.

It reports ``"stopping"`` just before it stops. Nothing here decides pass or fail.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

SCENARIOS = ("after_join", "first_bucket_announced", "between_per_tensor", "between_buckets",
             "second_bucket_announced")


def run(conn: Any, path: str, port: int, scenario: str, timeout: float, results: Any) -> None:
    from transformers import AutoModelForCausalLM

    import weight_sync
    from rollout.weights.buckets import flatten
    from weight_sync.remote import RemoteEngine

    torch.set_num_threads(1)
    engine = RemoteEngine(conn)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    fut = engine.init_process_group("127.0.0.1", port, 1, 2, "g", backend="gloo", timeout=timeout, async_op=True)
    group = weight_sync.init_process_group("127.0.0.1", port, 0, 2, "g", backend="gloo", timeout=timeout)
    fut.result()
    results.put("joined")
    if scenario == "between_per_tensor":
        for name, t in named[:3]:
            ref = engine.update_weight(name, dtype="float32", shape=list(t.shape), empty_cache=False, async_op=True)
            dist.broadcast(t, 0, group=group)
            ref.result()
    elif scenario != "after_join":
        half = len(named) // 2
        buckets = {"first_bucket_announced": [(named[:half], False)], "between_buckets": [(named[:half], True)],
                   "second_bucket_announced": [(named[:half], True), (named[half:], False)]}[scenario]
        for bucket, deliver in buckets:
            ref = engine.update_weights_from_distributed([n for n, _ in bucket], ["float32"] * len(bucket),
                                                         [list(t.shape) for _, t in bucket], "g", flush_cache=False,
                                                         load_format="flattened_bucket", async_op=True)
            if deliver:
                dist.broadcast(flatten([t for _, t in bucket]), 0, group=group)
                ref.result()
        if not buckets[-1][1]:
            time.sleep(1.0)  # the engine is now waiting for the broadcast
    results.put("stopping")
    time.sleep(0.2)
    if scenario == "between_per_tensor":
        os._exit(0)
    os.kill(os.getpid(), signal.SIGKILL)


def push_complete(conn: Any, path: str, port: int, results: Any) -> None:
    """A healthy trainer: one training step and a complete bucketed update (``sync_trainer.run_trainer``)."""
    from sync_trainer import run_trainer

    run_trainer([conn], [1], path, port, [{"kind": "train_and_push", "mode": "bucket"}], results)
