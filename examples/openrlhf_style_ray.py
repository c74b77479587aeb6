"""OpenRLHF's call pattern on a local Ray cluster: two engine actors and a trainer actor.

1. ``create_engines`` places two ``EngineActor``s with a placement group (CPU bundles when the cluster
   has no GPU; engine i gets seed + i).
2. The trainer actor calls ``init_process_group.remote`` on every engine, then joins the group itself as
   rank 0 (``weight_sync.init_process_group``), then waits for the engines: OpenRLHF's order.
3. It takes a real optimizer step, then pushes the weights the way OpenRLHF's ``broadcast_to_vllm`` does:
   per parameter, ``update_weight.remote(name, dtype, shape, empty_cache=last)`` on every engine, then
   ``torch.distributed.broadcast`` on the group, then ``ray.get`` of the calls.
4. Both engines generate (vLLM-shaped outputs); the script checks that both engines' weight
   fingerprints equal the trainer's and that their greedy outputs agree, and exits 0 only then.

    python examples/openrlhf_style_ray.py [--model DIR] [--num-engines 2] [--backend gloo|nccl]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from typing import Any

PROMPTS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 3?"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument("--num-engines", type=int, default=2)
    p.add_argument("--backend", default=None, choices=("gloo", "nccl"), help="default: nccl with GPUs, else gloo")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class Trainer:
    """The trainer actor: a transformers model, one optimizer step, OpenRLHF's per-parameter push."""

    def __init__(self, model_path: str, device: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if device.startswith("cuda"):
            torch.cuda.set_device(0)
        self.device = device
        self.tok = AutoTokenizer.from_pretrained(model_path)
        if self.tok.pad_token is None:  # Llama 3 and many base models ship no pad token
            self.tok.pad_token = self.tok.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
        self._model_update_group = None

    def init_process_group(self, engines: list[Any], tp_size: int, group_name: str, backend: str) -> dict:
        """OpenRLHF: every engine's TP ranks join first (non-blocking calls), then the trainer as rank 0."""
        import ray

        import weight_sync

        address = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        world_size = len(engines) * tp_size + 1
        refs = [engine.init_process_group.remote(address, port, i * tp_size + 1, world_size, group_name,
                                                 backend=backend)
                for i, engine in enumerate(engines)]
        self._model_update_group = weight_sync.init_process_group(address, port, 0, world_size, group_name,
                                                                  backend=backend, timeout=300)
        ray.get(refs)
        self._group_name = group_name
        return {"address": address, "port": port, "world_size": world_size}

    def train_step(self, texts: list[str], lr: float = 1e-5) -> float:
        """One AdamW step of language modelling on ``texts`` (a real update of every parameter)."""
        import torch

        self.model.train()
        opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        batch = self.tok(texts, return_tensors="pt", padding=True).to(self.device)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = self.model(**batch, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        self.model.eval()
        return float(loss)

    def broadcast_to_vllm(self, engines: list[Any]) -> dict:
        """OpenRLHF's loop, written out: announce each parameter, broadcast it, wait."""
        import ray
        import torch

        start = time.perf_counter()
        params = list(self.model.named_parameters())
        for count, (name, param) in enumerate(params, start=1):
            refs = [engine.update_weight.remote(name, dtype=param.dtype, shape=param.shape,
                                                empty_cache=count == len(params)) for engine in engines]
            torch.distributed.broadcast(param.data, 0, group=self._model_update_group)
            ray.get(refs)
        return {"tensors": len(params), "seconds": time.perf_counter() - start}

    def fingerprint(self) -> str:
        import weight_sync

        return weight_sync.fingerprint(self.model)

    def destroy_process_group(self, engines: list[Any]) -> None:
        import ray

        import weight_sync

        refs = [engine.destroy_process_group.remote(self._group_name) for engine in engines]
        weight_sync.destroy_process_group(self._model_update_group)
        ray.get(refs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import ray

    from rollout.default_model import ensure_default_model
    from trainer_adapters import create_engines

    model_path = args.model or ensure_default_model()
    started = time.perf_counter()
    ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    try:
        use_gpu = ray.cluster_resources().get("GPU", 0) >= args.num_engines + 1
        backend = args.backend or ("nccl" if use_gpu else "gloo")
        engines = create_engines(args.num_engines, 1, model_path, args.seed, use_gpu=use_gpu, dtype="float32")
        print(f"{args.num_engines} engine actors up ({time.perf_counter() - started:.1f} s), "
              f"{'GPU' if use_gpu else 'CPU'} bundles, weight-update backend {backend}")
        trainer = ray.remote(num_cpus=0, num_gpus=1 if use_gpu else 0)(Trainer).remote(
            model_path, "cuda" if use_gpu else "cpu")
        info = ray.get(trainer.init_process_group.remote(engines, 1, "openrlhf", backend))
        print(f"weight-update group: world size {info['world_size']} at {info['address']}:{info['port']}")
        versions = ray.get([e.get_weight_version.remote() for e in engines])
        loss = ray.get(trainer.train_step.remote([f"Q: {q}\nA: I think so." for q in PROMPTS]))
        push = ray.get(trainer.broadcast_to_vllm.remote(engines))
        print(f"train step: loss {loss:.3f}; per-parameter push of {push['tensors']} tensors to "
              f"{len(engines)} engines in {push['seconds']:.2f} s")
        greedy = {"temperature": 0.0, "max_tokens": args.max_new_tokens, "logprobs": 0}
        outs = ray.get([e.chat.remote([[{"role": "user", "content": q}] for q in PROMPTS], greedy)
                        for e in engines])
        sampled = ray.get([e.generate.remote(prompt_token_ids=[o.prompt_token_ids for o in outs[0]],
                                             sampling_params={"temperature": 1.0, "max_tokens": 8, "n": 2,
                                                              "logprobs": 0})
                           for e in engines])
        fp_trainer = ray.get(trainer.fingerprint.remote())
        fps = ray.get([e.weights_fingerprint.remote() for e in engines])
        after = ray.get([e.get_weight_version.remote() for e in engines])
        for i, engine_outs in enumerate(outs):
            for q, o in zip(PROMPTS, engine_outs):
                c = o.outputs[0]
                first = c.logprobs[0][c.token_ids[0]].logprob if c.token_ids else float("nan")
                print(f"engine {i} [v{o.weight_version}] {q!r} -> {c.text.strip()[:60]!r} "
                      f"({len(c.token_ids)} tokens, finish {c.finish_reason}, first-token logprob {first:.3f})")
        for i, engine_outs in enumerate(sampled):
            c = engine_outs[0].outputs
            print(f"engine {i} sampled n=2: {[x.text.strip()[:30] for x in c]}")
        ray.get(trainer.destroy_process_group.remote(engines))
        checks = [
            ("fingerprints equal the trainer's", all(fp == fp_trainer for fp in fps)),
            ("weight version moved on", all(a != b for a, b in zip(after, versions))),
            ("greedy outputs equal across engines",
             all([o.outputs[0].token_ids for o in eo] == [o.outputs[0].token_ids for o in outs[0]] for eo in outs)),
        ]
        for name, ok in checks:
            print(f"[{'PASS' if ok else 'FAIL'}] {name}")
        ok = all(ok for _, ok in checks)
        print(f"{'OK' if ok else 'FAILED'} ({time.perf_counter() - started:.1f} s)")
        return 0 if ok else 1
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
