"""``python -m weight_sync.bench``: the weight-sync benchmark. Its code lives in ``benchmarks/`` of a source
checkout (``benchmarks.weight_sync_bench``), which the installed package does not ship."""

import sys

from rollout.bench import run_from_checkout

if __name__ == "__main__":
    sys.exit(run_from_checkout("benchmarks.weight_sync_bench", "python -m weight_sync.bench"))
