"""``python -m weight_sync.bench``: the weight-sync benchmark. Its code lives in ``benchmarks/`` of a source checkout
(``benchmarks.weight_sync_bench``), which the installed package does not ship."""

import sys

try:
    from benchmarks.weight_sync_bench import main
except ModuleNotFoundError as e:
    if e.name != "benchmarks":
        raise
    sys.exit("python -m weight_sync.bench runs from the root of a source checkout (it needs its benchmarks/ directory)")

if __name__ == "__main__":
    sys.exit(main())
