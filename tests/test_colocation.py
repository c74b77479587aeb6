"""Colocated training on CPU: sleep / wake_up (vLLM) and release / resume_memory_occupation (SGLang) release
the KV cache and the weights for real (the scheduler's resident memory drops), come back exact, and every
misuse is a clear error that loses nothing. The same calls over HTTP."""

from __future__ import annotations

import psutil
import pytest
import torch

from rollout import Engine, SamplingParams
from rollout.client import EngineClient
from server_harness import running_server

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 3, 250, 17, 9]]


@pytest.fixture(scope="module")
def sleepy(path):
    with Engine(path, dtype="float32", device="cpu", enable_memory_saver=True, cpu_kv_cache_gb=0.25) as e:
        yield e


def _greedy(engine) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY,
                                                            use_tqdm=False)]


def _changed_model(path: str, scale: float):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model


def test_sleep_level_1_releases_memory_and_wakes_up_exact(sleepy, path, hf_reference):
    hf = hf_reference(path)
    assert _greedy(sleepy) == [hf.greedy(p, 8) for p in PROMPTS]
    fp = sleepy.weights_fingerprint()
    sched = psutil.Process(sleepy._procs.procs[0].pid)
    info = sleepy.get_server_info()
    weight_bytes = sum(p.numel() * 4 for p in hf.model.parameters())
    kv_bytes = info["kv_total"] * 2 * 2 * 2 * 16 * 4  # slots x (k, v) x layers x kv heads x head dim x fp32
    before = sched.memory_info().rss
    state = sleepy.sleep(level=1)
    dropped = before - sched.memory_info().rss
    assert state == {"sleeping": True, "released": ["weights", "kv_cache", "cuda_graph"], "weights_kept": True}
    assert sleepy.is_sleeping()
    assert dropped >= 0.8 * (weight_bytes + kv_bytes), (dropped, weight_bytes, kv_bytes)
    with pytest.raises(RuntimeError, match="asleep.*wake_up"):
        sleepy.generate(prompt_token_ids=PROMPTS[:1], use_tqdm=False)
    assert sleepy.sleep(level=1) == state  # vLLM: sleeping again warns and does nothing
    with pytest.raises(ValueError, match="weights' memory is released"):
        sleepy.update_weights_from_tensor(list(_changed_model(path, 1.1).named_parameters()))
    for read in (lambda: sleepy.get_weights_by_name("model.norm.weight", 4), sleepy.weights_fingerprint):
        with pytest.raises(ValueError, match="before reading them"):  # the released storage crashed the scheduler
            read()
    assert sleepy.wake_up()["sleeping"] is False and not sleepy.is_sleeping()
    assert sleepy.wake_up()["sleeping"] is False  # vLLM: waking an awake engine warns and does nothing
    for handle in (sleepy, EngineClient("http://127.0.0.1:1")):  # docs/colocation.md: an empty list is an error
        with pytest.raises(ValueError, match="non-empty"):  # (the client's empty query woke everything)
            handle.wake_up([])
    with pytest.raises(ValueError, match="awake"):
        sleepy.resume_memory_occupation()  # SGLang's call refuses
    assert sleepy.weights_fingerprint() == fp, "the refused push changed nothing"
    assert _greedy(sleepy) == [hf.greedy(p, 8) for p in PROMPTS]
    assert sleepy.get_server_info()["kv_used"] == 0


def test_sleep_level_2_then_vllm_order_wake_weights_push_wake_kv(sleepy, path, hf_reference):
    from reference import hf_greedy

    import weight_sync

    model = _changed_model(path, 0.9)
    sleepy.sleep(level=2)
    assert sleepy.wake_up(tags=["weights"])["released"] == ["kv_cache", "cuda_graph"]
    with pytest.raises(RuntimeError, match="asleep"):
        sleepy.generate(prompt_token_ids=PROMPTS[:1], use_tqdm=False)
    result = sleepy.update_weights_from_tensor(list(model.named_parameters()))
    assert result["complete"]
    assert sleepy.wake_up(tags=["kv_cache"])["sleeping"] is False  # the graphs' tag comes back with it
    assert sleepy.weights_fingerprint() == weight_sync.fingerprint(model)
    assert _greedy(sleepy) == [hf_greedy(model, p, 8) for p in PROMPTS]
    sleepy.update_weights_from_disk(path)  # back to the checkpoint for the next tests
    hf = hf_reference(path)
    assert _greedy(sleepy) == [hf.greedy(p, 8) for p in PROMPTS]


def test_released_weights_stay_refused_until_a_complete_push(sleepy, path, hf_reference):
    sleepy.release_memory_occupation(["weights"])
    sleepy.resume_memory_occupation(["weights"])
    state = sleepy.get_weight_state()
    assert state["state"] == "inconsistent" and "released without a copy" in state["reason"]
    with pytest.raises(RuntimeError, match="released without a copy"):
        sleepy.generate(prompt_token_ids=PROMPTS[:1], use_tqdm=False)
    model = _changed_model(path, 1.0)
    named = list(model.named_parameters())
    sleepy.update_weights_from_tensor(named[:3], flush_cache=True)  # a partial push does not make them whole
    assert sleepy.get_weight_state()["state"] == "inconsistent"
    sleepy.update_weights_from_tensor(named)
    assert sleepy.get_weight_state()["state"] == "consistent"
    hf = hf_reference(path)
    assert _greedy(sleepy) == [hf.greedy(p, 8) for p in PROMPTS]


def test_kv_cache_alone_and_bad_tags(sleepy, path, hf_reference):
    sleepy.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    assert sleepy.get_server_info()["cached_tokens"] > 0
    assert sleepy.release_memory_occupation(["kv_cache"])["released"] == ["kv_cache"]
    assert sleepy.get_server_info()["cached_tokens"] == 0, "the prefix cache goes with the KV cache"
    for bad, words in (([], "non-empty list"), (["vram"], "unknown memory tags"), ("weights", "non-empty list")):
        with pytest.raises(ValueError, match=words):
            sleepy.release_memory_occupation(bad)
    with pytest.raises(ValueError, match="not released"):
        sleepy.resume_memory_occupation(["weights"])
    with pytest.raises(ValueError, match="sleep level"):
        sleepy.sleep(level=3)
    sleepy.resume_memory_occupation(["kv_cache"])
    hf = hf_reference(path)
    assert _greedy(sleepy) == [hf.greedy(p, 8) for p in PROMPTS]


def test_a_release_waits_for_running_requests_and_refuses_paused_ones(sleepy):
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    stream = sleepy.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=long, stream=True)
    next(stream)
    state = sleepy.sleep(level=1)  # waits for the running request, which finishes normally
    assert state["sleeping"] and list(stream)[-1].outputs[0].finish_reason == "length"
    sleepy.wake_up()
    stream = sleepy.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=long, stream=True)
    next(stream)
    sleepy.pause_generation(mode="in_place")
    with pytest.raises(ValueError, match="paused in place"):
        sleepy.sleep(level=1)
    assert not sleepy.is_sleeping()
    sleepy.continue_generation()
    assert list(stream)[-1].outputs[0].finish_reason == "length"
    # retracted by a pause, the request is accepted and waits to resume: a release would fail it, so it is refused
    stream = sleepy.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=long, stream=True)
    chunks = [next(stream)]
    sleepy.pause_generation(mode="retract")
    with pytest.raises(ValueError, match="held by pause_generation"):
        sleepy.sleep(level=1)
    assert not sleepy.is_sleeping()
    sleepy.continue_generation()
    chunks += list(stream)
    assert chunks[-1].outputs[0].finish_reason == "length"
    assert sum(len(c.outputs[0].token_ids) for c in chunks) == 60


def test_without_the_memory_saver_the_calls_say_how_to_enable_it(engine):
    with pytest.raises(ValueError, match="enable_memory_saver=True"):
        engine.sleep()
    assert not engine.is_sleeping()


def test_sleep_and_wake_up_over_http(path, hf_reference):
    with running_server(path, "--enable-memory-saver") as srv:
        client = EngineClient(srv.url)
        assert client.sleep(level=1)["released"] == ["weights", "kv_cache", "cuda_graph"] and client.is_sleeping()
        with pytest.raises(RuntimeError, match="asleep"):
            client.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
        with pytest.raises(ValueError, match="already released"):
            client.release_memory_occupation(["kv_cache"])
        assert client.wake_up(["weights"])["released"] == ["kv_cache", "cuda_graph"]
        assert client.resume_memory_occupation()["sleeping"] is False and not client.is_sleeping()
        assert client.wake_up()["sleeping"] is False  # vLLM's call: a warning, not an error
        with pytest.raises(ValueError, match="awake"):
            client.resume_memory_occupation()
        out = client.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                        "ignore_eos": True})
        assert out["output_ids"] == hf_reference(path).greedy([5, 6, 7, 8], 8)
        client.close()


def test_a_release_refused_for_requests_that_came_while_it_waited_says_so(sleepy):
    """A sleep waits for the running requests and holds new ones back meanwhile; one that arrived then makes the
    release a ValueError (SGLang releases only an idle engine) that says what happened: no pause was involved
    (it said "held by pause_generation")."""
    import threading

    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    stream = sleepy.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=long, stream=True)
    next(stream)
    result: dict[str, object] = {}

    def sleep() -> None:
        try:
            result["state"] = sleepy.sleep(level=1)
        except ValueError as e:
            result["error"] = str(e)

    thread = threading.Thread(target=sleep)
    thread.start()
    thread.join(0.2)  # the release is queued behind the running request
    late = sleepy.generate(prompt_token_ids=[[5, 6, 8]], sampling_params=GREEDY, stream=True)
    assert list(stream)[-1].outputs[0].finish_reason == "length"
    thread.join(60)
    assert "arrived while this release waited" in result.get("error", ""), result
    assert "pause_generation (retracted" not in result["error"]
    assert list(late)[-1].outputs[0].finish_reason == "length" and not sleepy.is_sleeping()


def test_sleep_and_wake_up_are_idempotent_as_in_vllm(sleepy):
    """vLLM's executor warns and returns when asked to sleep while asleep or to wake up while awake (or to wake
    a tag that is not asleep); a vLLM-style loop that wakes its engines defensively must not fail. SGLang's
    release / resume calls keep refusing."""
    assert sleepy.wake_up()["sleeping"] is False
    state = sleepy.sleep(level=1)
    assert sleepy.sleep(level=2) == state and sleepy.get_weight_state()["state"] == "consistent"
    assert sleepy.wake_up(["weights"])["released"] == ["kv_cache", "cuda_graph"]
    assert sleepy.wake_up(["weights"])["released"] == ["kv_cache", "cuda_graph"]  # not asleep: nothing to do
    with pytest.raises(ValueError, match="unknown memory tags"):
        sleepy.wake_up(["vram"])
    assert sleepy.wake_up()["sleeping"] is False and sleepy.wake_up()["sleeping"] is False
    with pytest.raises(ValueError, match="awake"):
        sleepy.resume_memory_occupation()
    assert sleepy.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY, use_tqdm=False)[0].finished


@pytest.fixture(scope="module")
def sleepy_with_copy(path):
    with Engine(path, dtype="float32", device="cpu", enable_memory_saver=True, keep_weight_copy=True,
                cpu_kv_cache_gb=0.05) as e:
        yield e


def test_rollback_after_a_level_2_sleep_names_the_weights_it_restores(sleepy_with_copy, path):
    """The kept copy is taken of whole weights only: a push after ``sleep(level=2)`` starts on released ones, so
    the copy stays that of the update before it, and a rollback must name that copy's version (it restored the
    checkpoint's weights and called them version "1", the weights the sleep discarded)."""
    import weight_sync

    engine, base = sleepy_with_copy, _changed_model(path, 1.0)
    engine.update_weights_from_tensor(list(_changed_model(path, 0.9).named_parameters()))  # version "1"
    engine.sleep(level=2)
    engine.wake_up(tags=["weights"])
    engine.update_weights_from_tensor(list(_changed_model(path, 0.8).named_parameters()))  # version "2"
    engine.wake_up(tags=["kv_cache"])
    assert engine.rollback_weights()["weight_version"] == "0"
    assert engine.get_weight_version() == "0" and engine.weights_fingerprint() == weight_sync.fingerprint(base)
    engine.update_weights_from_disk(path)


def test_a_failed_push_before_a_level_2_sleep_counts_for_nothing_after_it(sleepy, path, hf_reference):
    """A push refused mid-way leaves its first parameters loaded (inconsistent); a level-2 sleep then discards them
    too, so a push of only the parameters that session lacked must not make the weights whole: it did, and the
    engine generated from the released (zeroed) memory as if consistent."""
    named = list(_changed_model(path, 0.9).named_parameters())
    sleepy.update_weights_from_tensor(named[:3], flush_cache=False)
    with pytest.raises(ValueError, match="wrong shape"):
        sleepy.update_weights_from_tensor([(named[3][0], torch.zeros(3, 3))], flush_cache=False)
    sleepy.sleep(level=2)
    sleepy.wake_up(tags=["weights"])
    assert not sleepy.update_weights_from_tensor(named[3:])["complete"]
    sleepy.wake_up(tags=["kv_cache"])
    state = sleepy.get_weight_state()
    assert state["state"] == "inconsistent" and "released without a copy" in state["reason"]
    with pytest.raises(RuntimeError, match="released without a copy"):
        sleepy.generate(prompt_token_ids=PROMPTS[:1], use_tqdm=False)
    sleepy.update_weights_from_disk(path)
    assert _greedy(sleepy) == [hf_reference(path).greedy(p, 8) for p in PROMPTS]


def test_a_release_while_an_in_flight_update_holds_requests_is_refused_at_once(path):
    """With ``update_weights_in_flight`` the first bucket of an update lands beside a running request, which then
    waits for the rest. A release waits for running requests, so it waited for that one, and the next bucket,
    queued behind the release, could never run: a hang until the session's timeout (10 minutes for a push by
    tensor). The release is refused at once instead, as while requests are paused in place."""
    import threading

    named = list(_changed_model(path, 0.9).named_parameters())
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    with Engine(path, dtype="float32", device="cpu", enable_memory_saver=True, update_weights_in_flight=True,
                cpu_kv_cache_gb=0.05) as engine:
        stream = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=long, stream=True)
        chunks = [next(stream)]
        assert not engine.update_weights_from_tensor(named[:5], flush_cache=False)["complete"]
        result: dict[str, object] = {}

        def release() -> None:
            try:
                result["state"] = engine.release_memory_occupation(["kv_cache"])
            except ValueError as e:
                result["error"] = str(e)

        thread = threading.Thread(target=release, daemon=True)
        thread.start()
        thread.join(30)
        assert "wait for the open weight update" in result.get("error", ""), result
        assert engine.update_weights_from_tensor(named[5:])["complete"]
        chunks += list(stream)
        assert chunks[-1].outputs[0].finish_reason == "length" and not engine.is_sleeping()
        assert engine.sleep(level=1)["sleeping"]


def test_a_release_frees_the_buffer_distributed_updates_receive_into(tiny_dir):
    """``update_weights_from_distributed`` receives each bucket into a reused buffer as large as the bucket; the
    engine kept it while asleep (on a GPU, a bucket of up to 1 GiB beside the 1 GiB an engine holds asleep).
    A model of two 64 MiB tensors (embedding and head) pushed as one flattened bucket: asleep, the scheduler
    held the bucket's 130 MiB more after the update than before it."""
    import time

    import weight_sync
    from rollout.ipc import free_port
    from transformers import AutoModelForCausalLM

    path = tiny_dir("llama", vocab_size=65536, hidden_size=256)
    named = [(n, p.detach()) for n, p in AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
             .named_parameters()]
    nbytes = sum(p.numel() * p.element_size() for _, p in named)
    with Engine(path, dtype="float32", device="cpu", enable_memory_saver=True, cpu_kv_cache_gb=0.05) as engine:
        sched = psutil.Process(engine._procs.procs[0].pid)

        def rss_asleep() -> int:
            engine.sleep(level=2)
            time.sleep(0.2)
            rss = sched.memory_info().rss
            engine.wake_up(tags=["weights"])
            return rss

        for _ in range(3):  # the scheduler's RSS asleep settles over its first cycles (~30-60 MB on this machine)
            rss_asleep()
        before = rss_asleep()
        port = free_port()
        join = engine.init_process_group("127.0.0.1", port, 1, 2, "bucket", backend="gloo", timeout=60, async_op=True)
        group = weight_sync.init_process_group("127.0.0.1", port, 0, 2, "bucket", backend="gloo", timeout=60)
        join.result(60)
        try:
            update = engine.update_weights_from_distributed(
                [n for n, _ in named], [p.dtype for _, p in named], [list(p.shape) for _, p in named], "bucket",
                load_format="flattened_bucket", async_op=True)
            torch.distributed.broadcast(torch.cat([p.reshape(-1).view(torch.uint8) for _, p in named]), 0, group=group)
            assert update.result(60)["complete"]
        finally:
            leave = engine.destroy_process_group("bucket", async_op=True)
            weight_sync.destroy_process_group(group)
            leave.result(60)
        engine.wake_up()
        grown = rss_asleep() - before
        assert grown < 0.25 * nbytes, (grown, nbytes)
