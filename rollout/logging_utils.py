"""Logging set-up for the engine's child processes."""

from __future__ import annotations

import logging


def configure(level: str, prefix: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.WARNING),
                        format=f"[%(asctime)s {prefix}] %(message)s", datefmt="%H:%M:%S", force=True)
