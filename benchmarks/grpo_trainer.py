"""The GRPO bench's pushes between RL steps (``--rl-sync``), as the two kinds of trainer run them.

- ``tensor``: a colocated trainer's tensors on the engine's device, pushed with ``update_weights_from_tensor``
  (CUDA IPC on a GPU, shared memory on the CPU).
- ``distributed``: a trainer in its own process on another device (the GPU after the engine's GPUs; the CPU
  with gloo) that joins the engine in a weight-update group (``init_process_group``) and
  broadcasts bucketed updates (``WeightSender``: ``update_weights_from_distributed``), as an OpenRLHF-style
  trainer does. It drives the engine through ``weight_sync.remote`` (the engine serves its methods over a pipe).

Either way the weights are random with the model's shapes in transformers' naming (``trainer_tensors``), the
same tensors every push; each push bumps the engine's weight version. ``make_pusher`` returns a context
manager whose value has ``push()`` and ``verify()`` (the engine's weight fingerprint equals the trainer's);
the distributed trainer leaves the group and exits on exit.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import traceback
from typing import Any, Iterator

from rollout.ipc import free_port
from weight_sync.sender import DEFAULT_BUCKET_BYTES

GROUP_NAME = "grpo_bench"


@contextlib.contextmanager
def make_pusher(rl_sync: str, engine: Any, model_path: str, device: str, dtype: str, tp_size: int,
                trainer_device: str | None = None) -> Iterator[Any]:
    """A context whose value's ``push()`` puts new weights into ``engine`` and returns when they are in."""
    if rl_sync == "tensor":
        yield ColocatedTrainer(engine, model_path, device, dtype)
        return
    if rl_sync != "distributed":
        raise ValueError(f"rl_sync must be 'tensor' or 'distributed', got {rl_sync!r}")
    place = distributed_placement(device, tp_size, trainer_device)
    trainer = DistributedTrainer(engine, model_path, dtype, tp_size, place.device, place.backend)
    try:
        yield trainer
    finally:
        trainer.close()


def distributed_placement(device: str, tp_size: int, trainer_device: str | None = None) -> Any:
    """The trainer's ``weight_sync.placement.TrainerPlacement``: by default the GPU after the engine's, or the
    CPU for a CPU engine. Raises when the default has none: a trainer sharing the engine's GPU would broadcast
    over gloo through host memory, which is not the transfer this bench means to time (``trainer_device`` the
    engine's GPU asks for that explicitly)."""
    from weight_sync.placement import trainer_placement

    place = trainer_placement(device, tp_size, trainer_device)
    if trainer_device is None and place.shares_engine_gpu:
        raise ValueError(f"--rl-sync distributed needs a GPU for the trainer after the engine's, none is visible "
                         f"besides {place.device} (use --rl-sync tensor on one GPU, or --trainer-device)")
    return place


class ColocatedTrainer:
    """Tensors on the engine's device, pushed with ``update_weights_from_tensor``."""

    def __init__(self, engine: Any, model_path: str, device: str, dtype: str) -> None:
        import torch

        from benchmarks.colocated_push import trainer_tensors

        self.engine = engine
        self.named = trainer_tensors(model_path, device, getattr(torch, dtype))

    def push(self) -> None:
        self.engine.update_weights_from_tensor(self.named)

    def verify(self) -> bool:
        import weight_sync

        return self.engine.weights_fingerprint() == weight_sync.fingerprint(self.named)


class DistributedTrainer:
    """A trainer process on ``trainer_device`` in a weight-update group (``backend``) with ``engine``;
    ``push()`` sends one bucketed update and returns its seconds; ``verify()`` compares fingerprints there;
    ``close()`` leaves the group and joins the process."""

    def __init__(self, engine: Any, model_path: str, dtype: str, tp_size: int, trainer_device: str, backend: str,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout: float = 600.0) -> None:
        from weight_sync.remote import serve_engine

        ctx = mp.get_context("spawn")
        port = free_port()
        mine, theirs = ctx.Pipe()
        serve_engine(engine, mine)
        self._ctl, ctl = ctx.Pipe()
        self.timeout = timeout
        self._proc = ctx.Process(target=_trainer_main, daemon=True, name="grpo-trainer", args=(
            theirs, ctl, model_path, trainer_device, backend, dtype, tp_size, port, bucket_bytes, timeout))
        self._proc.start()
        theirs.close()  # the child's ends: once it exits, the engine's server thread sees the pipe close
        ctl.close()
        try:
            self._expect("ready")
        except BaseException:
            self.close(graceful=False)
            raise

    def push(self) -> float:
        self._ctl.send("push")
        return self._expect("pushed")

    def verify(self) -> bool:
        self._ctl.send("verify")
        return self._expect("verified")

    def close(self, graceful: bool = True) -> None:
        """Leave the group and end the process (``graceful=False``: end it without a word, after a failure)."""
        if graceful and self._proc.is_alive():
            try:
                self._ctl.send("stop")
                self._expect("stopped")
            finally:
                self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    def _expect(self, what: str) -> Any:
        if not self._ctl.poll(self.timeout):
            raise TimeoutError(f"the GRPO trainer did not answer {what!r} within {self.timeout:.0f} s")
        kind, value = self._ctl.recv()
        if kind != what:
            raise RuntimeError(f"the GRPO trainer failed (expected {what!r}): {value}")
        return value


def _trainer_main(engine_conn: Any, ctl: Any, model_path: str, device: str, backend: str, dtype: str, tp_size: int,
                  port: int, bucket_bytes: int, timeout: float) -> None:
    """The trainer process: join the group, then answer ``"push"`` and ``"verify"`` until ``"stop"``."""
    try:
        import torch

        import weight_sync
        from benchmarks.colocated_push import trainer_tensors
        from weight_sync.remote import RemoteEngine

        torch.set_num_threads(1)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        engine = RemoteEngine(engine_conn)
        named = trainer_tensors(model_path, device, getattr(torch, dtype))
        group = weight_sync.join_engines([engine], GROUP_NAME, backend=backend, tp_size=tp_size, port=port,
                                         timeout=timeout)
        sender = weight_sync.WeightSender([engine], group, GROUP_NAME, bucket_bytes=bucket_bytes)
        ctl.send(("ready", None))
        while (cmd := ctl.recv()) != "stop":
            if cmd == "push":
                ctl.send(("pushed", sender.send(named).seconds))
            else:  # "verify"
                ctl.send(("verified", engine.weights_fingerprint() == weight_sync.fingerprint(named)))
        weight_sync.leave_engines([engine], group, GROUP_NAME)
        ctl.send(("stopped", None))
    except Exception as e:  # noqa: BLE001 - reported to the bench
        ctl.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
