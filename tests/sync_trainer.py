"""A real trainer process for weight-sync tests: holds the checkpoint in transformers, trains, pushes.

``run_trainer`` is the process target. It drives engines living in the test process through
``RemoteEngine`` proxies and reports measurements (fingerprints, greedy ids, logprobs) back to the
test, which asserts on them. Nothing here decides pass or fail.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from reference import hf_greedy, hf_logprobs

CHECK_PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46], [100, 3, 250, 17], [9] * 12]
GREEDY = dict(temperature=0.0, max_new_tokens=10, ignore_eos=True, logprobs=0)


def train_step(model: Any, seed: int, lr: float = 0.05) -> float:
    """One real AdamW step on a language-modelling loss over random token sequences."""
    g = torch.Generator().manual_seed(seed)
    batch = torch.randint(3, model.config.vocab_size, (4, 24), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = model(batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    return float(loss)


def measure(model: Any, engines: list[Any]) -> dict[str, Any]:
    """Fingerprints and greedy/logprob parity of every engine against the trainer's model."""
    import weight_sync

    out: dict[str, Any] = {"trainer_fp": weight_sync.fingerprint(model), "engines": []}
    ref = [hf_greedy(model, p, GREEDY["max_new_tokens"]) for p in CHECK_PROMPTS]
    out["hf_greedy"] = ref
    for engine in engines:
        outs = engine.generate(prompt_token_ids=CHECK_PROMPTS, sampling_params=GREEDY, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        deltas = [abs(a - b) for p, o in zip(CHECK_PROMPTS, outs)
                  for a, b in zip(o.outputs[0].token_logprobs, hf_logprobs(model, p, o.outputs[0].token_ids))]
        out["engines"].append({"fp": engine.weights_fingerprint(), "greedy": got, "max_dlogprob": max(deltas),
                               "version": outs[0].weight_version, "state": engine.get_weight_state()})
    return out


def join_group(engines: list[Any], tp_sizes: list[int], port: int, group_name: str, timeout: float = 60.0) -> Any:
    import weight_sync

    world = 1 + sum(tp_sizes)
    offsets = [1 + sum(tp_sizes[:i]) for i in range(len(engines))]
    futs = [e.init_process_group("127.0.0.1", port, off, world, group_name, backend="gloo", timeout=timeout,
                                 async_op=True) for e, off in zip(engines, offsets)]
    group = weight_sync.init_process_group("127.0.0.1", port, 0, world, group_name, backend="gloo", timeout=timeout)
    for f in futs:
        f.result()
    return group


def push(mode: str, model: Any, engines: list[Any], group: Any, group_name: str) -> dict[str, Any]:
    """Push every parameter with one of the update paths; returns timing."""
    import weight_sync
    from rollout.weights.buckets import flatten

    named = [(n, p.detach()) for n, p in model.named_parameters()]
    if mode == "per_expert":  # a transformers 4 trainer (OpenRLHF's loop): one tensor per expert projection
        named, mode = per_expert_named(model), "openrlhf"
    start = time.perf_counter()
    if mode in ("bucket", "per_tensor"):
        sender = weight_sync.WeightSender(engines, group, group_name, bucket_bytes=64 << 10,
                                          mode=mode)
        return {"summary": sender.send(named).summary()}
    if mode == "openrlhf":  # OpenRLHF's loop, written out: announce, then plain torch.distributed.broadcast
        for i, (name, p) in enumerate(named):
            refs = [e.update_weight(name, dtype=p.dtype, shape=list(p.shape), empty_cache=i == len(named) - 1,
                                    async_op=True) for e in engines]
            dist.broadcast(p, 0, group=group)
            [r.result() for r in refs]
    elif mode == "sglang":  # SGLang's flattened buckets, two of them
        half = len(named) // 2
        for k, bucket in enumerate((named[:half], named[half:])):
            refs = [e.update_weights_from_distributed([n for n, _ in bucket], [str(t.dtype) for _, t in bucket],
                                                      [list(t.shape) for _, t in bucket], group_name,
                                                      flush_cache=k == 1, load_format="flattened_bucket",
                                                      async_op=True) for e in engines]
            dist.broadcast(flatten([t for _, t in bucket]), 0, group=group)
            [r.result() for r in refs]
    elif mode == "disk":
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            for e in engines:
                e.update_weights_from_disk(d)
    elif mode == "tensor":
        for e in engines:
            e.update_weights_from_tensor(named)
    else:
        raise ValueError(mode)
    return {"summary": f"{mode}: {time.perf_counter() - start:.3f} s"}


def per_expert_named(model: Any) -> list[tuple[str, torch.Tensor]]:
    """``model``'s parameters as a transformers 4 MoE model names them: transformers 5's fused
    ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] become one tensor per expert and
    projection, under the checkpoint's names (Qwen3-MoE ``mlp.experts.{e}.gate_proj.weight``; Mixtral
    ``block_sparse_moe.experts.{e}.w1.weight``, and its router ``block_sparse_moe.gate.weight``)."""
    mixtral = model.config.model_type == "mixtral"
    block, (gate, up, down) = ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    out = []
    for name, p in model.named_parameters():
        prefix, _, last = name.rpartition(".mlp.")
        if last == "gate.weight":
            out.append((f"{prefix}.{block}.gate.weight", p.detach()))
        elif last == "experts.gate_up_proj":
            inter = p.shape[1] // 2
            for e in range(p.shape[0]):
                out.append((f"{prefix}.{block}.experts.{e}.{gate}.weight", p.detach()[e, :inter]))
                out.append((f"{prefix}.{block}.experts.{e}.{up}.weight", p.detach()[e, inter:]))
        elif last == "experts.down_proj":
            out += [(f"{prefix}.{block}.experts.{e}.{down}.weight", p.detach()[e]) for e in range(p.shape[0])]
        else:
            out.append((name, p.detach()))
    return [(n, t.contiguous()) for n, t in out]


def run_trainer(conns: list[Any], tp_sizes: list[int], path: str, port: int, plan: list[dict[str, Any]],
                results: Any) -> None:
    """Process target: train and push per ``plan``; put one result dict per step on ``results``."""
    from transformers import AutoModelForCausalLM

    from weight_sync.remote import RemoteEngine

    assert not dist.is_initialized()
    engines = [RemoteEngine(c) for c in conns]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    group_name = f"g{port}"
    group = join_group(engines, tp_sizes, port, group_name)
    for i, step in enumerate(plan):
        try:
            results.put({"step": i, **run_step(step, model, engines, group, group_name, i)})
        except Exception as e:  # noqa: BLE001 - reported to the test
            results.put({"step": i, "error": f"{type(e).__name__}: {e}"})
    assert not dist.is_initialized(), "the trainer never had a default group"


def run_step(step: dict[str, Any], model: Any, engines: list[Any], group: Any, group_name: str, i: int
             ) -> dict[str, Any]:
    kind = step["kind"]
    if kind == "train_and_push":
        loss = train_step(model, seed=100 + i)
        timing = push(step["mode"], model, engines, group, group_name)
        return {"loss": loss, **timing, **measure(model, engines)}
    if kind == "bad":
        return {"error_seen": bad_update(step["case"], model, engines[0], group, group_name),
                **measure(model, engines)}
    if kind == "die_mid_update":
        die_mid_update(model, engines[0], group, group_name)
    raise ValueError(kind)


def bad_update(case: str, model: Any, engine: Any, group: Any, group_name: str) -> str:
    """Send one bad update the way a trainer would; returns the engine's error message."""
    name, p = next(iter(model.named_parameters()))
    junk = torch.randn(p.shape)
    spec: dict[str, Any] = {"names": [name], "dtypes": ["float32"], "shapes": [list(p.shape)]}
    broadcast = junk
    if case == "unknown_name":
        spec["names"] = ["model.layers.99.mlp.up_proj.weight"]
    elif case == "wrong_shape":
        broadcast = torch.randn(p.shape[0], p.shape[1] + 1)
        spec["shapes"] = [list(broadcast.shape)]
    elif case == "wrong_dtype":
        broadcast = torch.randint(0, 5, tuple(p.shape), dtype=torch.int64)
        spec["dtypes"] = ["int64"]
    elif case == "nonfinite":
        junk[0, 0] = float("nan")
        spec["check_finite"] = True
    elif case == "per_tensor_unknown":
        fut = engine.update_weight("lm_head.bogus", "float32", list(p.shape), async_op=True)
        dist.broadcast(junk, 0, group=group)
        return _error_of(fut)
    elif case == "mismatched_lists":
        return _error_of(engine.update_weights_from_distributed([name, name], ["float32"], [list(p.shape)],
                                                                group_name, async_op=True))
    elif case == "no_group":
        return _error_of(engine.update_weights_from_distributed(**spec, group_name="nope", async_op=True))
    fut = engine.update_weights_from_distributed(**spec, group_name=group_name, load_format="flattened_bucket",
                                                 async_op=True)
    from rollout.weights.buckets import flatten

    dist.broadcast(flatten([broadcast]), 0, group=group)
    return _error_of(fut)


def _error_of(fut: Any) -> str:
    try:
        fut.result(timeout=60)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return ""


def die_mid_update(model: Any, engine: Any, group: Any, group_name: str) -> None:
    """Push the first half of the weights, announce the second half, then get killed."""
    from rollout.weights.buckets import flatten

    train_step(model, seed=999)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    half = len(named) // 2
    first, second = named[:half], named[half:]
    fut = engine.update_weights_from_distributed([n for n, _ in first], ["float32"] * half,
                                                 [list(t.shape) for _, t in first], group_name, flush_cache=False,
                                                 load_format="flattened_bucket", async_op=True)
    dist.broadcast(flatten([t for _, t in first]), 0, group=group)
    fut.result()
    engine.update_weights_from_distributed([n for n, _ in second], ["float32"] * len(second),
                                           [list(t.shape) for _, t in second], group_name,
                                           load_format="flattened_bucket", async_op=True)
    time.sleep(1.0)  # the engine is now waiting for the broadcast
    os.kill(os.getpid(), signal.SIGKILL)
