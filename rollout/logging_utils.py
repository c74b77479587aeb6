"""Logging set-up for the engine's child processes."""

from __future__ import annotations

import logging


def configure(level: str, prefix: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.WARNING),
                        format=f"[%(asctime)s {prefix}] %(message)s", datefmt="%H:%M:%S", force=True)


def dump_stacks_periodically() -> None:
    """With ROLLOUT_STACK_DUMP_S=N set, print every thread's stack every N seconds (hang diagnosis)."""
    import faulthandler
    import os
    import sys

    seconds = float(os.environ.get("ROLLOUT_STACK_DUMP_S", "0") or 0)
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds, repeat=True, file=sys.stderr)
