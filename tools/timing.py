"""GPU timing for the tools: one function call timed with CUDA events, as plain launches or replayed from a
CUDA graph. Tooling only (nothing in the shipped packages imports it)."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def _timed(run: Callable[[], object], calls: int, repeats: int) -> list[float]:
    """Per-call ms of ``repeats`` timed runs of ``run`` (which makes ``calls`` calls)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return times


def graph_ms(fn: Callable[[], object], calls: int = 20, repeats: int = 7, warmup: int = 2,
             best: bool = False) -> float:
    """ms per ``fn`` call: ``warmup`` calls on a side stream (compiles, allocator), ``calls`` calls captured
    into one CUDA graph, one untimed replay, then ``repeats`` timed replays; the median of their per-call
    means (``best``: the minimum)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = _timed(graph.replay, calls, repeats)
    return min(times) if best else statistics.median(times)


def eager_ms(fn: Callable[[], object], calls: int = 20, repeats: int = 7, warmup: int = 1) -> float:
    """ms per ``fn`` call as plain launches: ``warmup`` calls, then the median of ``repeats`` timed runs of
    ``calls`` calls each."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()

    def run() -> None:
        for _ in range(calls):
            fn()
    return statistics.median(_timed(run, calls, repeats))
