"""Compare two lm-evaluation-harness output directories (``--log_samples``) item by item: accuracy, and
every choice's loglikelihood and is-greedy flag. Exit status 0 when accuracies are equal and every
loglikelihood agrees within ``--tol``.

    python tools/lm_eval_check/compare.py OUT/hf OUT/server [--tol 1e-4]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys


def _load(root: str) -> tuple[dict, dict[int, dict]]:
    results = sorted(glob.glob(os.path.join(root, "**", "results_*.json"), recursive=True))[-1]
    samples = sorted(glob.glob(os.path.join(root, "**", "samples_*.jsonl"), recursive=True))[-1]
    with open(results) as f:
        res = json.load(f)["results"]
    with open(samples) as f:
        items = {s["doc_id"]: s for s in map(json.loads, f)}
    return res, items


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("reference")
    p.add_argument("candidate")
    p.add_argument("--tol", type=float, default=1e-4)
    args = p.parse_args()
    (ref_res, ref), (got_res, got) = _load(args.reference), _load(args.candidate)
    task = next(iter(ref_res))
    worst, flags, count = 0.0, 0, 0
    for doc_id, r in ref.items():
        g = got[doc_id]
        for (rl,), (gl,) in zip(r["resps"], g["resps"]):
            worst = max(worst, abs(float(rl[0]) - float(gl[0])))
            flags += str(rl[1]) != str(gl[1])
            count += 1
    ra, ga = ref_res[task]["acc,none"], got_res[task]["acc,none"]
    print(f"{task}: {len(ref)} items, {count} choices")
    print(f"  accuracy: reference {ra:.4f}, candidate {ga:.4f}")
    print(f"  loglikelihood: max |difference| {worst:.2e}; is-greedy flags differing: {flags}")
    ok = ra == ga and worst <= args.tol and len(ref) == len(got)
    print("EQUAL" if ok else "DIFFERENT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
