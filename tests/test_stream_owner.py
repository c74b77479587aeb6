"""A stream keeps its engine alive, as a method's generator keeps its object (SGLang's ``Engine.generate(stream=
True)`` is one): a function that starts an engine and returns its stream handed back a stream whose engine the
garbage collector shut down at once ("the engine was shut down" at the first chunk). Once the stream is gone
too, the engine is freed and its subprocesses stop."""

from __future__ import annotations

import asyncio
import gc
import time

from rollout import Engine, SamplingParams

SP = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def _stopped(procs, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(p.is_alive() for p in procs.procs):
            return True
        time.sleep(0.05)
    return False


def test_a_stream_is_all_that_keeps_its_engine(path):
    started = []

    def tokens_stream():
        engine = Engine(path, dtype="float32", device="cpu")
        started.append(engine._procs)
        return engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SP, stream=True)

    stream = tokens_stream()
    gc.collect()
    chunks = list(stream)
    assert chunks[-1].finished and sum(len(c.outputs[0].token_ids) for c in chunks) == 8
    del stream, chunks
    gc.collect()
    assert _stopped(started[0])


def test_an_async_stream_is_all_that_keeps_its_engine(path):
    started = []

    async def main() -> int:
        async def tokens_stream():
            engine = Engine(path, dtype="float32", device="cpu")
            started.append(engine._procs)
            return await engine.async_generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SP, stream=True)

        stream = await tokens_stream()
        gc.collect()
        return sum([len(c.outputs[0].token_ids) async for c in stream])

    assert asyncio.run(main()) == 8
    gc.collect()
    assert _stopped(started[0])
