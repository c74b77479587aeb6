"""trainer_adapters without Ray: names, options, planning, the lazy bucket sender, clear errors, and the
engine actor driven directly (the GPU machine's path) checked against transformers on CPU."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import types
from concurrent.futures import Future

import pytest
import torch
import torch.nn as nn

import weight_sync
from rollout import SamplingParams
from trainer_adapters import (BACKENDS, broadcast_to_engines, engine_options, hf_name, param_source,
                              to_sampling_params, unwrap_model)
from weight_sync.sender import WeightSender
from rollout.ipc import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))




@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir("llama"), dtype=torch.float32)


# ---- names ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("wrapped, expected", [
    ("module.model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),  # DDP / DeepSpeed
    ("module.module.lm_head.weight", "lm_head.weight"),
    ("_orig_mod.model.norm.weight", "model.norm.weight"),  # torch.compile
    ("model.layers.1._fsdp_wrapped_module._checkpoint_wrapped_module.self_attn.q_proj.weight",
     "model.layers.1.self_attn.q_proj.weight"),  # FSDP1 + activation checkpointing
    ("_forward_module.model.embed_tokens.weight", "model.embed_tokens.weight"),  # Lightning Fabric
    ("model.layers.2.self_attn.o_proj.weight", "model.layers.2.self_attn.o_proj.weight"),
])
def test_hf_name_strips_wrapper_components(wrapped, expected):
    assert hf_name(wrapped) == expected


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner


class HasModuleChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(2, 2)
        self.head = nn.Linear(2, 2)


def test_unwrap_and_param_source_give_hf_names(hf_model):
    expected = [n for n, _ in hf_model.named_parameters()]
    compiled = torch.compile(Wrapper(hf_model))  # _orig_mod.module.<hf names>
    assert unwrap_model(compiled) is hf_model
    assert [m.name for m in param_source(compiled).metas()] == expected
    odd = HasModuleChild()  # a real submodule called "module" is not a wrapper
    assert unwrap_model(odd) is odd
    assert [m.name for m in param_source(odd).metas()] == ["module.weight", "module.bias", "head.weight", "head.bias"]


def test_planning_by_bytes_as_sent(hf_model):
    src = param_source(hf_model)
    metas = src.metas()
    sizes = [torch.Size(m.shape).numel() * 4 for m in metas]
    plan = src.plan("bucket", 64 << 10)
    assert sorted(i for b in plan for i in b) == list(range(len(metas)))
    for bucket in plan:
        assert len(bucket) == 1 or sum(sizes[i] for i in bucket) <= 64 << 10
    half = src.plan("bucket", 64 << 10, dtype=torch.bfloat16)  # planned after the cast: fewer buckets
    assert len(half) < len(plan)
    assert src.plan("per_tensor", 64 << 10) == [[i] for i in range(len(metas))]


def test_unsupported_backends_and_modes_are_clear_errors(hf_model):
    with pytest.raises(ValueError, match="unsupported trainer backend 'megatron'"):
        broadcast_to_engines(hf_model, [object()], object(), backend="megatron")
    with pytest.raises(ValueError, match="mode must be one of"):
        broadcast_to_engines(hf_model, [object()], object(), mode="sharded")
    with pytest.raises(ValueError, match="looks like 'module'"):
        param_source(hf_model, backend="fsdp2")
    with pytest.raises(ValueError, match="needs the engines and the weight-update group"):
        broadcast_to_engines(hf_model, None, None)
    assert set(BACKENDS) == {"auto", "module", "accelerate", "fsdp2", "deepspeed"}


# ---- options ----------------------------------------------------------------------------------------

def test_engine_options_accept_vllm_arguments():
    opts = engine_options("/m", tensor_parallel_size=2, gpu_memory_utilization=0.5, max_model_len=1024,
                          enable_prefix_caching=False, enforce_eager=True, trust_remote_code=True, seed=3,
                          dtype="bfloat16", distributed_executor_backend="uni")
    assert opts == {"model_path": "/m", "tp_size": 2, "mem_fraction_static": 0.5, "context_length": 1024,
                    "disable_radix_cache": True, "disable_cuda_graph": True, "seed": 3, "dtype": "bfloat16"}


def test_sampling_params_from_ours_a_dict_or_a_vllm_object():
    ours = SamplingParams(temperature=0.5, max_new_tokens=7, logprobs=0)
    assert to_sampling_params(ours) == ours  # a copy, as vLLM clones at submission
    d = to_sampling_params({"temperature": 0.5, "max_tokens": 7, "logprobs": 0, "stop": ["\n"]})
    assert (d.temperature, d.max_new_tokens, d.logprobs, d.stop) == (0.5, 7, 0, ["\n"])
    vllm_like = types.SimpleNamespace(n=2, temperature=0.7, top_p=0.9, top_k=0, min_p=0.0, seed=None,
                                      max_tokens=12, min_tokens=0, stop=None, stop_token_ids=[5], logprobs=1,
                                      ignore_eos=False, skip_special_tokens=True, best_of=None,
                                      include_stop_str_in_output=False, repetition_penalty=1.0)
    v = to_sampling_params(vllm_like)
    assert (v.n, v.temperature, v.top_p, v.max_new_tokens, v.stop_token_ids, v.logprobs) == (2, 0.7, 0.9, 12, [5], 1)
    with pytest.raises(ValueError):
        to_sampling_params({"max_tokens": 4, "not_a_field": 1})
    # vLLM's max_tokens=None runs to the end of the context (it was the default 128)
    assert to_sampling_params(types.SimpleNamespace(**{**vars(vllm_like), "max_tokens": None})).max_new_tokens is None
    assert to_sampling_params({"max_tokens": None}).max_new_tokens is None
    for field, value in [("allowed_token_ids", [5, 6]), ("logit_bias", {5: 1.0}), ("truncate_prompt_tokens", 8)]:
        with pytest.raises(ValueError, match=field):  # dropped silently before, changing the sampling
            to_sampling_params(types.SimpleNamespace(**{**vars(vllm_like), field: value}))


def test_vllm_best_of_is_refused_not_sampled_as_n():
    """vLLM's SamplingParams(n=1, best_of=4) holds n=4 and _real_n=1 after its __post_init__ (V0 returns the best
    one of 4 samples, V1 refuses): the copy took n=4 and returned 4 samples. best_of equal to n is no choice."""
    vllm_like = types.SimpleNamespace(n=4, _real_n=1, best_of=4, temperature=1.0, max_tokens=8)
    with pytest.raises(ValueError, match="best_of=4"):
        to_sampling_params(vllm_like)
    assert to_sampling_params(types.SimpleNamespace(n=2, _real_n=None, best_of=2, max_tokens=8)).n == 2
    assert to_sampling_params(types.SimpleNamespace(n=3, best_of=None, max_tokens=8)).n == 3


# ---- the lazy bucket sender --------------------------------------------------------------------------

class RecordingEngine:
    """Stands in for an engine: records announcements; the broadcast goes to a one-rank group."""

    def __init__(self, log: list) -> None:
        self.log = log

    def _done(self, value):
        fut: Future = Future()
        fut.set_result(value)
        return fut

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, flush_cache, weight_version,
                                        load_format, async_op):
        self.log.append(("bucket", tuple(names), flush_cache, weight_version))
        return self._done(len(names))

    def update_weight(self, name, dtype, shape, empty_cache, async_op):
        self.log.append(("tensor", name, empty_cache))
        return self._done(1)

    def update_weight_version(self, version):
        self.log.append(("version", version))


@pytest.fixture(scope="module")
def solo_group():
    group = weight_sync.init_process_group("127.0.0.1", free_port(), 0, 1, "solo", backend="gloo", timeout=30)
    yield group
    weight_sync.destroy_process_group(group)


def test_send_buckets_consumes_one_bucket_at_a_time(solo_group):
    log: list = []
    buckets = [[("a", torch.ones(3)), ("b", torch.ones(2, 2))], [("c", torch.zeros(5))]]

    def lazy():
        for i, b in enumerate(buckets):
            log.append(("gathered", i))
            yield b

    sender = WeightSender([RecordingEngine(log)], solo_group, "solo", mode="bucket")
    report = sender.send_buckets(lazy(), 2, weight_version="v9")
    assert log == [("gathered", 0), ("bucket", ("a", "b"), False, None),
                   ("gathered", 1), ("bucket", ("c",), True, "v9")]
    assert (report.num_tensors, report.num_buckets, report.bytes) == (3, 2, 4 * 12)

    log.clear()
    sender = WeightSender([RecordingEngine(log)], solo_group, "solo", mode="per_tensor")
    sender.send_buckets(lazy(), 2, weight_version="v10")
    # the last tensor completes the update under its version in the same call: no auto-bumped version between
    assert log == [("gathered", 0), ("tensor", "a", False), ("tensor", "b", False), ("gathered", 1),
                   ("bucket", ("c",), True, "v10")]
    log.clear()
    sender.send_buckets(lazy(), 2)
    assert log[-1] == ("tensor", "c", True)
    with pytest.raises(ValueError, match="got 2 buckets, 3 were announced"):
        sender.send_buckets(iter(buckets), 3)


def test_broadcast_to_engines_reaches_every_engine_with_hf_names(hf_model, solo_group):
    log: list = []
    report = broadcast_to_engines(Wrapper(hf_model), [RecordingEngine(log), RecordingEngine(log)], solo_group,
                                  group_name="solo", bucket_bytes=64 << 10, dtype="bfloat16")
    names = [n for n, _ in hf_model.named_parameters()]
    announced = [n for entry in log[::2] for n in entry[1]]
    assert announced == names and log[::2] == log[1::2]  # both engines, same buckets, in order
    assert [e[2] for e in log] == [False] * (len(log) - 2) + [True, True]
    assert report.bytes == sum(p.numel() * 2 for p in hf_model.parameters())


# ---- the engine actor without Ray (what the GPU check runs) -----------------------------------------

def test_engine_actor_direct_calls_openrlhf_loop_and_buckets_match_transformers(tiny_dir):
    """examples/gpu_actor_check.py --device cpu: EngineActor through LocalActor, OpenRLHF's per-parameter
    loop and broadcast_to_engines after real training steps; fingerprints and greedy vs transformers."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "gpu_actor_check.py"), "--device", "cpu",
                           "--model", tiny_dir("llama"), "--max-new-tokens", "12"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "[PASS] A per-tensor (OpenRLHF loop): fingerprints equal True, greedy identical 6/6" in out
    assert "[PASS] A bucketed (broadcast_to_engines): fingerprints equal True, greedy identical 6/6" in out


# ---- colocated pushes and the FSDP2 bucket gather -----------------------------------------------------

def test_push_colocated_whole_model_and_buckets(hf_model, engine):
    """push_colocated into an in-process engine: the whole model in one call, then in buckets; the engine's
    weights equal the trainer's after each, and only the last call of a push completes the update."""
    import copy

    from trainer_adapters import push_colocated

    hf_model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.mul_(1.01)
    whole = push_colocated(Wrapper(hf_model), [engine], weight_version="whole")
    assert (whole["buckets"], whole["tensors"]) == (1, len(list(hf_model.parameters())))
    assert engine.weights_fingerprint() == weight_sync.fingerprint(list(hf_model.named_parameters()))
    assert engine.get_weight_version() == "whole"
    with torch.no_grad():
        for p in hf_model.parameters():
            p.mul_(0.99)
    bucketed = push_colocated(hf_model, [engine], bucket_bytes=64 << 10, weight_version="bucketed")
    assert bucketed["buckets"] > 1 and bucketed["bytes"] == whole["bytes"]
    assert [r[0]["complete"] for r in bucketed["results"]] == [False] * (bucketed["buckets"] - 1) + [True]
    assert engine.weights_fingerprint() == weight_sync.fingerprint(list(hf_model.named_parameters()))
    assert engine.get_weight_version() == "bucketed"
    assert push_colocated(hf_model, [], bucket_bytes=64 << 10) is None  # a rank without engines only gathers


def _gather_rows_rank(rank: int, port: int, result_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from trainer_adapters.fsdp2 import BucketBuffers, gather_rows

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        gen = torch.Generator().manual_seed(0)
        fulls = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen).to(torch.bfloat16),
                 torch.randn(2, 4, generator=gen).to(torch.float16), torch.randn(1, 6, generator=gen)]
        shards = [distribute_tensor(t, mesh, [Shard(0)]) for t in fulls]
        gathered = gather_rows(shards)
        # buckets in turn through two buffer sets (FSDP2Source.gathered): bucket 3 reuses bucket 1's memory,
        # and bucket 2 stays intact meanwhile
        slots = [BucketBuffers((0, 0)), BucketBuffers((0, 0))]
        first = gather_rows(shards[:2], slots[0])
        first_equal = [torch.equal(a, b) for a, b in zip(first, fulls[:2])]
        second = gather_rows(shards[2:], slots[1])
        third = gather_rows(shards[:2], slots[0])
        if rank == 0:
            torch.save({"equal": [torch.equal(a, b) for a, b in zip(gathered, fulls)],
                        "dtypes": [str(g.dtype) for g in gathered],
                        "buckets_equal": first_equal + [torch.equal(a, b) for a, b in
                                                        zip(second + third, fulls[2:] + fulls[:2])],
                        "reused": [a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                                   for a, b in zip(first, third)]}, result_path)
        del mesh, gathered, shards, first, second, third
    finally:
        dist.destroy_process_group()
        # The gloo group's worker threads must be joined before the interpreter finalizes: a worker that
        # drops its last reference to a collective's tensor then needs the GIL, and a thread taking the
        # GIL during finalization is ended by pthread_exit, which std::terminate()s through C++ frames
        # (SIGABRT, ~1 run in 4 on torch 2.13). Freeing the group here joins them.
        gc.collect()


def test_fsdp2_bucket_gather_matches_full_tensors(tmp_path):
    """gather_rows over two gloo ranks: uneven row splits (a rank with no rows), mixed dtypes, one collective;
    buckets gathered in turn into two reused buffer sets."""
    import torch.multiprocessing as mp

    out = tmp_path / "gathered.pt"
    mp.start_processes(_gather_rows_rank, args=(free_port(), str(out)), nprocs=2, start_method="spawn")
    result = torch.load(out)
    assert result["equal"] == [True] * 4
    assert result["dtypes"] == ["torch.float32", "torch.bfloat16", "torch.float16", "torch.float32"]
    assert result["buckets_equal"] == [True] * 6 and result["reused"] == [True, True]


@pytest.mark.parametrize("size, start, width", [(64, 0, 8), (36, 0, 4), (38, 2, 2), (37, 1, 1)])
def test_copy_bytes_takes_the_widest_type_the_layout_allows(monkeypatch, size, start, width):
    """The FSDP2 bucket copies move 8-, 4- or 2-byte words where sizes, strides and addresses allow, and are
    byte-exact either way (1-D, and 2-D column slices of a rank-major buffer)."""
    from trainer_adapters import fsdp2

    used = []
    real_view = torch.Tensor.view
    monkeypatch.setattr(torch.Tensor, "view", lambda t, *a: (used.append(a[0]) if a and isinstance(a[0], torch.dtype)
                                                               else None) or real_view(t, *a))
    src = torch.randint(0, 256, (start + size,), dtype=torch.uint8)[start:]
    dst = torch.zeros(start + size, dtype=torch.uint8)[start:]
    fsdp2.copy_bytes(dst, src)
    assert torch.equal(dst, src)
    assert used == ([] if width == 1 else [fsdp2._WIDE[width]] * 2)
    used.clear()
    rows = torch.randint(0, 256, (3, 64), dtype=torch.uint8)
    cols = torch.zeros(3, 16, dtype=torch.uint8)
    fsdp2.copy_bytes(cols, rows[:, 16:32])  # a column slice: row strides 64 and 16
    assert torch.equal(cols, rows[:, 16:32]) and used == [torch.int64] * 2


class _Source:
    """A stand-in ParamSource that logs when each bucket is gathered and when the iteration ends."""

    kind = "stub"

    def __init__(self, owns: bool, n: int, log: list) -> None:
        self.owns_buckets, self.log = owns, log
        self.params = [(f"w{i}", torch.full((2,), float(i))) for i in range(n)]

    def plan(self, mode, bucket_bytes, dtype=None):
        return [[i] for i in range(len(self.params))]

    def gathered(self, plan):
        for bucket in plan:
            self.log.append(f"gather {bucket[0]}")
            try:
                yield [self.params[i] for i in bucket]
            finally:
                self.log.append(f"release {bucket[0]}")
        self.log.append("end")


class _LoggingEngine:
    """Logs each push and, once per call, when its load is awaited; the call for ``fail`` raises."""

    def __init__(self, log: list, fail: str | None = None) -> None:
        self.log, self.fail = log, fail

    def update_weights_from_tensor(self, bucket, flush_cache, async_op, weight_version=None):
        name = bucket[0][0]
        self.log.append(f"push {name}{' flush' if flush_cache else ''}")
        log, fail = self.log, self.fail

        class Logged(Future):
            def result(self, timeout=None):
                if not getattr(self, "awaited", False):
                    self.awaited = True
                    log.append(f"loaded {name}")
                if name == fail:
                    raise ValueError(f"{name} refused")
                return {"complete": flush_cache}
        return Logged()


@pytest.mark.parametrize("owns", [True, False])
def test_push_colocated_gathers_ahead_only_where_buckets_outlive_the_iteration(monkeypatch, owns):
    """FSDP2-like sources (their buckets outlive one more step): bucket k+1 is gathered and sent while the
    engines load bucket k, and bucket k-1's load is awaited before its memory is gathered into again.
    ZeRO-3-like sources (leaving a bucket releases its gather): the next gather waits until the engines are
    done. Either way the iteration is run to its end (a collective context is left in step)."""
    from trainer_adapters import push_colocated, senders

    log: list = []
    monkeypatch.setattr(senders, "param_source", lambda model, backend: _Source(owns, 3, log))
    out = push_colocated(object(), [_LoggingEngine(log)], bucket_bytes=1)
    assert out["buckets"] == 3 and [r[0]["complete"] for r in out["results"]] == [False, False, True]
    if owns:
        assert log == ["gather 0", "push w0", "release 0", "gather 1", "push w1", "loaded w0", "release 1",
                       "gather 2", "push w2 flush", "loaded w1", "release 2", "end", "loaded w2"]
    else:
        assert log == ["gather 0", "push w0", "loaded w0", "release 0", "gather 1", "push w1", "loaded w1",
                       "release 1", "gather 2", "push w2 flush", "loaded w2", "release 2", "end"]


@pytest.mark.parametrize("owns", [True, False])
def test_push_colocated_failing_mid_push_still_runs_every_gather(monkeypatch, owns):
    """A bucket refused by the engine: the error is raised, but only after the calls in flight were awaited
    (no gather may reuse memory the engine still reads) and every remaining bucket was gathered, unsent, so
    the other trainer ranks' collectives are matched and their push ends instead of hanging."""
    from trainer_adapters import push_colocated, senders

    log: list = []
    monkeypatch.setattr(senders, "param_source", lambda model, backend: _Source(owns, 4, log))
    with pytest.raises(ValueError, match="w1 refused"):
        push_colocated(object(), [_LoggingEngine(log, fail="w1")], bucket_bytes=1)
    if owns:  # bucket 2 was already gathered and sent when bucket 1's failure was read
        assert log == ["gather 0", "push w0", "release 0", "gather 1", "push w1", "loaded w0", "release 1",
                       "gather 2", "push w2", "loaded w1", "loaded w2", "release 2", "gather 3", "release 3", "end"]
    else:
        assert log == ["gather 0", "push w0", "loaded w0", "release 0", "gather 1", "push w1", "loaded w1",
                       "release 1", "gather 2", "release 2", "gather 3", "release 3", "end"]


def test_a_call_refused_mid_session_keeps_the_engine_from_closing_it(hf_model, engine, path, hf_reference):
    """Bucket 1 loads, bucket 2 is refused, bucket 3 asks to close the session: the weights are a mix, so the
    engine marks them inconsistent, keeps the version and refuses requests instead of serving the mix;
    a complete push makes them whole again."""
    import copy

    from trainer_adapters import push_colocated

    trained = copy.deepcopy(hf_model)
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(1.02)
    named = [(n, p.detach()) for n, p in trained.named_parameters()]
    version = engine.get_weight_version()
    engine.update_weights_from_tensor(named[:2], flush_cache=False)
    name, t = named[2]
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights_from_tensor([(name, t[:1])], flush_cache=False)
    engine.update_weights_from_tensor(named[3:], flush_cache=True, weight_version="mixed")
    state = engine.get_weight_state()
    assert state["state"] == "inconsistent" and "refused mid-update" in state["reason"]
    assert engine.get_weight_version() == version
    with pytest.raises(RuntimeError, match="refuses to generate"):
        engine.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False)
    push_colocated(trained, [engine], bucket_bytes=64 << 10, weight_version="whole")
    assert engine.get_weight_state()["state"] == "consistent" and engine.get_weight_version() == "whole"
    assert engine.weights_fingerprint() == weight_sync.fingerprint(list(trained.named_parameters()))
    push_colocated(hf_model, [engine], weight_version="restored")  # the module's engine serves the checkpoint again
    out = engine.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False,
                          sampling_params=SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_reference(path).greedy([5, 6, 7], 6)



def test_a_push_whose_first_call_is_refused_is_not_served_as_a_new_version(hf_model, engine):
    """Bucket 1 is refused (a NaN under check_finite) before anything loaded, the other buckets load and the last
    asks to close the update: the weights lack bucket 1's parameters, so (as when a later bucket is refused) the
    engine marks them inconsistent and keeps the version; flush_cache() after a refusal starts afresh."""
    import copy

    from trainer_adapters import push_colocated

    trained = copy.deepcopy(hf_model)
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(1.03)
    named = [(n, p.detach()) for n, p in trained.named_parameters()]
    bad = [(n, t.clone()) for n, t in named[:2]]
    bad[0][1][0, 0] = float("nan")
    version = engine.get_weight_version()
    with pytest.raises(ValueError, match="non-finite"):
        engine.update_weights_from_tensor(bad, flush_cache=False, check_finite=True)
    engine.update_weights_from_tensor(named[2:], flush_cache=True, check_finite=True)
    state = engine.get_weight_state()
    assert state["state"] == "inconsistent" and "was refused" in state["reason"], state
    assert engine.get_weight_version() == version
    push_colocated(hf_model, [engine], weight_version="restored")  # whole again (the module's checkpoint)
    assert engine.get_weight_state()["state"] == "consistent"
    with pytest.raises(ValueError, match="non-finite"):
        engine.update_weights_from_tensor(bad, flush_cache=False, check_finite=True)
    engine.flush_cache()  # the caller ends that push: a partial update afterwards closes as any other
    engine.update_weights_from_tensor(list(hf_model.named_parameters())[:2], weight_version="partial")
    assert engine.get_weight_state()["state"] == "consistent" and engine.get_weight_version() == "partial"
    with pytest.raises(ValueError, match="non-finite"):  # a refused call that was a whole update on its own
        engine.update_weights_from_tensor(bad, check_finite=True)
    engine.update_weights_from_tensor(list(hf_model.named_parameters())[:2], weight_version="partial-2")
    assert engine.get_weight_state()["state"] == "consistent" and engine.get_weight_version() == "partial-2"

def _push_failing_rank(rank: int, port: int, result_path: str) -> None:
    """One FSDP2 rank of two: rank 0's engine refuses the second bucket, rank 1 has no engine."""
    import torch.distributed as dist

    from adapter_trainer import fsdp2_linear_stack
    from trainer_adapters import push_colocated

    try:
        model = fsdp2_linear_stack(rank, port, layers=4, timeout_s=60)
        log: list = []

        class Refusing:
            def update_weights_from_tensor(self, bucket, flush_cache, async_op, weight_version=None):
                log.append(len(log))
                fut: Future = Future()
                if len(log) == 2:
                    fut.set_exception(ValueError("bucket refused"))
                else:
                    fut.set_result({"complete": flush_cache})
                return fut

        error = None
        try:
            push_colocated(model, [Refusing()] if rank == 0 else None, bucket_bytes=16 * 17 * 4)
        except ValueError as e:
            error = str(e)
        # both ranks are in step after the push: the next collective matches
        after = torch.tensor([rank + 1.0])
        dist.all_reduce(after)
        torch.save({"error": error, "calls": len(log), "after": after.item()}, f"{result_path}.{rank}")
        del model
    finally:
        dist.destroy_process_group()
        gc.collect()


def test_fsdp2_push_failing_on_one_rank_leaves_the_other_rank_in_step(tmp_path):
    """Two FSDP2 ranks over gloo, four buckets: rank 0's engine refuses bucket 2. Rank 0 raises, rank 1 (no
    engine) finishes its push, and both meet at the next collective."""
    import torch.multiprocessing as mp

    out = tmp_path / "push"
    mp.start_processes(_push_failing_rank, args=(free_port(), str(out)), nprocs=2, start_method="spawn")
    first, second = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert first["error"] == "bucket refused" and second["error"] is None
    assert first["calls"] in (2, 3)  # bucket 3 may already be on its way when bucket 2's refusal is read
    assert first["after"] == second["after"] == 3.0
