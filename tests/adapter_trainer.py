"""One trainer rank for the trainer_adapters tests, run as a Ray actor.

It builds the checkpoint under one wrapping (a plain transformers model, Accelerate with DDP, FSDP2,
DeepSpeed ZeRO-3), takes real optimizer steps, pushes the weights into the engine actors with
``broadcast_to_engines`` and measures the result against transformers on the trainer's gathered
weights. It reports numbers; the test decides.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rollout.ipc import free_port

CHECK_PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46], [100, 3, 250, 17], [9] * 12]
MAX_NEW = 10
GREEDY = {"temperature": 0.0, "max_tokens": MAX_NEW, "ignore_eos": True, "logprobs": 0}
LR = 0.05
BACKENDS = ("module", "accelerate", "fsdp2", "deepspeed")
WORLD_SIZES = {"module": 1, "accelerate": 2, "fsdp2": 2, "deepspeed": 2}




def fsdp2_linear_stack(rank: int, port: int, layers: int, timeout_s: float) -> Any:
    """Rank ``rank`` of a 2-rank gloo group at 127.0.0.1:``port`` (a mismatched collective fails after
    ``timeout_s`` instead of hanging): ``layers`` seeded ``nn.Linear(16, 16)``, each and the whole stack
    ``fully_shard``-ed (FSDP2). The caller destroys the process group."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout_s))
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


class TrainerRank:
    """Rank ``rank`` of a ``world_size``-rank trainer using ``backend``; the default process group (gloo)
    rendezvouses at 127.0.0.1:``master_port``."""

    def __init__(self, backend: str, rank: int, world_size: int, master_port: int, path: str) -> None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
        torch.set_num_threads(1)
        self.backend, self.rank, self.world_size, self.path = backend, rank, world_size, path

    # ---- the model under each wrapping ---------------------------------------------------------

    def _load(self) -> Any:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        return AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)

    def build(self) -> dict[str, Any]:
        """Wrap the model; returns what the wrapping looks like (names, partitioning)."""
        getattr(self, f"_build_{self.backend}")()
        names = [n for n, _ in self.model.named_parameters()]
        info = {"first_name": names[0]}
        if self.backend == "deepspeed":
            p = next(self.model.module.parameters())
            info["partitioned"] = bool(p.ds_tensor.numel() < p.ds_numel)
        if self.backend == "fsdp2":
            info["dtensor"] = type(next(self.model.parameters())).__name__
        return info

    def _build_module(self) -> None:
        self.model = self._load()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def _build_accelerate(self) -> None:
        from accelerate import Accelerator

        self.accelerator = Accelerator(cpu=True)
        model = self._load()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        self.model, self.opt = self.accelerator.prepare(model, opt)

    def _build_fsdp2(self) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (self.world_size,))
        model = self._load()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def _build_deepspeed(self) -> None:
        import deepspeed

        from trainer_adapters import init_deepspeed_distributed

        init_deepspeed_distributed(dist_backend="gloo")
        config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
        model = self._load()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        self.model, self.opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    # ---- training ------------------------------------------------------------------------------

    def train_step(self, seed: int) -> float:
        """One optimizer step of language modelling on random token sequences (same data on every rank)."""
        g = torch.Generator().manual_seed(seed)
        batch = torch.randint(3, 500, (2, 16), generator=g)
        self.model.train()
        loss = self.model(batch, labels=batch).loss
        if self.backend == "deepspeed":
            self.model.backward(loss)
            self.model.step()
        else:
            if self.backend == "accelerate":
                self.accelerator.backward(loss)
            else:
                loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.model.eval()
        return float(loss.detach())

    # ---- the run -------------------------------------------------------------------------------

    def run(self, engines: list[Any], modes: list[str]) -> dict[str, Any] | None:
        """Build, then for each mode: a train step, a sync, a measurement. Rank 0 returns the report."""
        from trainer_adapters import full_named_parameters

        info = self.build()
        steps = []
        for i, mode in enumerate(modes):
            loss = self.train_step(seed=100 + i)
            report = self.sync(engines, mode, f"{mode}-{i}")
            full = full_named_parameters(self.model)  # collective for sharded models
            if report is not None:
                steps.append({"mode": mode, "loss": loss, "buckets": report.num_buckets,
                              "tensors": report.num_tensors, **self.measure(full, engines)})
        self.close_group(engines)
        return {"info": info, "steps": steps} if self.rank == 0 else None

    def sync(self, engines: list[Any], mode: str, weight_version: str) -> Any:
        """Broadcast the weights into ``engines`` over a gloo group joined on first use (OpenRLHF's order:
        every engine starts joining, then the trainer joins as rank 0); rank 0 returns the report."""
        import ray

        import weight_sync
        from trainer_adapters import broadcast_to_engines

        lead = self.rank == 0
        if lead and getattr(self, "group", None) is None:
            port, self.group_name = free_port(), f"test-{self.backend}"
            refs = [e.init_process_group.remote("127.0.0.1", port, 1 + i, 1 + len(engines), self.group_name,
                                                backend="gloo") for i, e in enumerate(engines)]
            self.group = weight_sync.init_process_group("127.0.0.1", port, 0, 1 + len(engines), self.group_name,
                                                        backend="gloo", timeout=120)
            ray.get(refs)
        return broadcast_to_engines(self.model, engines if lead else None, getattr(self, "group", None),
                                    group_name=getattr(self, "group_name", None), mode=mode, bucket_bytes=64 << 10,
                                    weight_version=weight_version)

    def check(self, engines: list[Any]) -> dict[str, Any]:
        """``measure`` on the current weights (one rank: the plain module)."""
        from trainer_adapters import full_named_parameters

        return self.measure(full_named_parameters(self.model), engines)

    def close_group(self, engines: list[Any]) -> None:
        import ray

        import weight_sync

        if getattr(self, "group", None) is not None:
            ray.get([e.destroy_process_group.remote(self.group_name) for e in engines])
            weight_sync.destroy_process_group(self.group)
            self.group = None

    def measure(self, full: list[tuple[str, torch.Tensor]], engines: list[Any]) -> dict[str, Any]:
        """transformers on the trainer's gathered weights vs every engine: fingerprints, greedy, logprobs."""
        import ray

        import weight_sync
        from reference import hf_greedy, hf_logprobs

        ref = self._load().eval()
        ref.load_state_dict(dict(full), strict=True)
        out: dict[str, Any] = {"trainer_fp": weight_sync.fingerprint(full), "names": sorted(n for n, _ in full),
                               "hf_greedy": [hf_greedy(ref, p, MAX_NEW) for p in CHECK_PROMPTS], "engines": []}
        fps = ray.get([e.weights_fingerprint.remote() for e in engines])
        outputs = ray.get([e.generate.remote(CHECK_PROMPTS, GREEDY) for e in engines])
        for fp, outs in zip(fps, outputs):
            got = [o.outputs[0].token_ids for o in outs]
            deltas = [abs(a - b) for p, o in zip(CHECK_PROMPTS, outs)
                      for a, b in zip(o.outputs[0].token_logprobs, hf_logprobs(ref, p, o.outputs[0].token_ids))]
            vllm_shaped = all(o.outputs[0].logprobs[i][t].logprob == o.outputs[0].token_logprobs[i]
                              for o in outs for i, t in enumerate(o.outputs[0].token_ids))
            out["engines"].append({"fp": fp, "greedy": got, "max_dlogprob": max(deltas), "vllm_shaped": vllm_shaped,
                                   "finish": sorted({o.outputs[0].finish_reason for o in outs}),
                                   "version": outs[0].weight_version})
        return out
