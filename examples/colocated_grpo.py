"""Colocated GRPO: the trainer and the rollout engine share one device and take turns with its memory.

Each step (docs/colocation.md):
  1. rollout: the engine samples answers (``logprobs=0``: the old policy's logprobs);
  2. ``engine.sleep(level=2)``: the engine gives back its KV cache and its weights (the trainer pushes new
     ones anyway);
  3. train: GRPO minibatches (``grpo_toy``'s loss) on the trainer's copy of the model;
  4. ``engine.wake_up(tags=["weights"])``, then the push: ``engine.update_weights_from_tensor`` shares the
     trainer's tensors (CUDA IPC on a GPU, one shared-memory buffer on the CPU: no process group);
  5. ``engine.wake_up(tags=["kv_cache"])``, and the next rollout.

On the CPU with SmolLM2-135M-Instruct it learns the task of ``grpo_toy.py`` (mean reward rises). With
``--preset llama-3.1-8b --device cuda`` (random weights, real shapes) it is a timing run: the prompts are
random tokens, the reward is random, and the optimizer trains the last ``--train-layers`` layers only. Each
step reports the rollout, sleep, train, wake and push times and the peak memory of trainer and engine.

    python examples/colocated_grpo.py [--steps 12]
    python examples/colocated_grpo.py --preset llama-3.1-8b --device cuda --steps 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from grpo_toy import Sample, group_advantages, grpo_minibatch, make_prompts, reward


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument("--preset", default=None, help="a random-weight preset of benchmarks.presets (timing run)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--train-layers", type=int, default=2, help="timing runs: train the last N decoder layers")
    p.add_argument("--mem-fraction-static", type=float, default=0.45, help="GPU: the engine's share")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class MemoryProbe:
    """Peak memory of the trainer (this process) and of the engine's processes. GPU: the engine's processes as
    nvidia-smi lists them, or, where it cannot see them (a container's own PIDs), the device's used memory
    less what was used before the engine started and less the trainer's reserved memory."""

    def __init__(self, device: str, engine, baseline_used: int) -> None:
        import psutil

        self.cuda = device.startswith("cuda")
        self.engine_pids = [p.pid for p in engine._procs.procs]
        self.procs = [psutil.Process(pid) for pid in self.engine_pids]
        self.baseline_used = baseline_used
        self.trainer_peak = self.engine_peak = 0

    @staticmethod
    def device_used(device: str) -> int:
        if not device.startswith("cuda"):
            return 0
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return total - free

    def sample(self) -> None:
        self.trainer_peak = max(self.trainer_peak, self.trainer_now())
        self.engine_peak = max(self.engine_peak, self.engine_now())

    def trainer_now(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_reserved()
        import psutil

        return psutil.Process().memory_info().rss

    def engine_now(self) -> int:
        if not self.cuda:
            return sum(p.memory_info().rss for p in self.procs)
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout
        used = {int(pid): int(mib) << 20 for pid, mib in (line.split(",") for line in out.strip().splitlines() if line)}
        if any(pid in used for pid in self.engine_pids):
            return sum(used.get(pid, 0) for pid in self.engine_pids)
        return self.device_used("cuda") - self.baseline_used - torch.cuda.memory_reserved()


def rollout(engine, args, rng):
    """(samples, rewards, outputs) of one rollout batch."""
    from rollout import SamplingParams

    sampling = SamplingParams(n=args.group_size, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                              logprobs=0, ignore_eos=args.preset is not None)
    if args.preset is None:
        batch = make_prompts(rng, args.prompts_per_step)
        outs = engine.chat([[{"role": "user", "content": q}] for q, _ in batch], sampling, use_tqdm=False)
        scores = [[reward(c.text, answer) for c in out.outputs] for (_, answer), out in zip(batch, outs)]
    else:
        vocab = engine.model_config.vocab_size  # ids within the preset's vocabulary (tiny has 1,024)
        prompts = [[rng.randrange(min(100, vocab // 2), min(20000, vocab)) for _ in range(64)]
                   for _ in range(args.prompts_per_step)]
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=sampling, use_tqdm=False)
        scores = [[rng.random() for _ in out.outputs] for out in outs]
    samples, rewards = [], []
    for out, rs in zip(outs, scores):
        rewards += rs
        for c, a in zip(out.outputs, group_advantages(rs)):
            samples.append(Sample(list(out.prompt_token_ids), list(c.token_ids), list(c.token_logprobs), a))
    return samples, rewards, outs


def load_trainer(path: str, args):
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    if args.preset is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device)
    else:  # random weights with the preset's shapes, built on the device
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    model.config.use_cache = False
    if args.preset is not None:  # timing run: train a few layers (their optimizer state fits beside the engine)
        for p in model.parameters():
            p.requires_grad_(False)
        for layer in model.model.layers[-args.train_layers:]:
            for p in layer.parameters():
                p.requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from rollout import Engine

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    path = _model_path(args)
    cuda = args.device.startswith("cuda")
    started = time.perf_counter()
    options = {"mem_fraction_static": args.mem_fraction_static} if cuda else {}
    dtype = "bfloat16" if cuda else "float32"
    if args.preset is not None:
        options.update(load_format="dummy", skip_tokenizer_init=True)  # random weights; the first push replaces them
    baseline = MemoryProbe.device_used(args.device)
    with Engine(path, dtype=dtype, device=args.device, seed=args.seed, enable_memory_saver=True, **options) as engine:
        tok = AutoTokenizer.from_pretrained(path) if args.preset is None else None
        model, optimizer = load_trainer(path, args)
        pad_id = 0 if tok is None else tok.eos_token_id if tok.pad_token_id is None else tok.pad_token_id
        memory = MemoryProbe(args.device, engine, baseline)
        history = []
        for step in range(args.steps):
            row, t = {"step": step + 1}, time.perf_counter()
            samples, rewards, outs = rollout(engine, args, rng)
            memory.sample()
            row["rollout_s"], t = time.perf_counter() - t, time.perf_counter()
            engine.sleep(level=2)
            row["sleep_s"], t = time.perf_counter() - t, time.perf_counter()
            row["engine_asleep_gib"] = memory.engine_now() / (1 << 30)
            rng.shuffle(samples)
            size = -(-len(samples) // args.minibatches)
            stats = [grpo_minibatch(model, optimizer, samples[i:i + size], args, pad_id)
                     for i in range(0, len(samples), size)]
            if cuda:
                torch.cuda.synchronize()
            memory.sample()
            row["train_s"], t = time.perf_counter() - t, time.perf_counter()
            engine.wake_up(tags=["weights"])
            row["wake_s"], t = time.perf_counter() - t, time.perf_counter()
            pushed = engine.update_weights_from_tensor(list(model.named_parameters()))
            row["push_s"], row["push_gbps"] = time.perf_counter() - t, pushed["bytes"] / (time.perf_counter() - t) / 1e9
            t = time.perf_counter()
            engine.wake_up(tags=["kv_cache"])
            row["wake_kv_s"] = time.perf_counter() - t
            memory.sample()
            row.update(reward=statistics.fmean(rewards), version=outs[0].weight_version,
                       gap_max=stats[0]["gap_max"], new_version=pushed["weight_version"])
            history.append(row)
            print(f"step {row['step']:3d} | reward {row['reward']:.3f} | rollout {row['rollout_s']:.2f} s | sleep "
                  f"{row['sleep_s']:.2f} s (engine then {row['engine_asleep_gib']:.2f} GiB) | train {row['train_s']:.2f} s"
                  f" | wake weights {row['wake_s']:.2f} s | push {row['push_s'] * 1e3:.0f} ms "
                  f"({row['push_gbps']:.0f} GB/s) | wake kv {row['wake_kv_s']:.2f} s | version {row['version']} -> "
                  f"{row['new_version']} | logprob gap {row['gap_max']:.1e}", flush=True)
        print(f"peak memory: trainer {memory.trainer_peak / (1 << 30):.2f} GiB, engine {memory.engine_peak / (1 << 30):.2f} GiB"
              f" ({'GPU' if cuda else 'resident'})")
    k = max(1, min(4, len(history) // 3))
    first = statistics.fmean(r["reward"] for r in history[:k])
    last = statistics.fmean(r["reward"] for r in history[-k:])
    print(f"mean reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f}; "
          f"total {time.perf_counter() - started:.0f} s")
    return 0


def _model_path(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    if args.preset:
        import os
        import sys

        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: a checkout
        from benchmarks.presets import write_preset

        return write_preset(args.preset)
    from rollout.default_model import ensure_default_model

    return ensure_default_model()


if __name__ == "__main__":
    raise SystemExit(main())
