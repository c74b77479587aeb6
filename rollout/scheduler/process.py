"""Entry point of a scheduler subprocess (one per TP rank) and its receive/step loop."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import zmq

from rollout.child_entry import exit_now, orphaned, start_failure
from rollout.config import EngineConfig, ModelConfig
from rollout.distributed import TPGroup
from rollout.gc_policy import freeze_heap
from rollout.io_struct import ControlReply, ExpireUpdateSession, SchedulerError
from rollout.ipc import IPCPaths, socket
from rollout.logging_utils import configure, dump_stacks_periodically
from rollout.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)
_LINGER_MS = 2000  # at exit, how long ZeroMQ may take to deliver the last messages


def _device(config: EngineConfig, rank: int) -> torch.device:
    dev = torch.device(config.resolved_device)
    if dev.type == "cuda":
        return torch.device("cuda", (dev.index or 0) + rank)
    return dev


def cpu_threads(tp_size: int) -> int:
    """Torch threads of each CPU scheduler: the usable cores less one (kept for the tokenizer manager, the
    detokenizer and the caller, e.g. a trainer), split over the TP ranks; at least 1. OpenMP threads spin
    while they wait, so threads beyond the free cores make every step wait on a descheduled thread
    (measurements: docs/benchmarks.md, "CPU threads")."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, (cores - 1) // tp_size)


def run_scheduler_process(config: EngineConfig, paths: IPCPaths, rank: int, ready: Any) -> None:
    """Build the scheduler, report readiness (or the start-up error) on ``ready``, then serve."""
    configure(config.log_level, f"TP{rank}")
    dump_stacks_periodically()
    if config.resolved_device == "cpu":
        torch.set_num_threads(cpu_threads(config.tp_size))
    ctx = zmq.Context()
    try:
        device = _device(config, rank)
        tp = TPGroup.init(rank, config.tp_size, config.resolved_dist_backend, paths.tp_store, device)
        model_cfg = ModelConfig.from_path(config.model_path)
        loop = SchedulerLoop(config, paths, ctx, tp, model_cfg, device)
        runner = loop.scheduler.runner
        freeze_heap()  # later collections walk only what serving allocates (rollout.gc_policy)
        ready.send({"ok": True, "context_len": runner.context_len, "num_slots": runner.num_slots})
    except BaseException as e:  # noqa: BLE001 - reported to the engine, which raises it
        ready.send(start_failure(e))
        return
    finally:
        ready.close()
    code = 1  # the loop logged and reported its error
    try:
        _serve(loop, rank)
        code = 0
    finally:
        ctx.destroy(linger=_LINGER_MS)  # what was sent goes out before the hard exit
        exit_now(code)


def _serve(loop: "SchedulerLoop", rank: int) -> None:
    profile_path = os.environ.get("ROLLOUT_PROFILE_DIR")
    if not profile_path:
        loop.run()
        return
    import cProfile  # ROLLOUT_PROFILE_DIR=dir: write a cProfile of this rank's loop there at exit

    profiler = cProfile.Profile()
    try:
        profiler.runcall(loop.run)
    finally:
        profiler.dump_stats(os.path.join(profile_path, f"scheduler-tp{rank}.prof"))


class SchedulerLoop:
    """Receives messages (rank 0 from ZeroMQ, others from rank 0), applies them, steps the scheduler."""

    def __init__(self, config: EngineConfig, paths: IPCPaths, ctx: zmq.Context, tp: TPGroup,
                 model_cfg: ModelConfig, device: torch.device) -> None:
        self.tp = tp
        self.recv = self.to_detok = self.to_tokenizer = None
        if tp.rank == 0:
            self.recv = socket(ctx, zmq.PULL, paths.scheduler, bind=True)
            out_addr = paths.tokenizer if config.skip_tokenizer_init else paths.detokenizer  # no text wanted
            self.to_detok = socket(ctx, zmq.PUSH, out_addr, bind=False)
            self.to_tokenizer = socket(ctx, zmq.PUSH, paths.tokenizer, bind=False)
        send = self.to_detok.send_pyobj if self.to_detok is not None else None
        self.scheduler = Scheduler(config, model_cfg, tp, device, send_output=send, send_reply=self._reply)

    def receive(self) -> list[Any]:
        """All pending messages; rank 0 waits up to 1 s for one when idle, then shares them (with an
        ``ExpireUpdateSession`` when the open update session has timed out: checked here, busy or idle)."""
        msgs: list[Any] = []
        if self.tp.rank == 0:
            timeout = 0 if self.scheduler.busy else 1000
            if self.recv.poll(timeout):
                while True:
                    try:
                        msgs.append(self.recv.recv_pyobj(zmq.NOBLOCK))
                    except zmq.Again:
                        break
            if self.scheduler.weights.updater.session_expired():
                msgs.append(ExpireUpdateSession())
        return self.tp.broadcast_object(msgs)

    def run(self) -> None:
        try:
            while not self.scheduler.stopped:
                with self.scheduler.profiler.scope("receive"):
                    for msg in self.receive():
                        self.scheduler.handle(msg)
                if self.scheduler.busy and not self.scheduler.stopped:
                    self.scheduler.step()
                else:
                    self.scheduler.emit()
        except BaseException as e:  # noqa: BLE001
            if orphaned():  # the engine's process died and a peer rank exited first: exit quietly
                os._exit(0)
            logger.exception("scheduler failed")
            if self.to_tokenizer is not None:
                self.to_tokenizer.send_pyobj(SchedulerError(f"TP rank {self.tp.rank}: {type(e).__name__}: {e}"))
            raise
        finally:
            self.tp.destroy()

    def _reply(self, reply: ControlReply) -> None:
        replies = self.tp.gather_object(reply)
        if self.tp.rank == 0:
            failed = [r for r in replies if not r.ok]
            self.to_tokenizer.send_pyobj(failed[0] if failed else reply)
