"""sleep / wake_up on a GPU, measured from outside the engine: the engine processes' GPU memory (nvidia-smi)
before and after ``sleep(1)`` and ``sleep(2)``, how long ``wake_up()`` takes after each, and whether greedy
outputs after ``sleep(1)`` → ``wake_up()`` equal those before, token for token (prompts one at a time, so the
shapes and hence the bf16 rounding are the same each time; a batch's composition depends on arrival timing),
and the weights' fingerprint is unchanged. Exit status 1 when an output
differs, the engine holds more than ``--max-asleep-gib`` after ``sleep(2)``, or a level-1 ``wake_up()`` takes
longer than ``--max-wake-s`` (the bounds of issue 19 for an 8B model).

    python gpu_checks/check_sleep.py --preset llama-3.1-8b [--mem-fraction-static 0.5] [--enable-piecewise-cuda-graph]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _smi(query: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [[f.strip() for f in line.split(",")] for line in out.strip().splitlines() if line]


def device_used_mib() -> int:
    return int(_smi("gpu=memory.used")[0][0])


def gpu_mib(pids: list[int], baseline_mib: int) -> int:
    """The engine processes' GPU memory as nvidia-smi lists it; where it cannot see them (a container's own
    PID namespace), GPU 0's used memory less ``baseline_mib`` (this probe itself never touches the GPU)."""
    used = {int(pid): int(mib) for pid, mib in _smi("compute-apps=pid,used_memory")}
    if any(pid in used for pid in pids):
        return sum(used.get(pid, 0) for pid in pids)
    return device_used_mib() - baseline_mib


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--mem-fraction-static", type=float, default=0.5)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--sequential", type=int, default=16, help="prompts generated one at a time, before and after")
    p.add_argument("--max-asleep-gib", type=float, default=1.5)
    p.add_argument("--max-wake-s", type=float, default=1.0)
    p.add_argument("--enable-piecewise-cuda-graph", action="store_true",
                   help="the engine also replays piecewise CUDA graphs for extend steps (their memory stays asleep)")
    p.add_argument("--piecewise-cuda-graph-max-tokens", type=int, default=None,
                   help="the largest extend step they capture (default: the engine's)")
    args = p.parse_args()
    from benchmarks.presets import write_preset
    from rollout import Engine, SamplingParams

    path = write_preset(args.preset)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [[100 + 37 * i + j for j in range(16 + i)] for i in range(args.prompts)]
    baseline = device_used_mib()
    failures = []
    with Engine(path, dtype="bfloat16", device="cuda", enable_memory_saver=True, skip_tokenizer_init=True,
                mem_fraction_static=args.mem_fraction_static,
                enable_piecewise_cuda_graph=args.enable_piecewise_cuda_graph,
                piecewise_cuda_graph_max_tokens=args.piecewise_cuda_graph_max_tokens) as engine:
        pids = [proc.pid for proc in engine._procs.procs]

        def run(batch: list[list[int]]) -> list[list[int]]:
            outs = engine.generate(prompt_token_ids=batch, sampling_params=greedy, use_tqdm=False)
            return [o.outputs[0].token_ids for o in outs]

        def one_by_one() -> list[list[int]]:  # the same shapes every time: greedy is reproducible
            return [run([p])[0] for p in prompts[:args.sequential]]

        before, before_fp = one_by_one(), engine.weights_fingerprint()
        batch_a, batch_b = run(prompts), run(prompts)
        print(f"{args.preset}: engine awake {gpu_mib(pids, baseline) / 1024:.2f} GiB; a batch of {len(prompts)} twice "
              f"without sleeping: {sum(a == b for a, b in zip(batch_a, batch_b))}/{len(prompts)} equal (batch "
              f"composition varies with arrival: greedy ties in a random model can flip)", flush=True)
        for level in (1, 1, 2):
            t = time.perf_counter()
            engine.sleep(level=level)
            slept = time.perf_counter() - t
            asleep = gpu_mib(pids, baseline) / 1024
            t = time.perf_counter()
            engine.wake_up()
            woke = time.perf_counter() - t
            line = (f"sleep(level={level}): {slept:.3f} s, engine then {asleep:.2f} GiB; wake_up(): {woke:.3f} s, "
                    f"engine {gpu_mib(pids, baseline) / 1024:.2f} GiB")
            if level == 1:
                after, same_fp = one_by_one(), engine.weights_fingerprint() == before_fp
                same = sum(a == b for a, b in zip(after, before))
                line += f"; weights fingerprint equal: {same_fp}; greedy one by one after == before: {same}/{len(before)}"
                if same != len(before) or not same_fp:
                    failures.append(f"weights or greedy outputs changed after sleep({level})")
                if woke > args.max_wake_s:
                    failures.append(f"wake_up() after sleep(1) took {woke:.3f} s > {args.max_wake_s} s")
            elif asleep > args.max_asleep_gib:
                failures.append(f"asleep at level 2 the engine held {asleep:.2f} GiB > {args.max_asleep_gib} GiB")
            print(line, flush=True)
        if args.enable_piecewise_cuda_graph:
            replays = engine.get_step_stats()["extend_graph_replays"]
            print(f"extend steps replayed from piecewise CUDA graphs: {replays}")
    print("OK" if not failures else "FAILED: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
