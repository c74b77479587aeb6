"""Starts an engine's subprocesses, waits for their readiness, and stops them.

Children are fresh interpreters started with ``subprocess`` (``rollout.child_entry``), not
``multiprocessing`` spawns: the caller's ``__main__`` is never re-imported, so an Engine made at a script's
top level (no ``if __name__ == "__main__":``), in ``python -c``, from stdin or in a Jupyter kernel starts
the same way. Each child watches its parent from its first moments and exits when the parent is gone.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable

from rollout.config import EngineConfig
from rollout.ipc import IPCPaths

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 900.0
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ChildStartError(RuntimeError):
    """A subprocess failed while starting; carries its traceback."""


class StartCancelled(RuntimeError):
    """``launch`` was told to stop (its ``cancelled()`` became true) before the subprocesses were ready."""


class ChildProcess:
    """One engine subprocess: ``target(*args, ready)`` run in a fresh interpreter, where ``ready`` is the
    write end of ``self.ready`` (the child reports readiness or its start-up error there). The interface
    is the part of ``multiprocessing.Process`` the engine uses (``pid``, ``name``, ``is_alive``, ``join``,
    ``terminate``, ``kill``, ``exitcode``)."""

    def __init__(self, target: Callable[..., Any], args: tuple, name: str) -> None:
        self.name = name
        boot_r, boot_w = os.pipe()
        ready_r, ready_w = os.pipe()
        code = f"import sys; sys.path.insert(0, {_PACKAGE_ROOT!r}); import rollout.child_entry as c; c.main()"
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-c", code, str(os.getpid()), str(boot_r), str(ready_w)],
                pass_fds=(boot_r, ready_w), stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            os.close(boot_r)
            os.close(ready_w)
        self.ready = Connection(ready_r, writable=False)
        with os.fdopen(boot_w, "wb") as f:  # a child that died at once: BrokenPipeError, seen as its exit
            try:
                pickle.dump((target, args), f)
            except BrokenPipeError:
                pass

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()

    def close(self) -> None:
        self.ready.close()


@dataclass
class EngineProcesses:
    """The running subprocesses of one engine and what they reported when ready."""

    paths: IPCPaths
    procs: list[ChildProcess] = field(default_factory=list)
    context_len: int = 0
    num_slots: int = 0
    exit_codes: dict[str, int | None] = field(default_factory=dict)  # by ``stop``; None: still running after its timeout

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for a clean exit, then terminate, then kill; remove the IPC directory."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.exit_codes = {p.name: p.exitcode for p in self.procs}
        failed = {name: code for name, code in self.exit_codes.items() if code not in (0, None)}
        if failed:
            logger.warning("engine subprocesses ended abnormally at shutdown (exit codes): %s", failed)
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
            p.close()
        self.paths.remove()


def launch(config: EngineConfig, tokenizer: Any = None, cancelled: Callable[[], bool] | None = None
           ) -> EngineProcesses:
    """Start the detokenizer and one scheduler per TP rank; raise with the child's error if one fails.
    ``tokenizer``: the caller's, loaded from ``config``; the detokenizer takes a copy of it (a pickle) rather than
    loading its own, which imports torch and the model's config class. ``cancelled``: polled while the children
    start (every half second at most); once it returns True the start is abandoned (StartCancelled), its children
    stopped and its IPC directory removed, as for a failed start."""
    from rollout.detokenizer import run_detokenizer_process
    from rollout.scheduler.process import run_scheduler_process

    check_devices(config)
    engine = EngineProcesses(IPCPaths.create())
    targets = [(run_scheduler_process, (config, engine.paths, rank), f"rollout-scheduler-tp{rank}")
               for rank in range(config.tp_size)]
    if not config.skip_tokenizer_init:
        targets.append((run_detokenizer_process, (config, engine.paths, _pickled(tokenizer)), "rollout-detokenizer"))
    try:
        for target, args, name in targets:
            _check_cancelled(cancelled)
            engine.procs.append(ChildProcess(target, args, name))
        infos = _wait_ready(engine.procs, cancelled)
    except BaseException:
        for p in engine.procs:
            p.kill()
        engine.stop(timeout_s=0.0)
        raise
    engine.context_len = infos[0]["context_len"]
    engine.num_slots = infos[0]["num_slots"]
    return engine


def _pickled(obj: Any) -> bytes | None:
    """``obj`` pickled, or None when it is None or cannot be pickled (a tokenizer with custom code)."""
    try:
        return None if obj is None else pickle.dumps(obj)
    except Exception:  # noqa: BLE001 - any pickling failure means "load it there"
        return None


def check_devices(config: EngineConfig) -> None:
    """A CUDA device that torch here cannot see is a ValueError before any child starts (the ranks failed with an
    AssertionError or an AttributeError from deep in torch): rank r runs on GPU ``index + r``."""
    import torch

    dev = torch.device(config.resolved_device)
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"device {config.device!r}, but torch {torch.__version__} sees no CUDA GPU "
                         "(torch.cuda.is_available() is False)")
    last = (dev.index or 0) + config.tp_size - 1
    if last >= torch.cuda.device_count():
        raise ValueError(f"tp_size {config.tp_size} on device {config.device!r} needs GPUs {dev.index or 0}..{last}, "
                         f"but torch sees {torch.cuda.device_count()}")


def _check_cancelled(cancelled: Callable[[], bool] | None) -> None:
    if cancelled is not None and cancelled():
        raise StartCancelled("the engine's start was cancelled")


def _wait_ready(procs: list[ChildProcess], cancelled: Callable[[], bool] | None = None) -> list[dict[str, Any]]:
    """Every child's readiness report, in order; the first failure of any child (or ``cancelled()``) raises at
    once."""
    from multiprocessing.connection import wait

    infos: list[dict[str, Any] | None] = [None] * len(procs)
    deadline = time.monotonic() + _START_TIMEOUT_S
    while any(info is None for info in infos):
        _check_cancelled(cancelled)
        if time.monotonic() > deadline:
            raise ChildStartError(f"engine subprocesses did not become ready within {_START_TIMEOUT_S:.0f} s")
        pending = [p.ready for p, info in zip(procs, infos) if info is None]
        wait(pending, timeout=0.5)  # wakes on a report or on a child's exit (its end of the pipe closes)
        for i, proc in enumerate(procs):
            if infos[i] is None:
                infos[i] = _poll_child(proc)
    return infos


def _poll_child(proc: ChildProcess) -> dict[str, Any] | None:
    if proc.ready.poll(0):
        try:
            info = proc.ready.recv()
        except EOFError:
            proc.join(1.0)
            raise ChildStartError(f"{proc.name} exited during start-up (exit code {proc.exitcode})") from None
        if info["ok"]:
            return info
        if info["type"] == "ValueError":  # a bad engine argument or checkpoint: the child's own message
            raise ValueError(info["error"])
        raise ChildStartError(f"{proc.name} failed to start: {info['type']}: {info['error']}\n{info['traceback']}")
    if not proc.is_alive():
        raise ChildStartError(f"{proc.name} exited during start-up (exit code {proc.exitcode})")
    return None
