"""Per-engine IPC addresses, ZeroMQ sockets, and free TCP ports."""

from __future__ import annotations

import os
import shutil
import socket as socket_module
import tempfile
from dataclasses import dataclass

import zmq


@dataclass(frozen=True)
class IPCPaths:
    """``ipc://`` addresses in a private temporary directory, unique to one engine."""

    root: str

    @classmethod
    def create(cls) -> "IPCPaths":
        return cls(tempfile.mkdtemp(prefix="rollout-ipc-"))

    def addr(self, name: str) -> str:
        return f"ipc://{os.path.join(self.root, name)}"

    @property
    def scheduler(self) -> str:
        return self.addr("scheduler")

    @property
    def detokenizer(self) -> str:
        return self.addr("detokenizer")

    @property
    def tokenizer(self) -> str:
        return self.addr("tokenizer")

    @property
    def tp_store(self) -> str:
        return os.path.join(self.root, "tp_store")

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def socket(ctx: zmq.Context, kind: int, addr: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, 0)
    if kind == zmq.PULL:
        sock.setsockopt(zmq.RCVHWM, 0)
    (sock.bind if bind else sock.connect)(addr)
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (for a weight-update group's rendezvous, or a test server): the
    kernel picks it, so concurrent engines and tests never collide on a fixed port."""
    with socket_module.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
