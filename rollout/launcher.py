"""Starts an engine's subprocesses with ``spawn``, waits for their readiness, and stops them."""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass, field
from typing import Any

from rollout.config import EngineConfig
from rollout.ipc import IPCPaths

_START_TIMEOUT_S = 900.0


class ChildStartError(RuntimeError):
    """A subprocess failed while starting; carries its traceback."""


@dataclass
class EngineProcesses:
    """The running subprocesses of one engine and what they reported when ready."""

    paths: IPCPaths
    procs: list[Any] = field(default_factory=list)
    context_len: int = 0
    num_slots: int = 0

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for a clean exit, then terminate, then kill; remove the IPC directory."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        self.paths.remove()


def launch(config: EngineConfig) -> EngineProcesses:
    """Start the detokenizer and one scheduler per TP rank; raise with the child's error if one fails."""
    from rollout.detokenizer import run_detokenizer_process
    from rollout.scheduler.process import run_scheduler_process

    ctx = mp.get_context("spawn")
    engine = EngineProcesses(IPCPaths.create())
    pipes = []
    targets = [(run_scheduler_process, (config, engine.paths, rank), f"rollout-scheduler-tp{rank}")
               for rank in range(config.tp_size)]
    if not config.skip_tokenizer_init:
        targets.append((run_detokenizer_process, (config, engine.paths), "rollout-detokenizer"))
    try:
        for target, args, name in targets:
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=target, args=(*args, writer), name=name, daemon=True)
            proc.start()
            writer.close()
            engine.procs.append(proc)
            pipes.append((reader, proc))
        infos = _wait_ready(pipes)
    except BaseException:
        for p in engine.procs:
            if p.is_alive():
                p.kill()
        engine.stop(timeout_s=0.0)
        raise
    engine.context_len = infos[0]["context_len"]
    engine.num_slots = infos[0]["num_slots"]
    return engine


def _wait_ready(pipes: list[tuple[Any, Any]]) -> list[dict[str, Any]]:
    """Every child's readiness report, in order; the first failure of any child raises at once."""
    infos: list[dict[str, Any] | None] = [None] * len(pipes)
    deadline = time.monotonic() + _START_TIMEOUT_S
    while any(info is None for info in infos):
        if time.monotonic() > deadline:
            raise ChildStartError(f"engine subprocesses did not become ready within {_START_TIMEOUT_S:.0f} s")
        for i, (reader, proc) in enumerate(pipes):
            if infos[i] is None:
                infos[i] = _poll_child(reader, proc)
        time.sleep(0.05)
    return infos


def _poll_child(reader: Any, proc: Any) -> dict[str, Any] | None:
    if reader.poll(0):
        try:
            info = reader.recv()
        except EOFError:
            info = {"ok": False, "error": f"{proc.name} exited during start-up (exit code {proc.exitcode})"}
        if info.get("ok"):
            return info
        if info.get("type") == "ValueError":
            raise ValueError(info["error"])
        raise ChildStartError(f"{proc.name} failed to start: {info['error']}\n{info.get('traceback', '')}")
    if not proc.is_alive():
        raise ChildStartError(f"{proc.name} exited during start-up (exit code {proc.exitcode})")
    return None
