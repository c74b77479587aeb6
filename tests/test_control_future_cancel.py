"""A control call's Future cannot be cancelled once the call is sent: the engine runs it anyway, so
``cancel()`` returning True lied (a cancelled ``update_weights_from_tensor`` still loaded the weights and set
the version), and its done-callback freed the shared tensors (CPU: the shared-memory segment; CUDA: the
trainer's contiguous copies and the IPC handle cache) while the engine could still be reading them. An
asyncio caller that times out (``wait_for(wrap_future(f))``) cancels the Future the same way."""

from __future__ import annotations

import asyncio

import torch

from rollout import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_a_sent_control_call_is_not_cancellable_and_completes(engine):
    fut = engine.get_load(async_op=True)
    assert fut.cancel() is False
    assert "running" in fut.result(30)


def test_a_timed_out_asyncio_wait_leaves_a_tensor_update_to_complete(engine, path):
    from safetensors.torch import load_file

    before = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY, use_tqdm=False)[0]
    named = list(load_file(f"{path}/model.safetensors").items())
    long = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
    stream = engine.generate(prompt_token_ids=[[5, 6, 8]], sampling_params=long, stream=True)
    next(stream)  # the update waits for this request: the caller's wait times out first
    fut = engine.update_weights_from_tensor(named, weight_version="same-weights", async_op=True)

    async def impatient() -> None:
        try:
            await asyncio.wait_for(asyncio.wrap_future(fut), 0.01)
        except asyncio.TimeoutError:
            pass

    asyncio.run(impatient())
    assert not fut.cancelled()
    assert list(stream)[-1].outputs[0].finish_reason == "length"
    assert fut.result(60)["weight_version"] == "same-weights"
    after = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY, use_tqdm=False)[0]
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
    assert torch.equal(torch.tensor(engine.get_weights_by_name("model.norm.weight", 8)),
                       named[[n for n, _ in named].index("model.norm.weight")][1][:8])
