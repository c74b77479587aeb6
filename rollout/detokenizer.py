"""Detokenizer subprocess: turns each request's new token ids into text, incrementally and UTF-8 safe."""

from __future__ import annotations

import pickle
from typing import Any

import zmq

from rollout.child_entry import start_failure
from rollout.config import EngineConfig
from rollout.detokenize_state import IncrementalDetokenizer
from rollout.gc_policy import freeze_heap
from rollout.io_struct import BatchTokenOut, ShutdownReq, TokenOut
from rollout.ipc import IPCPaths, socket
from rollout.logging_utils import configure


def run_detokenizer_process(config: EngineConfig, paths: IPCPaths, pickled_tokenizer: bytes | None,
                            ready: Any) -> None:
    """Report readiness on ``ready``, then forward outputs with text filled in. ``pickled_tokenizer``: the engine's
    tokenizer; None: load it from ``config``."""
    configure(config.log_level, "Detokenizer")
    ctx = zmq.Context()
    try:
        if pickled_tokenizer is not None:
            tokenizer = pickle.loads(pickled_tokenizer)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path or config.model_path)
        recv = socket(ctx, zmq.PULL, paths.detokenizer, bind=True)
        send = socket(ctx, zmq.PUSH, paths.tokenizer, bind=False)
        freeze_heap()  # later collections walk only what serving allocates (rollout.gc_policy)
        ready.send({"ok": True})
    except BaseException as e:  # noqa: BLE001
        ready.send(start_failure(e))
        return
    finally:
        ready.close()
    Detokenizer(tokenizer).serve(recv, send)


class Detokenizer:
    """Keeps one ``IncrementalDetokenizer`` per unfinished request."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, IncrementalDetokenizer | None] = {}  # None: detokenize off

    def serve(self, recv: zmq.Socket, send: zmq.Socket) -> None:
        while True:
            msg = recv.recv_pyobj()
            if isinstance(msg, ShutdownReq):
                return
            if isinstance(msg, BatchTokenOut):
                for out in msg.outs:
                    self.render(out)
            send.send_pyobj(msg)

    def render(self, out: TokenOut) -> None:
        """Set ``out.text``: the request's next text delta ("" for a request with ``detokenize`` off)."""
        finished = out.finished is not None
        if out.spec is not None:  # a request's first message
            spec = out.spec
            self.states[out.rid] = IncrementalDetokenizer(
                self.tokenizer, spec.skip_special_tokens, spec.spaces_between_special_tokens, spec.stop,
                spec.include_stop_str_in_output, spec.prompt_tail, spec.min_new_tokens) if spec.detokenize else None
        state = self.states.pop(out.rid) if finished else self.states[out.rid]
        out.text = state.step(out.token_ids, finished, out.finished.matched if finished else None) if state else ""
