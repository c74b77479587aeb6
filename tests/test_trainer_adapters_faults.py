"""trainer_adapters faults found by the trainer-side hunt, without Ray (CPU, gloo): FSDP2 mixed precision with
unsharded modules, vLLM's engine-level ``logprobs_mode``, a push while paused with a ``generate`` held by the
pause, ``push_colocated`` through the engine actor, ``push_cuda_ipc`` failing on one rank, and the argument
forms OpenRLHF and vLLM use. The imports under test sit inside the tests, so each test stands alone."""

from __future__ import annotations

import gc
import time
from concurrent.futures import Future
from datetime import timedelta

import pytest
import torch
import torch.nn as nn

import weight_sync
from rollout.ipc import free_port
from tiny_models import scaled_copy

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def actor_obj(path):
    """One engine actor for the module, started with OpenRLHF's ``logprobs_mode="processed_logprobs"``."""
    from trainer_adapters import EngineActor

    actor = EngineActor(path, device="cpu", dtype="float32", seed=0, logprobs_mode="processed_logprobs",
                        max_logprobs=1, weight_sync_timeout=60)
    yield actor
    actor.shutdown()


@pytest.fixture(scope="module")
def local_actor(actor_obj):
    from trainer_adapters import LocalActor

    actor = LocalActor(actor_obj)
    yield actor
    actor.stop_threads()


@pytest.fixture(scope="module")
def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


# ---- F1: FSDP2 with a bf16 MixedPrecisionPolicy and unsharded modules ---------------------------------

def _fsdp2_mixed_precision_rank(rank: int, port: int, result_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from trainer_adapters import full_named_parameters, trainer_fingerprint

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model:
            fully_shard(layer, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        master = [(n, p.full_tensor()) for n, p in model.named_parameters()]  # the fp32 weights, sharded
        with torch.no_grad():  # e.g. the old policy's logprobs: the modules stay unsharded, in bf16
            model(torch.randn(2, 16))
        unsharded = sorted({f"{type(p).__name__}:{p.dtype}" for p in model.parameters()})
        full = full_named_parameters(model)
        fp = trainer_fingerprint(model)
        if rank == 0:
            torch.save({"unsharded": unsharded, "names": [n for n, _ in full] == [n for n, _ in master],
                        "equal": [torch.equal(a, b) for (_, a), (_, b) in zip(full, master)],
                        "dtypes": sorted({str(t.dtype) for _, t in full}),
                        "fingerprint": fp == weight_sync.fingerprint(master)}, result_path)
        del mesh, model, master, full
    finally:
        dist.destroy_process_group()
        gc.collect()  # join gloo's threads before the interpreter finalizes (see test_trainer_adapters)


def test_fsdp2_mixed_precision_unsharded_modules_send_the_fp32_weights(tmp_path):
    """FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16)`` and ``reshard_after_forward=False``: after a forward
    the modules' parameters are the bf16 compute copies. The source reshards first, so the full tensors (and
    the trainer fingerprint that checks a push) are the fp32 weights, not those copies."""
    import torch.multiprocessing as mp

    out = tmp_path / "fsdp2_mp.pt"
    mp.start_processes(_fsdp2_mixed_precision_rank, args=(free_port(), str(out)), nprocs=2, start_method="spawn")
    result = torch.load(out)
    assert result["unsharded"] == ["Parameter:torch.bfloat16"], "the scenario: unsharded bf16 parameters"
    assert result["names"] and result["dtypes"] == ["torch.float32"]
    assert result["equal"] == [True] * 6 and result["fingerprint"]


# ---- F2: vLLM's engine-level logprobs_mode -------------------------------------------------------------

def test_vllm_logprobs_modes_map_to_the_request_default():
    from rollout import SamplingParams
    from trainer_adapters.ray_actor import logprobs_mode_default, to_sampling_params

    assert [logprobs_mode_default(m) for m in (None, "raw_logprobs", "processed_logprobs", "processed")] == \
        [None, "raw", "processed", "processed"]
    for mode in ("raw_logits", "processed_logits"):
        with pytest.raises(ValueError, match="returns logprobs"):
            logprobs_mode_default(mode)
    with pytest.raises(ValueError, match="unknown logprobs_mode"):
        logprobs_mode_default("final_logprobs")
    assert to_sampling_params(None, "processed").logprobs_mode == "processed"
    assert to_sampling_params({"max_tokens": 3}, "processed").logprobs_mode == "processed"
    assert to_sampling_params({"logprobs_mode": "raw"}, "processed").logprobs_mode == "raw"  # the request's own
    assert to_sampling_params(SamplingParams(), "processed").logprobs_mode == "raw"  # ours always names one
    vllm_like = type("VllmSamplingParams", (), {"temperature": 0.5, "max_tokens": 4, "logprobs": 0})()
    assert to_sampling_params(vllm_like, "processed").logprobs_mode == "processed"


def test_engine_actor_refuses_logits_modes_before_starting(path):
    from trainer_adapters import EngineActor

    with pytest.raises(ValueError, match="logprobs_mode='raw_logits'"):
        EngineActor(path, device="cpu", logprobs_mode="raw_logits")


def test_engine_level_processed_logprobs_is_what_requests_get(actor_obj):
    """OpenRLHF's IS correction starts vLLM with ``logprobs_mode="processed_logprobs"``: requests that name no
    mode get the logprobs of the distribution sampled from; a request's own mode still wins."""
    sp = {"temperature": 0.5, "max_tokens": 6, "logprobs": 0, "seed": 3, "ignore_eos": True}
    default, raw, processed = [actor_obj.generate([PROMPT], params)[0].outputs[0] for params in
                               (sp, {**sp, "logprobs_mode": "raw"}, {**sp, "logprobs_mode": "processed"})]
    assert default.token_ids == raw.token_ids == processed.token_ids
    assert default.token_logprobs == pytest.approx(processed.token_logprobs, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(raw.token_logprobs, processed.token_logprobs)) > 0.1


# ---- F3: a push while paused, with a generate held by the pause ------------------------------------------

def _wait_unfinished(actor, count: int, seconds: float = 60) -> None:
    from trainer_adapters import get

    deadline = time.monotonic() + seconds
    while get(actor.get_num_unfinished_requests.remote(), 30) < count:
        assert time.monotonic() < deadline, "the generate call never reached the engine"
        time.sleep(0.05)


def test_push_while_paused_is_not_held_up_by_a_generate_the_pause_holds(local_actor, hf_model):
    """pause_generation, then a rollout worker's generate arrives (held by the pause), then OpenRLHF's
    per-tensor push: the update calls must not queue behind that generate (the trainer's broadcast would time
    out). After the resume the held request runs on the new weights."""
    from trainer_adapters import get

    trained = scaled_copy(hf_model, 1.01)
    named = [(n, p.detach()) for n, p in trained.named_parameters()]
    port = free_port()
    join = local_actor.init_process_group.remote("127.0.0.1", port, 1, 2, "paused", backend="gloo", timeout=30)
    group = weight_sync.init_process_group("127.0.0.1", port, 0, 2, "paused", backend="gloo", timeout=30)
    get(join, 60)
    held = None
    try:
        assert get(local_actor.pause_generation.remote(), 30)
        held = local_actor.generate.remote([PROMPT], {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True})
        _wait_unfinished(local_actor, 1)
        for i, (name, p) in enumerate(named):
            ref = local_actor.update_weight.remote(name, dtype=p.dtype, shape=p.shape, empty_cache=i == len(named) - 1)
            torch.distributed.broadcast(p, 0, group=group)
            get(ref, 60)
        assert not held.done(), "the pause held the request"
        version = get(local_actor.get_weight_version.remote(), 30)
    finally:
        try:
            get(local_actor.resume_generation.remote(), 30)
            get(local_actor.destroy_process_group.remote("paused"), 60)
        finally:
            weight_sync.destroy_process_group(group)
    assert get(held, 60)[0].weight_version == version
    assert get(local_actor.weights_fingerprint.remote(), 30) == weight_sync.fingerprint(named)


# ---- F4: push_colocated through the engine actor ---------------------------------------------------------

def test_push_colocated_through_the_engine_actor(local_actor, hf_model):
    """``push_colocated(model, [actor])``: the actor has ``update_weights_from_tensor``, whole model and buckets."""
    from trainer_adapters import get, push_colocated

    for factor, bucket_bytes, version in ((1.02, None, "whole"), (0.98, 64 << 10, "bucketed")):
        trained = scaled_copy(hf_model, factor)
        report = push_colocated(trained, [local_actor], bucket_bytes=bucket_bytes, weight_version=version)
        assert report["tensors"] == len(list(trained.parameters()))
        assert get(local_actor.weights_fingerprint.remote(), 30) == \
            weight_sync.fingerprint(list(trained.named_parameters()))
        assert get(local_actor.get_weight_version.remote(), 30) == version
    assert get(local_actor.get_weight_state.remote(), 30)["state"] == "consistent"


def test_engine_actor_update_weights_from_tensor_takes_sglangs_load_format(local_actor, hf_model):
    """verl calls ``update_weights_from_tensor(named_tensors=..., load_format=None, flush_cache=...)`` as SGLang's
    Engine takes it; the actor's method had no ``load_format`` (a TypeError before anything loaded) although
    ``Engine.update_weights_from_tensor`` has it. None and "direct" load; another format is the engine's
    ValueError, weights untouched."""
    from trainer_adapters import get

    trained = scaled_copy(hf_model, 1.04)
    named = list(trained.named_parameters())
    get(local_actor.update_weights_from_tensor.remote(named_tensors=named[:3], load_format=None, flush_cache=False), 30)
    get(local_actor.update_weights_from_tensor.remote(named_tensors=named[3:], load_format="direct",
                                                      flush_cache=True, weight_version="verl"), 30)
    assert get(local_actor.get_weight_version.remote(), 30) == "verl"
    assert get(local_actor.weights_fingerprint.remote(), 30) == weight_sync.fingerprint(trained)
    with pytest.raises(ValueError, match="load_format"):
        get(local_actor.update_weights_from_tensor.remote(named, load_format="flattened_bucket"), 30)
    assert get(local_actor.weights_fingerprint.remote(), 30) == weight_sync.fingerprint(trained)


# ---- F5: push_cuda_ipc failing on one rank -----------------------------------------------------------

def _push_cuda_ipc_rank(rank: int, port: int, result_path: str) -> None:
    """One FSDP2 rank of two; rank 0's engine refuses the second tensor. CUDA is stubbed: the tensors stay on
    the CPU and an IPC handle is the tensor's shape, but the handles are still all-gathered like the real
    ones (``ipc_handles``), so the gathers, the handle all-gathers, the barriers and the engine calls are
    the real code's."""
    import torch.distributed as dist

    from adapter_trainer import fsdp2_linear_stack
    from trainer_adapters import cuda_ipc

    def ipc_handles_on_cpu(tensor: torch.Tensor, group=None) -> dict:
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, {f"GPU-{rank}": tuple(tensor.shape)}, group=group)
        return {k: v for part in everyone for k, v in part.items()}

    cuda_ipc.ipc_handles = ipc_handles_on_cpu
    cuda_ipc._cuda_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args: None
    try:
        model = fsdp2_linear_stack(rank, port, layers=3, timeout_s=30)
        calls: list = []

        class Refusing:
            def update_weight_cuda_ipc(self, name, dtype, shape, handles, empty_cache=False, async_op=False):
                calls.append((name, sorted(handles)))
                fut: Future = Future()
                if len(calls) == 2:
                    fut.set_exception(ValueError(f"{name} refused"))
                else:
                    fut.set_result(True)
                return fut

        error = None
        try:
            cuda_ipc.push_cuda_ipc(model, [Refusing()] if rank == 0 else None)
        except ValueError as e:
            error = str(e)
        after = torch.tensor([rank + 1.0])
        dist.all_reduce(after)  # both ranks are in step after the push
        torch.save({"error": error, "calls": calls, "after": after.item()}, f"{result_path}.{rank}")
        del model
    finally:
        dist.destroy_process_group()
        gc.collect()


def test_push_cuda_ipc_failing_on_one_rank_leaves_the_other_rank_in_step(tmp_path):
    """Rank 0's engine refuses tensor 2 of 6: rank 0 stops sending but runs every remaining gather, handle
    all-gather and barrier, then raises; rank 1 (no engine) finishes its push; both meet at the next
    collective (before, rank 1 waited in a collective until the group's timeout)."""
    import torch.multiprocessing as mp

    out = tmp_path / "push"
    mp.start_processes(_push_cuda_ipc_rank, args=(free_port(), str(out)), nprocs=2, start_method="spawn")
    first, second = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert first["error"] == "0.bias refused" and second["error"] is None
    assert first["calls"] == [("0.weight", ["GPU-0", "GPU-1"]), ("0.bias", ["GPU-0", "GPU-1"])]
    assert first["after"] == second["after"] == 3.0


# ---- argument forms: ranks, prompts, vLLM options, OpenRLHF's create_vllm_engines order -----------------

def test_ranks_that_cannot_fit_the_trainers_group_are_clear_errors(actor_obj):
    """The trainer is rank 0: ``rank_offset=0`` (the forgotten +1) or a world too small for the engine's ranks
    is a ValueError at once, instead of a rendezvous that fails or waits for its timeout."""
    with pytest.raises(ValueError, match="rank_offset must be >= 1"):
        actor_obj.init_process_group("127.0.0.1", free_port(), 0, 2, "g", backend="gloo")
    with pytest.raises(ValueError, match="world_size 1 is too small"):
        actor_obj.init_process_group("127.0.0.1", free_port(), 1, 1, "g", backend="gloo")


def test_generate_takes_vllm_prompts_first(actor_obj):
    """vLLM >= 0.10's ``LLM.generate(prompts, sampling_params)``: TokensPrompt dicts, token-id lists and strings
    as the first positional argument; ``prompt_token_ids=`` stays a keyword."""
    sp = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
    prompts = [PROMPT, [40, 41, 42]]
    base = [o.outputs[0].token_ids for o in actor_obj.generate(prompt_token_ids=prompts, sampling_params=sp)]
    for form in ([{"prompt_token_ids": p} for p in prompts], prompts):
        assert [o.outputs[0].token_ids for o in actor_obj.generate(form, sp)] == base
    (text,) = actor_obj.generate(["hello world"], sp)
    assert text.prompt == "hello world" and len(text.outputs[0].token_ids) == 4


def test_chat_takes_vllms_template_options(actor_obj):
    """vLLM's ``LLM.chat`` keywords (``chat_template_kwargs``, ``continue_final_message``, ...) reach the engine's
    chat; the actor's ``chat`` took only (messages, sampling_params, use_tqdm): a TypeError for each of them."""
    sp = {"temperature": 0.0, "max_tokens": 2, "ignore_eos": True}
    conv = [{"role": "user", "content": "the sky"}, {"role": "assistant", "content": "is"}]
    (out,) = actor_obj.chat(conv, sp, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt == actor_obj.engine.chat(conv, sp, add_generation_prompt=False, continue_final_message=True,
                                               use_tqdm=False)[0].prompt
    assert out.prompt.endswith("assistant: is")
    template = "{% for m in messages %}{{ m['content'] }}{% if flag %}!{% endif %}{% endfor %}"
    (out,) = actor_obj.chat([conv[:1]], sp, chat_template=template, chat_template_kwargs={"flag": True})
    assert out.prompt == "the sky!"


def test_vllm_options_given_as_none_keep_the_defaults():
    """OpenRLHF passes ``gpu_memory_utilization=None`` (and may pass None for the others): the engine's default."""
    from trainer_adapters import engine_options

    assert engine_options("/m", gpu_memory_utilization=None, max_model_len=None, enable_prefix_caching=None,
                          enforce_eager=None, max_num_seqs=None) == {"model_path": "/m"}


def test_create_engines_takes_openrlhfs_positional_order():
    """``create_vllm_engines(num_engines, tensor_parallel_size, pretrain, seed, full_determinism,
    enable_prefix_caching, enforce_eager, max_model_len, shared_pg, gpu_memory_utilization, vllm_enable_sleep,
    ...)``: the same positions (the later arguments, whose order changed between OpenRLHF releases, by keyword)."""
    import inspect

    from trainer_adapters import create_engines

    params = list(inspect.signature(create_engines).parameters.values())
    positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == ["num_engines", "tensor_parallel_size", "model_path", "seed", "full_determinism",
                          "enable_prefix_caching", "enforce_eager", "max_model_len", "shared_pg",
                          "gpu_memory_utilization", "vllm_enable_sleep"]
