"""trainer_adapters on a local Ray cluster (CPU, gloo): two engine actors placed by ``create_engines``,
trainers under each wrapping pushing real training updates into them, compared with transformers."""

from __future__ import annotations

import os
import time

import pytest
import ray

from adapter_trainer import BACKENDS, CHECK_PROMPTS, WORLD_SIZES, TrainerRank, free_port  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def cluster():
    path = os.pathsep.join([TESTS_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def engines(cluster, path):
    from trainer_adapters import create_engines

    handles = create_engines(2, 1, path, seed=7, dtype="float32", weight_sync_timeout=120)
    yield handles
    try:
        ray.get([h.shutdown.remote() for h in handles], timeout=60)
    finally:  # an actor still busy (a failed test) is killed; its engine's processes follow their parent
        for h in handles:
            ray.kill(h)


def run_trainer(backend: str, path: str, engines: list, modes: list[str]) -> dict:
    world = WORLD_SIZES[backend]
    port = free_port()
    rank_cls = ray.remote(num_cpus=0)(TrainerRank)
    ranks = [rank_cls.remote(backend, r, world, port, path) for r in range(world)]
    try:
        results = ray.get([r.run.remote(engines, modes) for r in ranks], timeout=240)
    finally:
        for r in ranks:
            ray.kill(r)
    return results[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_sync_from_trainer_into_two_engine_actors(backend, path, engines):
    """A training step, then a bucketed sync; another step, then a per-tensor sync. After each, both
    engines hold exactly the trainer's gathered weights and generate transformers' greedy tokens."""
    report = run_trainer(backend, path, engines, ["bucket", "per_tensor"])
    info, steps = report["info"], report["steps"]
    if backend == "deepspeed":
        assert info["partitioned"], "ZeRO-3 did not partition the parameters"
    if backend == "fsdp2":
        assert info["dtensor"] == "DTensor"
    if backend == "accelerate":
        assert info["first_name"].startswith("module."), "expected Accelerate to wrap the model in DDP"
    assert [s["mode"] for s in steps] == ["bucket", "per_tensor"]
    assert steps[0]["buckets"] > 1 and steps[1]["buckets"] == steps[1]["tensors"]
    assert steps[0]["trainer_fp"] != steps[1]["trainer_fp"], "the second step changed the weights"
    assert steps[0]["names"][0].startswith(("lm_head", "model.")), "names are Hugging Face names"
    for i, step in enumerate(steps):
        assert len(step["engines"]) == 2
        for eng in step["engines"]:
            assert eng["fp"] == step["trainer_fp"], f"{step['mode']}: engine weights differ from the trainer's"
            assert eng["greedy"] == step["hf_greedy"], f"{step['mode']}: greedy differs from transformers"
            assert eng["max_dlogprob"] < 1e-4
            assert eng["vllm_shaped"] and eng["finish"] == ["length"]
            assert eng["version"] == f"{step['mode']}-{i}"


def test_generate_shapes_sampling_params_and_seeds(engines):
    """vLLM-shaped outputs; SamplingParams, vLLM-named dicts and lists per prompt; engine i has seed 7 + i."""
    from rollout import SamplingParams

    ids = CHECK_PROMPTS[:2]
    a = ray.get(engines[0].generate.remote(ids, {"temperature": 0.0, "max_tokens": 5, "ignore_eos": True,
                                                  "logprobs": 2}))
    b = ray.get(engines[0].generate.remote(prompt_token_ids=ids, sampling_params=SamplingParams(
        temperature=0.0, max_new_tokens=5, ignore_eos=True, logprobs=2)))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    for o in a:
        c = o.outputs[0]
        assert o.prompt_token_ids in ids and len(c.token_ids) == 5 and c.finish_reason == "length"
        assert all(len(lp) >= 1 and c.logprobs[i][t].logprob == c.token_logprobs[i]
                   for i, (t, lp) in enumerate(zip(c.token_ids, c.logprobs)))
    per_prompt = ray.get(engines[1].generate.remote(ids, [{"max_tokens": 2}, {"max_tokens": 3}]))
    assert [len(o.outputs[0].token_ids) for o in per_prompt] == [2, 3]
    sampled = ray.get([e.generate.remote([CHECK_PROMPTS[0]] * 4, {"temperature": 1.0, "max_tokens": 12,
                                                                  "ignore_eos": True}) for e in engines])
    assert [o.outputs[0].token_ids for o in sampled[0]] != [o.outputs[0].token_ids for o in sampled[1]], \
        "two engines with different seeds sampled identically"


def test_control_calls_answer_during_generation(engines):
    """get_num_unfinished_requests / pause / resume run while a long generate holds the actor."""
    engine = engines[0]
    ref = engine.generate.remote([CHECK_PROMPTS[0]] * 4, {"temperature": 1.0, "max_tokens": 400, "ignore_eos": True})
    try:
        deadline = time.monotonic() + 60
        while ray.get(engine.get_num_unfinished_requests.remote()) < 4:  # all four submitted
            assert time.monotonic() < deadline, "the generate call never showed up as unfinished"
            time.sleep(0.05)
        assert ray.get(engine.pause_generation.remote())  # aborts the in-flight requests, holds new ones
        outs = ray.get(ref, timeout=60)
        assert [o.outputs[0].finish_reason for o in outs] == ["abort"] * 4
        assert all(len(o.outputs[0].token_ids) < 400 for o in outs)
        assert ray.get(engine.get_num_unfinished_requests.remote()) == 0
    finally:
        ray.get(engine.resume_generation.remote())
    again = ray.get(engine.generate.remote([CHECK_PROMPTS[0]], {"max_tokens": 3}), timeout=60)
    assert len(again[0].outputs[0].token_ids) == 3


def test_unsupported_group_options_are_clear_errors(engines):
    with pytest.raises(ValueError, match="use_ray=True"):
        ray.get(engines[0].init_process_group.remote("127.0.0.1", free_port(), 1, 2, "g", backend="gloo",
                                                     use_ray=True))
    with pytest.raises(ValueError, match="unsupported weight-update backend 'mpi'"):
        ray.get(engines[0].init_process_group.remote("127.0.0.1", free_port(), 1, 2, "g", backend="mpi"))
    with pytest.raises(ValueError, match="needs a GPU engine"):
        ray.get(engines[0].init_process_group.remote("127.0.0.1", free_port(), 1, 2, "g", backend="nccl"))
    with pytest.raises(ValueError, match="needs a GPU engine"):
        ray.get(engines[0].update_weight_cuda_ipc.remote("lm_head.weight", "float32", [4], {}))
    assert ray.get(engines[0].get_weight_state.remote())["state"] == "consistent"


def test_colocated_engine_sleeps_while_its_trainer_trains(cluster, path):
    """OpenRLHF's hybrid engine on one bundle: the engine actor (0.5 CPU, ``enable_sleep_mode``) and the
    trainer's actor (the rest) share a placement-group bundle. Each step: sleep → train → wake the
    weights → push → wake the KV cache → the engine equals transformers on the new weights. Asleep it
    refuses generation with the reason; level 1 wakes to the same greedy tokens."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from trainer_adapters import create_engines

    pg = placement_group([{"CPU": 2}], strategy="PACK")
    ray.get(pg.ready())
    engine = create_engines(1, 1, path, seed=7, shared_pg=pg, num_cpus_per_actor=0.5, dtype="float32",
                            enable_sleep_mode=True, weight_sync_timeout=120)[0]
    trainer = ray.remote(TrainerRank).options(num_cpus=1.5, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=0)).remote("module", 0, 1, free_port(), path)
    try:
        ray.get(trainer.build.remote())
        before = ray.get(engine.generate.remote(CHECK_PROMPTS, {"temperature": 0.0, "max_tokens": 6}))
        assert ray.get(engine.sleep.remote(1))["sleeping"] and ray.get(engine.is_sleeping.remote())
        with pytest.raises(Exception, match="asleep"):
            ray.get(engine.generate.remote(CHECK_PROMPTS[:1], {"max_tokens": 2}), timeout=60)
        ray.get(engine.wake_up.remote())
        again = ray.get(engine.generate.remote(CHECK_PROMPTS, {"temperature": 0.0, "max_tokens": 6}))
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in before]
        for step in range(2):
            ray.get(engine.sleep.remote(2))
            ray.get(trainer.train_step.remote(200 + step))
            ray.get(engine.wake_up.remote(["weights"]))
            ray.get(trainer.sync.remote([engine], "bucket", f"colocated-{step}"))
            ray.get(engine.wake_up.remote(["kv_cache"]))
            assert not ray.get(engine.is_sleeping.remote())
            report = ray.get(trainer.check.remote([engine]))
            eng = report["engines"][0]
            assert eng["fp"] == report["trainer_fp"] and eng["greedy"] == report["hf_greedy"]
            assert eng["max_dlogprob"] < 1e-4 and eng["version"] == f"colocated-{step}"
        ray.get(trainer.close_group.remote([engine]))
        assert ray.get(engine.get_weight_state.remote())["state"] == "consistent"
    finally:
        ray.get(engine.shutdown.remote(), timeout=60)
        for actor in (engine, trainer):
            ray.kill(actor)
        remove_placement_group(pg)


def test_moe_engine_actor_syncs_from_fsdp2_and_returns_routed_experts(cluster, tiny_dir):
    """A Qwen3-MoE engine actor: an FSDP2 trainer's fused expert tensors, gathered per bucket, land exactly
    (fingerprint, greedy = transformers), and the actor returns routed experts in vLLM's shape."""
    from test_moe import moe_path
    from trainer_adapters import create_engines

    path = moe_path(tiny_dir, "qwen3_moe")
    (engine,) = create_engines(1, 1, path, seed=3, dtype="float32", enable_return_routed_experts=True,
                               weight_sync_timeout=120)
    try:
        report = run_trainer("fsdp2", path, [engine], ["bucket"])
        (step,) = report["steps"]
        (eng,) = step["engines"]
        assert eng["fp"] == step["trainer_fp"] and eng["greedy"] == step["hf_greedy"]
        assert eng["max_dlogprob"] < 1e-4
        (out,) = ray.get(engine.generate.remote([CHECK_PROMPTS[1]], {"max_tokens": 4, "ignore_eos": True,
                                                                      "return_routed_experts": True}))
        assert out.outputs[0].routed_experts.shape == (len(CHECK_PROMPTS[1]) + 4 - 1, 2, 2)
    finally:
        ray.get(engine.shutdown.remote(), timeout=60)


def test_push_while_paused_is_not_held_up_by_a_generate_the_pause_holds(engines, path):
    """On Ray: pause_generation, a rollout worker's generate arrives (held by the pause), then OpenRLHF's
    per-tensor push. The generate runs in its own concurrency group, so the update calls do not queue behind
    it (the trainer's broadcast would time out); after the resume it runs on the new weights."""
    import torch
    from transformers import AutoModelForCausalLM

    import weight_sync

    engine = engines[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    named = [(n, p.detach() * 1.01) for n, p in model.named_parameters()]
    port = free_port()
    join = engine.init_process_group.remote("127.0.0.1", port, 1, 2, "paused-ray", backend="gloo", timeout=30)
    group = weight_sync.init_process_group("127.0.0.1", port, 0, 2, "paused-ray", backend="gloo", timeout=30)
    ray.get(join, timeout=60)
    try:
        assert ray.get(engine.pause_generation.remote())
        held = engine.generate.remote([CHECK_PROMPTS[0]], {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True})
        deadline = time.monotonic() + 60
        while ray.get(engine.get_num_unfinished_requests.remote()) < 1:
            assert time.monotonic() < deadline, "the generate call never reached the engine"
            time.sleep(0.05)
        for i, (name, p) in enumerate(named):
            ref = engine.update_weight.remote(name, dtype=p.dtype, shape=p.shape, empty_cache=i == len(named) - 1)
            torch.distributed.broadcast(p, 0, group=group)
            ray.get(ref, timeout=60)
        assert ray.wait([held], timeout=0)[1] == [held], "the pause held the request"
        version = ray.get(engine.get_weight_version.remote())
    finally:
        try:
            ray.get(engine.resume_generation.remote())
            ray.get(engine.destroy_process_group.remote("paused-ray"), timeout=60)
        finally:
            weight_sync.destroy_process_group(group)
    assert ray.get(held, timeout=60)[0].weight_version == version
    assert ray.get(engine.weights_fingerprint.remote()) == weight_sync.fingerprint(named)


def test_push_colocated_into_an_engine_actor(engines, path):
    """``push_colocated(model, [actor])`` through Ray: the actor's ``update_weights_from_tensor`` loads each
    bucket (the tensors travel by Ray's serialization) and the last one completes the update."""
    import torch
    from transformers import AutoModelForCausalLM

    import weight_sync
    from trainer_adapters import push_colocated

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.99)
    report = push_colocated(model, [engines[1]], bucket_bytes=64 << 10, weight_version="colocated-ray")
    assert report["buckets"] > 1
    assert ray.get(engines[1].weights_fingerprint.remote()) == weight_sync.fingerprint(list(model.named_parameters()))
    assert ray.get(engines[1].get_weight_version.remote()) == "colocated-ray"


def _live_placement_groups() -> set:
    from ray.util import placement_group_table

    return {pg_id for pg_id, info in placement_group_table().items() if info["state"] != "REMOVED"}


def test_a_failed_create_engines_leaves_nothing_behind(cluster, path):
    """Engines that die at start (an unknown option): the actors are killed and the placement group made for
    them is removed, so a retry gets the resources (it waited forever before). A placement group that cannot
    be placed is a TimeoutError naming the cause, and is removed too. The retry uses OpenRLHF's positional
    order, with ``vllm_enable_sleep``: the engine comes up asleep, as OpenRLHF's do."""
    from trainer_adapters import create_engines

    before = _live_placement_groups()
    with pytest.raises(ray.exceptions.RayActorError):
        create_engines(2, 1, path, 0, dtype="float32", not_an_option=1)
    deadline = time.monotonic() + 30
    while _live_placement_groups() - before:
        assert time.monotonic() < deadline, "the failed call left its placement group behind"
        time.sleep(0.1)
    with pytest.raises(TimeoutError, match="was not ready after 1 s"):
        create_engines(1, 1, path, 0, num_cpus_per_engine=64, placement_timeout=1)
    deadline = time.monotonic() + 30
    while _live_placement_groups() - before:
        assert time.monotonic() < deadline, "the placement group that timed out was left behind"
        time.sleep(0.1)
    (engine,) = create_engines(1, 1, path, 0, False, True, True, 256, None, None, True, dtype="float32",
                               placement_timeout=60)
    try:
        assert ray.get(engine.is_sleeping.remote())
        ray.get(engine.wake_up.remote())
        out = ray.get(engine.generate.remote([CHECK_PROMPTS[0]], {"max_tokens": 3, "ignore_eos": True}), timeout=60)
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        ray.get(engine.shutdown.remote(), timeout=60)
        ray.kill(engine)
