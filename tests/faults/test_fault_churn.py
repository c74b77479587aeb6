"""Churn: clients that disconnect mid-stream or time out, aborts, and pause/continue cycles in every mode,
all at once. Afterwards nothing leaks (running, queued and KV in use back to 0) and the engine's output is
still exactly transformers'."""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from rollout import Engine, SamplingParams
from server_harness import running_server

LONG = {"max_new_tokens": 60, "temperature": 1.0, "ignore_eos": True}


def _wait_idle(get_load, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        load = get_load()
        if (load["running"], load["waiting"], load["kv_used"]) == (0, 0, 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.2)


async def _stream_and_leave(client: httpx.AsyncClient, i: int) -> None:
    body = {"input_ids": [5 + i % 50, 6, 7, 8], "sampling_params": LONG, "stream": True}
    async with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                break  # the client disconnects after its first event


async def _give_up(client: httpx.AsyncClient, i: int) -> None:
    body = {"prompt": [9 + i % 40, 10, 11], **{"max_tokens": 200, "ignore_eos": True}}
    try:
        await client.post("/v1/completions", json=body, timeout=0.3)
    except httpx.TimeoutException:
        pass


async def _pause_cycles(client: httpx.AsyncClient, cycles: int) -> None:
    for i in range(cycles):
        await asyncio.sleep(0.2)
        mode = ("in_place", "retract", "abort")[i % 3]
        assert (await client.post("/pause_generation", json={"mode": mode})).status_code == 200
        await asyncio.sleep(0.1)
        assert (await client.post("/continue_generation", json={})).status_code == 200


async def _http_churn(url: str) -> None:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        jobs = [_stream_and_leave(client, i) for i in range(120)]
        jobs += [_give_up(client, i) for i in range(40)]
        random.Random(0).shuffle(jobs)
        await asyncio.gather(_pause_cycles(client, 9), *jobs)


def test_http_disconnect_and_pause_churn_leaks_nothing(tiny_dir, hf_reference):
    path = tiny_dir("llama")
    with running_server(path) as srv:
        asyncio.run(_http_churn(srv.url))
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            load = _wait_idle(lambda: http.get("/get_server_info").json())
            assert (load["running"], load["waiting"], load["kv_used"]) == (0, 0, 0), load
            got = http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
                "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}).json()
        assert got["output_ids"] == hf_reference(path).greedy([5, 6, 7], 8)


def test_python_api_abandoned_streams_cancellations_aborts_and_pauses_leak_nothing(tiny_dir, hf_reference):
    path = tiny_dir("llama")
    params = SamplingParams(**LONG)
    with Engine(path, dtype="float32", device="cpu") as engine:
        for i in range(30):
            stream = engine.generate(prompt_token_ids=[[5 + i, 6, 7]], sampling_params=params, stream=True)
            next(stream)
            stream.close()  # abandoning the iterator aborts the request
            if i % 10 == 5:
                engine.pause_generation(mode=("in_place", "retract", "abort")[i // 10])
                engine.continue_generation()

        async def cancel_some() -> None:
            tasks = [asyncio.ensure_future(engine.async_generate(prompt_token_ids=[[20 + i, 21]],
                                                                 sampling_params=params)) for i in range(20)]
            await asyncio.sleep(0.3)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(cancel_some())
        for i in range(10):
            stream = engine.generate(prompt_token_ids=[[40 + i, 41]], sampling_params=params, request_id=f"r{i}",
                                     stream=True)
            next(stream)
            engine.abort(f"r{i}")
            assert list(stream)[-1].outputs[0].finish_reason == "abort"
        load = _wait_idle(engine.get_load)
        assert (load["running"], load["waiting"], load["kv_used"]) == (0, 0, 0), load
        assert engine.get_num_unfinished_requests() == 0
        out = engine.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False,
                              sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert out[0].outputs[0].token_ids == hf_reference(path).greedy([5, 6, 7], 8)
