"""Live weight sync on CPU (gloo) between a real trainer process and real engines."""

from __future__ import annotations

import multiprocessing as mp
import queue
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from rollout import Engine, SamplingParams
from weight_sync.remote import serve_engine

from sync_trainer import CHECK_PROMPTS, run_trainer

from rollout.ipc import free_port

CTX = mp.get_context("spawn")




def start_trainer(engines: list[Engine], tp_sizes: list[int], path: str, plan: list[dict]) -> tuple[mp.Process, mp.Queue]:
    conns = []
    for engine in engines:
        mine, theirs = CTX.Pipe()
        serve_engine(engine, mine)
        conns.append(theirs)
    results = CTX.Queue()
    proc = CTX.Process(target=run_trainer, args=(conns, tp_sizes, path, free_port(), plan, results), daemon=True)
    proc.start()
    return proc, results


def collect(proc: mp.Process, results: mp.Queue, n: int, timeout: float = 300) -> list[dict]:
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        try:
            out.append(results.get(timeout=1))
        except queue.Empty:
            if not proc.is_alive() or time.monotonic() > deadline:
                raise AssertionError(f"trainer stopped after {len(out)} of {n} steps (exit {proc.exitcode})")
    return out


def check_synced(step: dict, n_engines: int = 1) -> None:
    assert "error" not in step, step.get("error")
    assert len(step["engines"]) == n_engines
    for eng in step["engines"]:
        assert eng["fp"] == step["trainer_fp"], "engine weights differ from the trainer's"
        assert eng["greedy"] == step["hf_greedy"], "greedy outputs differ from transformers on the new weights"
        assert eng["max_dlogprob"] < 1e-4
        assert eng["state"]["state"] == "consistent"


def _group_member(rank: int, port: int, out: mp.Queue) -> None:
    import weight_sync

    group = weight_sync.init_process_group("127.0.0.1", port, rank, 2, "plain", backend="gloo", timeout=30)
    t = torch.arange(6, dtype=torch.float32) if rank == 0 else torch.zeros(6)
    torch.distributed.broadcast(t, 0, group=group)
    out.put((rank, dist.is_initialized(), t.tolist()))


def test_trainer_group_works_with_plain_broadcast_without_a_default_group():
    port, out = free_port(), CTX.Queue()
    procs = [CTX.Process(target=_group_member, args=(r, port, out)) for r in range(2)]
    [p.start() for p in procs]
    got = sorted(out.get(timeout=60) for _ in procs)
    [p.join(30) for p in procs]
    assert got == [(0, False, [0.0, 1, 2, 3, 4, 5]), (1, False, [0.0, 1, 2, 3, 4, 5])]


class _GroupMember:
    """An engine stand-in for ``join_engines``: it logs its calls and answers with done futures."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def init_process_group(self, host, port, rank_offset, world_size, group_name, backend, timeout, async_op):
        from concurrent.futures import Future

        self.log.append((self.name, "join", rank_offset, world_size, timeout, async_op))
        done = Future()
        done.set_result(True)
        return done

    def destroy_process_group(self, group_name, async_op):
        from concurrent.futures import Future

        self.log.append((self.name, "leave", group_name, async_op))
        done = Future()
        done.set_result(True)
        return done


def test_join_engines_gives_each_engine_its_ranks_and_leaves_together(monkeypatch):
    """Engine i of TP size t joins as ranks 1 + i*t ... asynchronously, before the trainer joins as rank 0 (the
    joins block until all ranks are in); leaving is submitted to the engines first too. The real groups run
    in the smoke and bench tests."""
    import weight_sync
    from weight_sync import handshake

    log: list = []
    monkeypatch.setattr(handshake, "init_process_group",
                        lambda host, port, rank, world, name, backend, timeout: log.append(("trainer", "join", rank,
                                                                                           world, timeout)) or "g")
    monkeypatch.setattr(handshake, "destroy_process_group", lambda group: log.append(("trainer", "leave", group)))
    engines = [_GroupMember("a", log), _GroupMember("b", log)]
    group = weight_sync.join_engines(engines, "handshake", backend="gloo", tp_size=2, timeout=60)
    weight_sync.leave_engines(engines, group, "handshake")
    assert log == [("a", "join", 1, 5, 60, True), ("b", "join", 3, 5, 60, True), ("trainer", "join", 0, 5, 60),
                   ("a", "leave", "handshake", True), ("b", "leave", "handshake", True), ("trainer", "leave", "g")]


def test_every_update_mode_tp1(path):
    modes = ["bucket", "per_tensor", "openrlhf", "sglang", "disk", "tensor"]
    with Engine(path, dtype="float32", device="cpu") as engine:
        before = engine.get_weight_version()
        proc, results = start_trainer([engine], [1], path, [{"kind": "train_and_push", "mode": m} for m in modes])
        steps = collect(proc, results, len(modes))
        proc.join(30)
    versions = [int(before)]
    for mode, step in zip(modes, steps):
        check_synced(step)
        versions.append(int(step["engines"][0]["version"]))
    assert versions == list(range(int(before), int(before) + len(modes) + 1)), versions
    assert len({s["trainer_fp"] for s in steps}) == len(modes), "each step trained the weights"


def test_tp2_and_two_engines_in_one_group(path):
    with Engine(path, dtype="float32", device="cpu", tp_size=2) as tp2, \
            Engine(path, dtype="float32", device="cpu") as tp1:
        plan = [{"kind": "train_and_push", "mode": m} for m in ("bucket", "openrlhf")]
        proc, results = start_trainer([tp2, tp1], [2, 1], path, plan)
        steps = collect(proc, results, len(plan))
        proc.join(30)
    for step in steps:
        check_synced(step, n_engines=2)


BAD_CASES = {
    "unknown_name": "unknown parameter name",
    "wrong_shape": "wrong shape",
    "wrong_dtype": "wrong dtype",
    "nonfinite": "non-finite",
    "per_tensor_unknown": "unknown parameter name",
    "mismatched_lists": "one length",
    "no_group": "not initialized",
}


def test_bad_updates_are_rejected_and_old_weights_keep_serving(path, hf_reference):
    hf = hf_reference(path)
    with Engine(path, dtype="float32", device="cpu") as engine:
        fp0 = engine.weights_fingerprint()
        plan = [{"kind": "bad", "case": c} for c in BAD_CASES]
        proc, results = start_trainer([engine], [1], path, plan)
        steps = collect(proc, results, len(plan), timeout=120)
        proc.join(30)
        for case, step in zip(BAD_CASES, steps):
            assert "error" not in step, step.get("error")
            assert BAD_CASES[case] in step["error_seen"], (case, step["error_seen"])
            eng = step["engines"][0]
            assert eng["fp"] == fp0 == step["trainer_fp"], case
            assert eng["state"]["state"] == "consistent" and eng["version"] == "0"
        out = engine.generate(prompt_token_ids=CHECK_PROMPTS, use_tqdm=False,
                              sampling_params=SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in out] == [hf.greedy(p, 10) for p in CHECK_PROMPTS]


def test_trainer_killed_mid_update_then_a_complete_update_restores(path, hf_reference):
    with Engine(path, dtype="float32", device="cpu") as engine:
        proc, results = start_trainer([engine], [1], path, [{"kind": "die_mid_update"}])
        proc.join(120)
        assert proc.exitcode == -9
        deadline = time.monotonic() + 60
        while engine.get_weight_state()["state"] != "inconsistent":
            assert time.monotonic() < deadline, engine.get_weight_state()
            time.sleep(0.2)
        state = engine.get_weight_state()
        assert "mix of two versions" in state["reason"] and state["groups"] == []
        with pytest.raises(RuntimeError, match="refuses to generate"):
            engine.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False)
        proc, results = start_trainer([engine], [1], path, [{"kind": "train_and_push", "mode": "bucket"}])
        (step,) = collect(proc, results, 1)
        proc.join(30)
        check_synced(step)
        engine.update_weights_from_disk(path)
        assert engine.weights_fingerprint() != step["trainer_fp"]
        hf = hf_reference(path)
        out = engine.generate(prompt_token_ids=CHECK_PROMPTS[:2], use_tqdm=False,
                              sampling_params=SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in out] == [hf.greedy(p, 10) for p in CHECK_PROMPTS[:2]]


def test_update_waits_for_in_flight_requests_and_pause_modes(path):
    import weight_sync

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # ready before the request starts
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    with Engine(path, dtype="float32", device="cpu", keep_weight_copy=True) as engine:
        fp0 = engine.weights_fingerprint()
        params = SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True)
        stream = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, stream=True)
        assert next(stream).outputs[0].finish_reason is None, "the request must still run when the update comes"
        result = engine.update_weights_from_tensor(list(model.named_parameters()))
        chunks = list(stream)
        assert chunks[-1].outputs[0].finish_reason == "length"
        assert chunks[-1].weight_version == "0", "the in-flight request finished on the old weights"
        assert result["weight_version"] == "1" and engine.weights_fingerprint() == weight_sync.fingerprint(model)
        engine.rollback_weights()
        assert engine.weights_fingerprint() == fp0 and engine.get_weight_version() == "0"
        engine.update_weight_version("v-before-disk")
        with tempfile.TemporaryDirectory() as tmp:  # a reload rolls back with its version too (it kept "disk-1")
            model.save_pretrained(tmp)
            engine.update_weights_from_disk(tmp, weight_version="disk-1")
        assert engine.get_weight_version() == "disk-1"
        assert engine.weights_fingerprint() == weight_sync.fingerprint(model)
        engine.rollback_weights()
        assert engine.weights_fingerprint() == fp0 and engine.get_weight_version() == "v-before-disk"

        stream = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, stream=True)
        next(stream)
        engine.pause_generation(mode="abort")
        assert list(stream)[-1].outputs[0].finish_reason == "abort"
        held = engine.generate(prompt_token_ids=[[8, 9]], sampling_params=SamplingParams(max_new_tokens=3),
                               stream=True)
        engine.update_weights_from_tensor(list(model.named_parameters()), weight_version="v-paused")
        engine.continue_generation()
        assert list(held)[-1].weight_version == "v-paused"


def test_a_bumped_version_never_names_other_weights_after_a_rollback(path):
    """Update (version 1), roll back (version 0 again), update with other weights: "1" already named the weights
    that were rolled back, so outputs and token versions labelled "1" would no longer say which weights made them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with Engine(path, dtype="float32", device="cpu", keep_weight_copy=True) as engine:
        first = [(n, p.detach() * 1.01) for n, p in model.named_parameters()]
        assert engine.update_weights_from_tensor(first)["weight_version"] == "1"
        assert engine.rollback_weights()["weight_version"] == "0"
        second = [(n, p.detach() * 1.02) for n, p in model.named_parameters()]
        assert engine.update_weights_from_tensor(second)["weight_version"] == "2"
        assert engine.rollback_weights()["weight_version"] == "0"
        engine.update_weight_version("3")
        assert engine.update_weights_from_tensor(first)["weight_version"] == "4"


def test_fingerprint_of_a_tied_models_state_dict_counts_the_tied_head_once(tiny_dir):
    """A tied model's state_dict holds lm_head.weight beside the embedding (the same tensor); the engine stores one
    parameter and named_parameters lists one, so the fingerprint of the state_dict must equal theirs (it had an
    extra lm_head.weight entry: 'the weights differ' although they were equal). Distinct tensors still count."""
    import weight_sync
    from transformers import AutoModelForCausalLM

    tied = AutoModelForCausalLM.from_pretrained(tiny_dir("llama", tie_word_embeddings=True), dtype=torch.float32)
    assert "lm_head.weight" in tied.state_dict()
    assert weight_sync.fingerprint(tied.state_dict()) == weight_sync.fingerprint(tied)
    assert weight_sync.fingerprint(list(tied.state_dict().items())) == weight_sync.fingerprint(tied)
    untied = AutoModelForCausalLM.from_pretrained(tiny_dir("llama"), dtype=torch.float32)
    same = {n: t.clone() for n, t in untied.state_dict().items()}
    same["lm_head.weight"] = same["model.embed_tokens.weight"].clone()  # equal values, two tensors: both count
    assert weight_sync.fingerprint(same) != weight_sync.fingerprint({n: t for n, t in same.items() if n != "lm_head.weight"})


def _fsdp2_tied_state_dict_rank(rank: int, port: int, path: str, result_path: str) -> None:
    from datetime import timedelta

    import weight_sync
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sd = model.state_dict()
        result = {"dtensor": type(sd["lm_head.weight"]).__name__, "two_objects": sd["lm_head.weight"] is not
                  sd["model.embed_tokens.weight"], "model": weight_sync.fingerprint(model),
                  "state_dict": weight_sync.fingerprint(sd)}
        torch.save(result, f"{result_path}.{rank}")
    finally:
        dist.destroy_process_group()


def test_fingerprint_of_an_fsdp2_tied_models_state_dict_counts_the_tied_head_once(tiny_dir, tmp_path):
    """An FSDP2 model's state_dict gives a tied lm_head.weight and the embedding as two DTensor objects over one
    local shard; the fingerprint counted both (it cannot tell DTensors apart by storage), so it differed from the
    model's (the engine's) although the weights were equal. Every rank now counts the head once, in step."""
    import weight_sync
    from transformers import AutoModelForCausalLM

    path = tiny_dir("llama", tie_word_embeddings=True)
    out = str(tmp_path / "fp")
    torch.multiprocessing.start_processes(_fsdp2_tied_state_dict_rank, args=(free_port(), path, out), nprocs=2,
                                          start_method="spawn")
    results = [torch.load(f"{out}.{rank}") for rank in range(2)]
    served = weight_sync.fingerprint(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    for r in results:
        assert r["dtensor"] == "DTensor" and r["two_objects"]
        assert r["model"] == served
        assert r["state_dict"] == served


def test_fingerprint_counts_one_tensor_sent_under_several_names_once_per_name(tiny_dir):
    """A trainer's dict may give several parameters one tensor (every norm ``torch.ones(h)``, or ``expand``ed views
    of one value); the engine and transformers' ``load_state_dict`` store a copy per name, so each counts. The
    fingerprint counted only the first (it took any shared storage for a tied head): 'the weights differ' although
    the engine held exactly what transformers held."""
    import weight_sync
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir("llama"), dtype=torch.float32)
    norms = [n for n, _ in model.named_parameters() if n.endswith("norm.weight")]
    for shared in (torch.full((model.config.hidden_size,), 1.5), torch.tensor(1.5).expand(model.config.hidden_size)):
        sd = {**model.state_dict(), **dict.fromkeys(norms, shared)}
        with torch.no_grad():
            model.load_state_dict(sd)
        assert weight_sync.fingerprint(sd) == weight_sync.fingerprint(model)
        assert weight_sync.fingerprint(list(sd.items())) == weight_sync.fingerprint(model)


def test_a_tied_head_and_embedding_load_only_with_the_same_bits(tiny_dir):
    """With tied embeddings the head and the embedding are one parameter, and transformers' ``load_state_dict``
    keeps the head's values. The engine compared them with ``torch.equal`` and kept whichever came last: a -0.0 head
    before a 0.0 embedding (or a bfloat16 head before its float32 embedding) left the embedding's bits, and one
    tensor with a NaN in it was refused as 'differs'. Now the same bits load, others are refused untouched."""
    import weight_sync
    from transformers import AutoModelForCausalLM

    path = tiny_dir("llama", tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    emb = model.model.embed_tokens.weight.detach().clone() * 2
    emb[0, 0] = float("nan")
    zero, neg = emb.clone(), emb.clone()
    zero[1, :3], neg[1, :3] = 0.0, -0.0
    with Engine(path, dtype="float32", device="cpu") as engine:
        engine.update_weights_from_tensor([("model.embed_tokens.weight", emb), ("lm_head.weight", emb)])
        with torch.no_grad():
            model.load_state_dict({"model.embed_tokens.weight": emb, "lm_head.weight": emb}, strict=False)
        fp = engine.weights_fingerprint()
        assert fp == weight_sync.fingerprint(model) and engine.get_weight_state()["state"] == "consistent"
        for head, embedding in ((neg, zero), (emb.to(torch.bfloat16), emb)):
            with pytest.raises(ValueError, match="lm_head.weight differs"):
                engine.update_weights_from_tensor([("lm_head.weight", head), ("model.embed_tokens.weight", embedding)])
            assert engine.weights_fingerprint() == fp and engine.get_weight_state()["state"] == "consistent"


def test_an_empty_weight_version_is_refused_before_loading(path):
    """weight_version='' named the weights '' (an output's version when none is known) and every later bump
    '+1', '+1+1', ...; it is refused before anything loads, on every path. An int names the weights by its str."""
    from transformers import AutoModelForCausalLM

    named = list(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict().items())
    with Engine(path, dtype="float32", device="cpu") as engine:
        assert engine.update_weights_from_tensor(named[:2], weight_version=7)["weight_version"] == "7"
        fp = engine.weights_fingerprint()
        for call in (lambda: engine.update_weights_from_tensor([(n, t * 2) for n, t in named[:2]], weight_version=""),
                     lambda: engine.update_weights_from_disk(path, weight_version=""),
                     lambda: engine.update_weight_version("")):
            with pytest.raises(ValueError, match="non-empty"):
                call()
            assert engine.weights_fingerprint() == fp and engine.get_weight_version() == "7"
            assert engine.get_weight_state()["state"] == "consistent"
        assert engine.update_weights_from_tensor(named[:2])["weight_version"] == "8"
