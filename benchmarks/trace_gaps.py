"""Where a profiled window's GPU time went: the kernels' busy time, the idle time between them summed by the
pair of kernels around each gap, and the kernels by total time. Reads a Chrome trace (``.json`` or
``.json.gz``) as ``Engine.start_profile`` / ``/start_profile`` and torch.profiler write them.

    python -m benchmarks.trace_gaps /tmp/1764150000-TP-0.trace.json.gz [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from dataclasses import dataclass, field
from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class TraceSummary:
    """Times in microseconds. ``gaps``: (before, after) → [idle µs, count], largest first; ``kernels``:
    name → [busy µs, count], largest first (names cut to ``name_len`` characters)."""

    events: int = 0
    span_us: float = 0.0
    busy_us: float = 0.0
    idle_us: float = 0.0
    gaps: list[tuple[tuple[str, str], list[float]]] = field(default_factory=list)
    kernels: list[tuple[str, list[float]]] = field(default_factory=list)


def load_events(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def summarize(events: list[dict[str, Any]], name_len: int = 40) -> TraceSummary:
    """The GPU timeline of ``events``: kernels, copies and memsets on any stream, overlapping ones merged."""
    spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                   if e.get("cat") in GPU_CATEGORIES and "dur" in e)
    out = TraceSummary(events=len(spans))
    if not spans:
        return out
    kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    gaps: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
    end_prev, name_prev = spans[0][0], spans[0][2]
    for start, end, name in spans:
        kernels[name[:name_len]][0] += end - start
        kernels[name[:name_len]][1] += 1
        if start > end_prev:
            gap = gaps[(name_prev[:name_len], name[:name_len])]
            gap[0] += start - end_prev
            gap[1] += 1
            out.idle_us += start - end_prev
        out.busy_us += max(0.0, end - max(start, end_prev))
        if end > end_prev:
            end_prev, name_prev = end, name
    out.span_us = end_prev - spans[0][0]
    out.gaps = sorted(gaps.items(), key=lambda kv: -kv[1][0])
    out.kernels = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return out


def format_summary(s: TraceSummary, top: int = 12) -> str:
    if not s.events:
        return "no GPU kernels in the trace (a CPU-only profile?)"
    lines = [f"GPU timeline: {s.events} kernels/copies over {s.span_us / 1000:.2f} ms, busy {s.busy_us / 1000:.2f} ms, "
             f"idle {s.idle_us / 1000:.2f} ms"]
    lines += [f"  idle {t / 1000:7.3f} ms in {int(c):5d} gaps: {a} -> {b}" for (a, b), (t, c) in s.gaps[:top]]
    lines.append("kernels by GPU time:")
    lines += [f"  {t / 1000:7.3f} ms in {int(c):5d} calls: {name}" for name, (t, c) in s.kernels[:top]]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.trace_gaps",
                                description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    print(format_summary(summarize(load_events(args.trace)), args.top))


if __name__ == "__main__":
    main()
