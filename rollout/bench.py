"""``python -m rollout.bench``: the offline throughput benchmark. Its code lives in ``benchmarks/`` of a source checkout
(``benchmarks.bench``), which the installed package does not ship."""

import sys

try:
    from benchmarks.bench import main
except ModuleNotFoundError as e:
    if e.name != "benchmarks":
        raise
    sys.exit("python -m rollout.bench runs from the root of a source checkout (it needs its benchmarks/ directory)")

if __name__ == "__main__":
    sys.exit(main())
