"""The bench's GRPO workload (``--workload grpo``): P prompts × N samples with long-tailed output lengths,
the shape RL rollouts have, and ``--rl-steps K``: K rollout steps with a weight push between them, once
draining every request before the push and once applying the push in flight.

- Prompts: random token ids, lengths uniform in [--min-len, --max-len]; each is sent N times (one request per
  sample, so every sample has its own length), which the prefix cache shares.
- Outputs: lognormal lengths (median --output-median, sigma --output-sigma), capped at --output-len, with
  ``ignore_eos``.
- Reported per run: output tok/s, makespan, the tail (seconds during which fewer than a quarter of the
  engine's ``max_running_requests`` slots were busy, sampled every 20 ms), and the prefix-cache hit rate
  (cached prompt tokens / prompt tokens).
- ``--rl-steps K``: each step is a rollout of a fresh batch, then a push of new weights (random tensors with
  the model's shapes, in transformers' naming): ``--rl-sync tensor`` (default) from a colocated trainer with
  ``update_weights_from_tensor`` (CUDA IPC on a GPU, shared memory on the CPU), ``--rl-sync distributed`` from
  a trainer process on another device that broadcasts buckets (``benchmarks/grpo_trainer.py``). **drain**:
  the push waits until the batch has finished. **in flight** (``update_weights_in_flight``): when the batch
  enters its tail (fewer than a quarter of its requests left, or of the slots when the batch has more) the
  push lands at the next step boundary and the next batch is submitted; the tail finishes on the new weights
  (its later tokens are tagged with the new version). Each step reports its rollout time (from the batch's
  submission to its last request's end: in flight it overlaps the push and the next batch), the tail within
  that time, and sync (the push); after each loop the engine's weight fingerprint is compared with the
  trainer's.
"""

from __future__ import annotations

import argparse
import math
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class GrpoBatch:
    prompts: list[list[int]]      # one entry per request (each prompt repeated N times)
    output_lens: list[int]


def output_median(args: argparse.Namespace) -> int:
    """The median of the output lengths: ``--output-median``, or by default a quarter of the cap (at least 1)."""
    return args.output_median or max(1, args.output_len // 4)


def make_grpo_batch(args: argparse.Namespace, vocab: int, seed: int) -> GrpoBatch:
    rng = random.Random(seed)
    median = output_median(args)
    prompts, outs = [], []
    for _ in range(args.num_prompts):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
        for _ in range(args.n):
            prompts.append(prompt)
            outs.append(max(1, min(args.output_len, round(rng.lognormvariate(math.log(median), args.output_sigma)))))
    return GrpoBatch(prompts, outs)


@dataclass
class RolloutStats:
    """One timed rollout (or one RL step of it)."""

    requests: int
    output_tokens: int
    makespan_s: float
    tail_s: float
    prefix_hit_rate: float
    sync_s: float = 0.0
    versions: dict[str, int] = field(default_factory=dict)  # tokens sampled by each weight version

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.makespan_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "output_tok_s": self.output_tok_s}


class LoadSampler:
    """Samples the engine's running count every ``period`` seconds on a thread; ``tail_s`` is the time with
    fewer than a quarter of ``slots`` busy while work was left."""

    def __init__(self, engine: Any, slots: int, period: float = 0.02) -> None:
        self.engine, self.slots, self.period = engine, slots, period
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            load = self.engine.get_load()
            self.samples.append((time.perf_counter(), load["running"], load["waiting"]))

    def tail_s(self, start: float, end: float) -> float:
        """Seconds of [start, end] in the tail: each sample's load holds until the next sample, the last
        one's until ``end`` (the batch's work was left until then)."""
        points = [(t, r, w) for t, r, w in self.samples if start <= t <= end] + [(end, 0, 0)]
        return sum(t1 - t0 for (t0, r, w), (t1, _, _) in zip(points, points[1:])
                   if r + w > 0 and r < self.slots / 4)


def run_rollout(engine: Any, batch: GrpoBatch, temperature: float) -> list[Any]:
    from rollout.sampling_params import SamplingParams

    params = [SamplingParams(max_new_tokens=n, temperature=temperature, ignore_eos=True) for n in batch.output_lens]
    return engine.generate(prompt_token_ids=batch.prompts, sampling_params=params, use_tqdm=False)


def summarize(outs: list[Any], makespan: float, tail: float, sync: float = 0.0) -> RolloutStats:
    versions: dict[str, int] = {}
    for o in outs:
        for v in o.outputs[0].token_weight_versions:
            versions[v] = versions.get(v, 0) + 1
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    return RolloutStats(len(outs), sum(len(o.outputs[0].token_ids) for o in outs), makespan, tail,
                        cached / max(prompt_tokens, 1), sync, versions)


def rl_steps(engine: Any, batches: list[GrpoBatch], push: Any, temperature: float, in_flight: bool
             ) -> tuple[list[RolloutStats], float]:
    """Run the batches as RL steps with ``push()`` between them; returns per-step stats and the makespan."""
    slots = engine.config.max_running_requests
    steps: list[RolloutStats] = []
    with LoadSampler(engine, slots) as load:
        start = time.perf_counter()
        worker = _Rollout(engine, batches[0], temperature)
        for i in range(len(batches)):
            if in_flight and i + 1 < len(batches):
                _wait_for_tail(engine, worker, min(slots, len(batches[i].prompts)))
            else:
                worker.join()
            t_push = time.perf_counter()
            push()
            sync = time.perf_counter() - t_push
            nxt = _Rollout(engine, batches[i + 1], temperature) if i + 1 < len(batches) else None
            worker.join()
            steps.append(summarize(worker.outs, worker.end - worker.start, load.tail_s(worker.start, worker.end), sync))
            worker = nxt
        makespan = time.perf_counter() - start
    return steps, makespan


class _Rollout:
    """One batch generating on a thread."""

    def __init__(self, engine: Any, batch: GrpoBatch, temperature: float) -> None:
        self.start = time.perf_counter()
        self.end = self.start
        self.outs: list[Any] = []
        self._thread = threading.Thread(target=self._run, args=(engine, batch, temperature), daemon=True)
        self._thread.start()

    def _run(self, engine: Any, batch: GrpoBatch, temperature: float) -> None:
        self.outs = run_rollout(engine, batch, temperature)
        self.end = time.perf_counter()

    def join(self) -> None:
        self._thread.join()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()


def _wait_for_tail(engine: Any, worker: _Rollout, width: int) -> None:
    """Until the batch, once at least a quarter of ``width`` requests (the batch's, or the slots when fewer)
    were in the engine, has fewer left (or has finished). The first condition matters: right after
    ``generate`` is called its requests may not have reached the scheduler yet, and an empty engine is not a
    tail. Counting against the batch, not the slots, keeps a batch smaller than the slots from looking like
    a tail as soon as its first request ends."""
    started = False
    while not worker.done:
        load = engine.get_load()
        left = load["running"] + load["waiting"]
        if left >= width / 4:
            started = True
        elif started:
            return
        time.sleep(0.02)


def run_grpo(args: argparse.Namespace, model_path: str, device: str, dtype: str, engine_options: dict[str, Any]
             ) -> dict[str, Any]:
    """The GRPO workload: one timed rollout, or with ``--rl-steps K`` the drain and in-flight RL loops."""
    from benchmarks.engine_run import check_context, count_deltas, report_profile, start_profile
    from benchmarks.grpo_trainer import make_pusher
    from rollout.config import ModelConfig
    from rollout.engine import Engine

    vocab = ModelConfig.from_path(model_path).vocab_size
    batches = [make_grpo_batch(args, vocab, args.seed + 101 * i) for i in range(max(1, args.rl_steps))]
    report: dict[str, Any] = {"workload": {**{k: getattr(args, k) for k in (
        "num_prompts", "n", "min_len", "max_len", "output_len", "output_sigma", "rl_steps", "rl_sync",
        "temperature", "seed")}, "output_median": output_median(args)}}  # the median used, default or not
    modes = [("rollout", False)] if not args.rl_steps else [("drain", False), ("in_flight", True)]
    for name, in_flight in modes:
        with Engine(model_path, tp_size=args.tp_size, dtype=dtype, device=device, update_weights_in_flight=in_flight,
                    **engine_options) as engine:
            for batch in batches:
                check_context(engine, batch.prompts, batch.output_lens)
            run_rollout(engine, warmup_batch(args, vocab, args.seed + 7), args.temperature)
            engine.flush_cache()
            if not args.rl_steps:
                before = engine.get_step_stats()
                trace = start_profile(engine, args, before["launched_steps"]) if args.profile else None
                with LoadSampler(engine, engine.config.max_running_requests) as load:
                    start = time.perf_counter()
                    outs = run_rollout(engine, batches[0], args.temperature)
                    end = time.perf_counter()
                after = engine.get_step_stats()
                if trace is not None:
                    report_profile(engine, trace, after["launched_steps"] - before["launched_steps"])
                rows = _decoded_rows(after) - _decoded_rows(before)  # neither read resets the counts
                report[name] = {"total": summarize(outs, end - start, load.tail_s(start, end)).to_dict(),
                                "decode_rows": rows, "graph_replays": replays_between(before, after),
                                **count_deltas(before, after, ("mixed_steps", "retractions", "cascade_steps",
                                                               "cascade_rows"))}
                continue
            with make_pusher(args.rl_sync, engine, model_path, device, dtype, args.tp_size,
                             args.trainer_device) as trainer:
                before = engine.get_step_stats()
                steps, makespan = rl_steps(engine, batches, trainer.push, args.temperature, in_flight)
                replays = replays_between(before, engine.get_step_stats())
                exact = trainer.verify()
            tokens = sum(s.output_tokens for s in steps)
            report[name] = {"makespan_s": makespan, "output_tok_s": tokens / makespan, "fingerprint_equal": exact,
                            "graph_replays": replays, "steps": [s.to_dict() for s in steps]}
    return report


def replays_between(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """Decode steps replayed from each CUDA graph variant between two ``Engine.get_step_stats()`` reads."""
    old = before.get("graph_replays", {})
    return {k: n - old.get(k, 0) for k, n in after.get("graph_replays", {}).items() if n - old.get(k, 0)}


def _decoded_rows(stats: dict[str, Any]) -> int:
    """Rows decoded so far, from ``Engine.get_step_stats()`` (steps per batch size)."""
    return sum(int(b) * e["steps"] for b, e in stats["decode"].items())


def warmup_batch(args: argparse.Namespace, vocab: int, seed: int) -> GrpoBatch:
    """As many requests as the timed batch, in groups of N sharing prompts long enough for cascade decode
    (``MIN_SHARED_PREFIX`` + 64 tokens), whose output lengths fall by one per ``P * N / steps`` requests (at
    most 256 steps): the running count sweeps every decode batch size the timed run meets, so each CUDA graph
    the run replays, cascade variants included (captured at their first use), exists before the clock
    starts."""
    from rollout.scheduler.prefix_groups import MIN_SHARED_PREFIX

    rng = random.Random(seed)
    total = args.num_prompts * args.n
    steps = min(total, 256)
    length = MIN_SHARED_PREFIX + 64
    prompts = [p for p in ([rng.randrange(vocab) for _ in range(length)] for _ in range(args.num_prompts))
               for _ in range(args.n)]
    return GrpoBatch(prompts, [1 + i * steps // total for i in range(total)])


def format_grpo(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [f"GRPO workload: {w['num_prompts']} prompts x {w['n']} samples, prompts {w['min_len']}-{w['max_len']} "
             f"tokens, outputs lognormal (median {w['output_median']}, sigma "
             f"{w['output_sigma']}) capped at {w['output_len']}, temperature {w['temperature']}"]
    if "rollout" in report:
        s = report["rollout"]["total"]
        lines.append(f"rollout: {s['output_tokens']} output tokens in {s['makespan_s']:.2f} s = "
                     f"{s['output_tok_s']:.1f} tok/s; tail {s['tail_s']:.2f} s (< 1/4 of the slots busy); "
                     f"prefix-cache hit rate {s['prefix_hit_rate']:.1%}; {report['rollout']['mixed_steps']} prefill "
                     f"steps mixed with decode; "
                     f"{report['rollout']['retractions']} retractions; cascade decode: "
                     f"{report['rollout']['cascade_steps']} steps, "
                     f"{report['rollout']['cascade_rows'] / max(report['rollout']['decode_rows'], 1):.1%} of the "
                     f"decoded rows in shared-prefix groups; CUDA graph replays {report['rollout']['graph_replays']}")
        return "\n".join(lines)
    lines.append(f"weight push between steps: {w['rl_sync']} ("
                 + ("update_weights_from_tensor" if w["rl_sync"] == "tensor" else
                    "a trainer process broadcasting buckets: update_weights_from_distributed") + ")")
    for name in ("drain", "in_flight"):
        r = report[name]
        lines.append(f"{name:>9}: makespan {r['makespan_s']:.2f} s, {r['output_tok_s']:.1f} output tok/s over "
                     f"{len(r['steps'])} steps; engine fingerprint equals the trainer's: {r['fingerprint_equal']}; "
                     f"CUDA graph replays {r['graph_replays']}")
        for i, s in enumerate(r["steps"]):
            lines.append(f"           step {i + 1}: rollout {s['makespan_s']:.2f} s (tail {s['tail_s']:.2f} s), sync "
                         f"{s['sync_s'] * 1e3:.1f} ms, hit rate {s['prefix_hit_rate']:.1%}, tokens by weight version "
                         f"{s['versions']}")
    lines.append(f"in flight / drain makespan: {report['in_flight']['makespan_s'] / report['drain']['makespan_s']:.2f}")
    return "\n".join(lines)
