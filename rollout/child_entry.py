"""The first code an engine subprocess runs (``rollout.launcher.start_child`` starts it).

The child is a fresh interpreter (``python -c``), never a ``multiprocessing`` spawn: the caller's
``__main__`` is never re-imported, so an Engine made at a script's top level, in ``python -c``, from
stdin or in a Jupyter kernel starts the same way. Before anything heavy is imported, a watchdog thread
starts that ends this process as soon as its parent is gone, so no child outlives a parent killed at any
point of start-up. Only the standard library is imported here.

``python -c "import rollout.child_entry as c; c.main()" PARENT_PID BOOT_FD READY_FD``: ``BOOT_FD`` yields
one pickle, ``(target, args)``; the child calls ``target(*args, ready)`` with ``ready`` a
``multiprocessing.connection.Connection`` on ``READY_FD`` (the target reports readiness on it).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time

WATCH_INTERVAL_S = 0.2
PARENT_PID_ENV = "ROLLOUT_PARENT_PID"  # set in each child: the pid of the engine's process


def watch_parent(parent_pid: int, interval_s: float = WATCH_INTERVAL_S) -> None:
    """End this process (exit code 0, no clean-up) as soon as ``parent_pid`` is no longer its parent.

    A parent that dies re-parents its children, so ``os.getppid()`` changes; this is checked once now
    (the parent may already be gone) and then every ``interval_s`` by a daemon thread that sleeps between
    checks."""
    if os.getppid() != parent_pid:
        os._exit(0)

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def orphaned() -> bool:
    """In an engine subprocess: its parent (the engine's process) is gone, so it is about to exit; an error
    seen now is a consequence (a peer rank exited first), not worth reporting."""
    parent = os.environ.get(PARENT_PID_ENV)
    return parent is not None and os.getppid() != int(parent)


def start_failure(e: BaseException) -> dict:
    """The start-up report of a child whose start failed with ``e`` (``rollout.launcher`` raises it again in the
    engine's process: a ValueError as itself, with ``e``'s own message; anything else as a ``ChildStartError``
    carrying the child's traceback). Call it inside the ``except`` block."""
    import traceback

    return {"ok": False, "type": type(e).__name__, "error": str(e), "traceback": traceback.format_exc()}


def exit_now(code: int) -> None:
    """End this process with ``code`` once logs and standard streams are flushed, skipping the interpreter's
    finalization. A scheduler rank calls it when its loop is done: gloo's worker threads outlive
    ``destroy_process_group`` and may still be releasing a tensor when the interpreter finalizes, which
    aborts the process ("terminate called without an active exception", SIGABRT) after a clean shutdown."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more to say
            pass
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    parent_pid, boot_fd, ready_fd = (int(a) for a in (argv or sys.argv[1:])[:3])
    watch_parent(parent_pid)
    os.environ[PARENT_PID_ENV] = str(parent_pid)
    # Ctrl-C reaches the whole process group; the parent shuts its children down itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with os.fdopen(boot_fd, "rb") as f:
        target, args = pickle.load(f)
    from multiprocessing.connection import Connection

    target(*args, Connection(ready_fd, readable=False))
