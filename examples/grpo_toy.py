"""GRPO on SmolLM2-135M-Instruct on CPU, with the new weights streamed into the rollout engine every step.

The task is answered by code: the prompt asks the model to reply with only a given number
("Reply with only this number: 407"). Reward 1.0 for exactly that number (surrounding whitespace and
a final period allowed); between 0.25 and 0.5 when the number appears in a longer reply (more for a
shorter reply, so that groups keep some spread on the way from "contains" to "exact"); 0 otherwise.

Each step:
  1. rollout: the engine samples ``--group-size`` answers to each of ``--prompts-per-step`` prompts,
     returning every token's logprob (``logprobs=0``, raw: the model's own distribution);
  2. group-relative advantages: each answer's reward minus its group's mean, over the group's std;
  3. the clipped policy loss of PPO/GRPO, with the engine's rollout logprobs as the old policy, over
     ``--minibatches`` optimizer steps (the first is on-policy; later ones are slightly off-policy,
     which is where the clip acts);
  4. sync: the trainer pushes every parameter into the running engine (``trainer_adapters``'s
     ``broadcast_to_engines``, bucketed over a gloo group), and the engine's weight version moves on.

The per-step line reports the mean reward, the sync time, the weight version the rollout was sampled
with, and the engine-vs-trainer logprob mismatch (the trainer's logprobs of the sampled tokens on the
first, on-policy minibatch vs the engine's; float32 on both sides, so it should be ~1e-6).

    python examples/grpo_toy.py [--steps 20] [--prompts-per-step 4] [--group-size 8] [--lr 2e-5] ...
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import time
from dataclasses import dataclass

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt (GRPO's G)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--minibatches", type=int, default=2, help="optimizer steps per rollout batch")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward")
    p.add_argument("--sync-mode", default="bucket", choices=("bucket", "per_tensor"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads for the trainer (default: torch's)")
    return p.parse_args(argv)


# ---- the task -----------------------------------------------------------------------------------

def make_prompts(rng: random.Random, k: int) -> list[tuple[str, str]]:
    """``k`` (question, answer) pairs."""
    out = []
    for _ in range(k):
        n = rng.randint(10, 999)
        out.append((f"Reply with only this number: {n}", str(n)))
    return out


def reward(text: str, answer: str) -> float:
    """1.0 for exactly the number; 0.25 + 0.25 * len(number) / len(reply) for the number inside a
    longer reply; else 0."""
    t = text.strip()
    if t.endswith("."):
        t = t[:-1].strip()
    if t == answer:
        return 1.0
    if answer in re.findall(r"\d+", t):
        return 0.25 + 0.25 * len(answer) / len(t)
    return 0.0


# ---- GRPO ---------------------------------------------------------------------------------------

@dataclass
class Sample:
    prompt: list[int]
    completion: list[int]
    old_logprobs: list[float]
    advantage: float


def group_advantages(rewards: list[float], eps: float = 1e-4) -> list[float]:
    """(r - mean) / (std + eps) within one group; all zeros when every answer scored the same."""
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    return [(r - mean) / (std + eps) for r in rewards]


def token_logprobs(model, samples: list[Sample], pad_id: int) -> list[torch.Tensor]:
    """log pi(token) of each sample's completion tokens, right-padded batch, one forward."""
    seqs = [s.prompt + s.completion for s in samples]
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, :len(x)] = torch.tensor(x)
        mask[i, :len(x)] = 1
    first = min(len(s.prompt) for s in samples) - 1  # logits only where some completion token is predicted
    dev = model.device
    keep = torch.arange(first, width - 1, device=dev)
    logits = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), logits_to_keep=keep).logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    out = []
    for i, s in enumerate(samples):
        start = len(s.prompt) - 1 - first
        pos = torch.arange(start, start + len(s.completion), device=dev)
        out.append(logp[i, pos, torch.tensor(s.completion, device=dev)])
    return out


def grpo_minibatch(model, optimizer, samples: list[Sample], args, pad_id: int) -> dict[str, float]:
    """One optimizer step of the clipped GRPO loss over ``samples`` (mean over tokens of each sample,
    then over samples). Returns the loss, the clip fraction and the trainer-vs-engine logprob gap."""
    optimizer.zero_grad(set_to_none=True)
    total_loss, clipped, tokens, gaps = 0.0, 0, 0, []
    for i in range(0, len(samples), args.micro_batch):
        micro = samples[i:i + args.micro_batch]
        new = token_logprobs(model, micro, pad_id)
        losses = []
        for s, lp in zip(micro, new):
            old = torch.tensor(s.old_logprobs, device=lp.device)
            ratio = torch.exp(lp - old)
            adv = torch.full_like(ratio, s.advantage)
            unclipped, clipped_obj = ratio * adv, torch.clamp(ratio, 1 - args.clip_eps, 1 + args.clip_eps) * adv
            losses.append(-torch.min(unclipped, clipped_obj).mean())
            clipped += int((unclipped != clipped_obj).sum())
            tokens += len(s.completion)
            gaps.append((lp.detach() - old).abs())
        loss = torch.stack(losses).sum() / len(samples)
        loss.backward()
        total_loss += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    gap = torch.cat(gaps)
    return {"loss": total_loss, "clip_frac": clipped / max(tokens, 1), "gap_max": float(gap.max()),
            "gap_mean": float(gap.mean())}


# ---- the loop -----------------------------------------------------------------------------------



def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import weight_sync
    from rollout import Engine, SamplingParams
    from rollout.default_model import ensure_default_model
    from trainer_adapters import broadcast_to_engines

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    path = args.model or ensure_default_model()
    started = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    history: list[dict[str, float]] = []

    with Engine(path, dtype="float32", device="cpu", seed=args.seed) as engine:
        group_name = "grpo"
        group = weight_sync.join_engines([engine], group_name, backend="gloo")
        print(f"model {path}; engine up, weight version {engine.get_weight_version()} "
              f"({time.perf_counter() - started:.1f} s)")
        bar = tqdm(range(args.steps), desc="GRPO", unit="step", dynamic_ncols=True)
        for step in bar:
            t0 = time.perf_counter()
            batch = make_prompts(rng, args.prompts_per_step)
            sampling = SamplingParams(n=args.group_size, temperature=args.temperature,
                                      max_new_tokens=args.max_new_tokens, logprobs=0)
            outs = engine.chat([[{"role": "user", "content": q}] for q, _ in batch], sampling, use_tqdm=False)
            t_roll = time.perf_counter() - t0
            samples, rewards, exact = [], [], 0
            for (_, answer), out in zip(batch, outs):
                rs = [reward(c.text, answer) for c in out.outputs]
                rewards += rs
                exact += sum(r == 1.0 for r in rs)
                for c, a in zip(out.outputs, group_advantages(rs)):
                    samples.append(Sample(list(out.prompt_token_ids), list(c.token_ids), list(c.token_logprobs), a))
            t1 = time.perf_counter()
            rng.shuffle(samples)
            size = -(-len(samples) // args.minibatches)
            stats = [grpo_minibatch(model, optimizer, samples[i:i + size], args, pad_id)
                     for i in range(0, len(samples), size)]
            t_train = time.perf_counter() - t1
            report = broadcast_to_engines(model, [engine], group, group_name=group_name, mode=args.sync_mode)
            row = {"step": step + 1, "reward": statistics.fmean(rewards), "exact": exact / len(rewards),
                   "sync_s": report.seconds, "version": outs[0].weight_version,
                   "new_version": engine.get_weight_version(), "gap_max": stats[0]["gap_max"],
                   "gap_mean": stats[0]["gap_mean"], "clip_frac": stats[-1]["clip_frac"],
                   "rollout_s": t_roll, "train_s": t_train, "sample": outs[0].outputs[0].text.strip()[:24]}
            history.append(row)
            bar.set_postfix_str(f"reward {row['reward']:.2f}", refresh=False)
            tqdm.write(f"step {row['step']:3d} | reward {row['reward']:.3f} (exact {row['exact']:.2f}) | "
                       f"sync {row['sync_s']:.2f} s | weight version {row['version']} -> {row['new_version']} | "
                       f"logprob mismatch max {row['gap_max']:.1e} mean {row['gap_mean']:.1e} | "
                       f"clip {row['clip_frac']:.2f} | rollout {t_roll:.1f} s train {t_train:.1f} s | "
                       f"e.g. {batch[0][1]} -> {row['sample']!r}")
        bar.close()
        weight_sync.leave_engines([engine], group, group_name)

    k = max(1, min(5, len(history) // 4))
    first = statistics.fmean(r["reward"] for r in history[:k])
    last = statistics.fmean(r["reward"] for r in history[-k:])
    print(f"mean reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f} "
          f"(exact answers {statistics.fmean(r['exact'] for r in history[:k]):.2f} -> "
          f"{statistics.fmean(r['exact'] for r in history[-k:]):.2f}); "
          f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
