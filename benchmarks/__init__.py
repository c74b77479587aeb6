"""Benchmarks of a source checkout (not shipped in the wheel): the offline throughput benchmark
(``python -m rollout.bench``, code in :mod:`benchmarks.bench`) and the weight-sync benchmark
(``python -m weight_sync.bench``, code in :mod:`benchmarks.weight_sync_bench`)."""
