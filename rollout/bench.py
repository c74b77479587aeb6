"""``python -m rollout.bench``: the offline throughput benchmark. Its code lives in ``benchmarks/`` of a source
checkout (``benchmarks.bench``), which the installed package does not ship."""

import importlib
import sys


def run_from_checkout(module: str, command: str) -> int:
    """Run ``module``'s ``main`` from the ``benchmarks/`` directory of a source checkout (``python -m`` puts
    the checkout's root on the path); a clear exit message when there is none."""
    try:
        main = importlib.import_module(module).main
    except ModuleNotFoundError as e:
        if e.name != "benchmarks":
            raise
        sys.exit(f"{command} runs from the root of a source checkout (it needs its benchmarks/ directory)")
    return main()


if __name__ == "__main__":
    sys.exit(run_from_checkout("benchmarks.bench", "python -m rollout.bench"))
