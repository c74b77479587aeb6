"""GPU check of the engine actor's weight paths, without Ray (the 2xH200 machine has none).

Run on 2 GPUs with

    python examples/gpu_actor_check.py --out docs/results/<date>-h200x2-gpu-actor-check.json

(or ``bash gpu_checks/run_gpu.sh actor``) and record the printed summary in docs/trainer_adapters.md, where
the 2xH200 results of 2026-11-22 are. ``--device cpu`` runs part A over gloo on
CPU (that is how this script was tested; part B needs CUDA and is skipped there).

The ``EngineActor`` methods are called directly, through ``LocalActor`` (one ordered worker thread per
actor, the same order Ray keeps), in OpenRLHF's call pattern:

A. NCCL: engine on GPU 0, trainer on GPU 1, in this process. ``init_process_group.remote`` on the actor,
   the trainer joins as rank 0, a real optimizer step, then (1) OpenRLHF's per-parameter loop
   (``update_weight.remote`` + ``torch.distributed.broadcast``), checked; (2) another step, then the
   bucketed ``broadcast_to_engines``, checked.
B. CUDA IPC: trainer and engine on GPU 0. Another step, then ``push_cuda_ipc`` (OpenRLHF's
   ``update_weight_cuda_ipc`` per tensor with ``{GPU UUID: reduce_tensor(weight)}`` handles), checked.

Each check: the engine's ``weights_fingerprint()`` equals ``weight_sync.fingerprint`` of the trainer's
weights (in the engine's dtype), and greedy outputs equal transformers' on those weights, or differ only
at near-ties (every engine token is transformers' argmax within ``--tie-tol``, as ``rollout-smoke`` does).
Exit status 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from typing import Any

from rollout.ipc import free_port

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 7 times 8?",
             "Write a haiku about the sea.", "Who wrote Romeo and Juliet?", "How many legs does a spider have?"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default="bfloat16", help="engine dtype (float32 on CPU)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--tie-tol", type=float, default=None, help="near-tie tolerance (default by dtype)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)




def train_step(model: Any, tok: Any, lr: float, seed: int) -> float:
    """One AdamW step of language modelling on a few chat answers (every parameter changes)."""
    import torch

    torch.manual_seed(seed)
    device = next(model.parameters()).device
    texts = [f"Q: {q}\nA: Here is a short answer number {seed}." for q in QUESTIONS]
    batch = tok(texts, return_tensors="pt", padding=True).to(device)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = model(**batch, labels=labels).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    return float(loss)


def check(actor: Any, model: Any, tok: Any, args: argparse.Namespace, engine_dtype: Any) -> dict[str, Any]:
    """Fingerprint equality and greedy parity (with the near-tie rule) against transformers."""
    import weight_sync
    from trainer_adapters import get
    from weight_sync.hf_compare import greedy_gaps, hf_greedy

    served = model if next(model.parameters()).dtype == engine_dtype else copy.deepcopy(model).to(engine_dtype)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = get(actor.chat.remote(chats, {"temperature": 0.0, "max_tokens": args.max_new_tokens}))
    identical, gaps = 0, []
    for o in outs:
        ref = hf_greedy(served, o.prompt_token_ids, args.max_new_tokens, tok.eos_token_id)
        identical += o.outputs[0].token_ids == ref
        gaps.append(max(greedy_gaps(served, o.prompt_token_ids, o.outputs[0].token_ids), default=0.0))
    tol = args.tie_tol if args.tie_tol is not None else (1e-4 if args.device == "cpu" else 0.1)
    fp_engine = get(actor.weights_fingerprint.remote())
    fp_trainer = weight_sync.fingerprint(model, dtype=engine_dtype)
    result = {"fingerprints_equal": fp_engine == fp_trainer, "greedy_identical": f"{identical}/{len(outs)}",
              "greedy_max_gap": max(gaps), "version": outs[0].weight_version,
              "sample": outs[0].outputs[0].text.strip()[:60]}
    result["passed"] = result["fingerprints_equal"] and (identical == len(outs) or max(gaps) <= tol)
    return result


def part_a(actor: Any, model: Any, tok: Any, args: argparse.Namespace, engine_dtype: Any) -> dict[str, Any]:
    import torch

    import weight_sync
    from trainer_adapters import broadcast_to_engines, get

    backend = "nccl" if args.device == "cuda" else "gloo"
    port, name = free_port(), "gpu-actor-check"
    joined = actor.init_process_group.remote("127.0.0.1", port, 1, 2, name, backend=backend)
    group = weight_sync.init_process_group("127.0.0.1", port, 0, 2, name, backend=backend, timeout=300)
    get(joined)
    out: dict[str, Any] = {"backend": backend}

    out["loss_1"] = train_step(model, tok, args.lr, seed=1)
    params = [(n, p.detach().to(engine_dtype)) for n, p in model.named_parameters()]
    start = time.perf_counter()
    for count, (n, p) in enumerate(params, start=1):  # OpenRLHF's broadcast_to_vllm loop
        ref = actor.update_weight.remote(n, dtype=p.dtype, shape=p.shape, empty_cache=count == len(params))
        torch.distributed.broadcast(p, 0, group=group)
        get(ref)
    out["per_tensor_seconds"] = time.perf_counter() - start
    out["per_tensor"] = check(actor, model, tok, args, engine_dtype)

    out["loss_2"] = train_step(model, tok, args.lr, seed=2)
    report = broadcast_to_engines(model, [actor], group, group_name=name, dtype=engine_dtype)
    out["bucket_summary"] = report.summary()
    out["bucket"] = check(actor, model, tok, args, engine_dtype)

    left = actor.destroy_process_group.remote(name)  # NCCL: both sides leave together
    weight_sync.destroy_process_group(group)
    get(left)
    return out


def part_b(actor: Any, model: Any, tok: Any, args: argparse.Namespace, engine_dtype: Any) -> dict[str, Any]:
    import torch

    from trainer_adapters import push_cuda_ipc

    torch.cuda.set_device(0)
    model.to("cuda:0")
    out: dict[str, Any] = {"loss_3": train_step(model, tok, args.lr, seed=3)}
    out["push"] = push_cuda_ipc(model, [actor], dtype=engine_dtype)
    out["cuda_ipc"] = check(actor, model, tok, args, engine_dtype)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.default_model import ensure_default_model
    from trainer_adapters import EngineActor, LocalActor

    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print("this check needs 2 GPUs (or --device cpu for part A over gloo)")
        return 2
    dtype = "float32" if args.device == "cpu" else args.dtype
    engine_dtype = getattr(torch, dtype)
    path = args.model or ensure_default_model()
    started = time.perf_counter()
    engine_device = "cuda:0" if args.device == "cuda" else "cpu"
    trainer_device = "cuda:1" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(1)  # NCCL uses the current device
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(trainer_device).eval()
    actor_obj = EngineActor(path, device=engine_device, dtype=dtype, seed=0, weight_sync_timeout=300)
    actor = LocalActor(actor_obj)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                               "torch": torch.__version__, "engine_dtype": dtype, "model": path}
    try:
        results["A_nccl"] = part_a(actor, model, tok, args, engine_dtype)
        if args.device == "cuda":
            results["B_cuda_ipc"] = part_b(actor, model, tok, args, engine_dtype)
        else:
            results["B_cuda_ipc"] = "skipped: needs CUDA"
    finally:
        actor_obj.shutdown()
        actor.stop_threads()
    results["seconds"] = time.perf_counter() - started
    checks = {"A per-tensor (OpenRLHF loop)": results["A_nccl"]["per_tensor"],
              "A bucketed (broadcast_to_engines)": results["A_nccl"]["bucket"]}
    if isinstance(results["B_cuda_ipc"], dict):
        checks["B CUDA IPC (update_weight_cuda_ipc)"] = results["B_cuda_ipc"]["cuda_ipc"]
    print(json.dumps(results, indent=2, default=str))
    for name, r in checks.items():
        print(f"[{'PASS' if r['passed'] else 'FAIL'}] {name}: fingerprints equal {r['fingerprints_equal']}, "
              f"greedy identical {r['greedy_identical']}, max gap {r['greedy_max_gap']:.1e}, version {r['version']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2, default=str)
    ok = all(r["passed"] for r in checks.values())
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
