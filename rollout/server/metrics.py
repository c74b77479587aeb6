"""Prometheus metrics for ``GET /metrics``: what the server served, plus the engine's load on each scrape.

Counters of served traffic (requests, prompt/cached tokens, finish reasons, latency) are updated by the
handlers. Each scrape asks the scheduler for its load (running/queued requests, KV usage, cumulative
prefill and generated tokens, weight version); when it is busy (e.g. receiving weights) the last answer
is shown and ``rollout_engine_load_stale`` is 1. Every server has its own registry.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    """The server's registry: served-traffic counters and a collector over the latest engine load."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("rollout_http_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("rollout_prompt_tokens", "Prompt tokens of finished generation requests",
                                     registry=r)
        self.cached_tokens = Counter("rollout_cached_prompt_tokens",
                                     "Prompt tokens of finished requests served from the prefix cache", registry=r)
        self.completion_tokens = Counter("rollout_completion_tokens",
                                         "Tokens returned to clients (finished and streamed)", registry=r)
        self.finished = Counter("rollout_request_finished", "Finished sequences by finish reason",
                                ["finish_reason"], registry=r)
        self.disconnects = Counter("rollout_client_disconnects",
                                   "Requests aborted because the client went away", registry=r)
        self.latency = Histogram("rollout_e2e_request_latency_seconds", "Time from request to last token",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.weight_syncs = Counter("rollout_weight_updates", "Completed weight updates through this server",
                                    registry=r)
        self.last_sync = Gauge("rollout_last_weight_sync_seconds",
                               "Duration of the last complete weight update (first update call to the one "
                               "that completed it)", registry=r)
        self.hit_rate = Gauge("rollout_cache_hit_rate",
                              "Cached prompt tokens / prompt tokens, over finished requests", registry=r)
        self.load = EngineLoadCollector()
        r.register(self.load)
        self._prompt_total = 0
        self._cached_total = 0

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def output_finished(self, prompt_tokens: int, cached_tokens: int, finish_reasons: list[str | None],
                        seconds: float) -> None:
        """One request (all its ``n`` sequences) finished."""
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self._prompt_total += prompt_tokens
        self._cached_total += cached_tokens
        self.hit_rate.set(self._cached_total / self._prompt_total if self._prompt_total else 0.0)
        for reason in finish_reasons:
            self.finished.labels(finish_reason=reason or "abort").inc()
        self.latency.observe(seconds)

    def weight_sync_done(self, seconds: float) -> None:
        self.weight_syncs.inc()
        self.last_sync.set(seconds)

    def render(self, load: dict[str, Any] | None) -> bytes:
        """The exposition text; ``load`` is the scheduler's fresh answer, or None if it did not answer."""
        self.load.update(load)
        return generate_latest(self.registry)


class EngineLoadCollector:
    """Gauges and counters from the scheduler's ``get_load`` answer; throughput between two scrapes."""

    def __init__(self) -> None:
        self.load: dict[str, Any] | None = None
        self.stale = True
        self.prev: tuple[float, int, int] | None = None  # (time, prefill tokens, generated tokens)
        self.throughput = (0.0, 0.0)

    def update(self, load: dict[str, Any] | None) -> None:
        self.stale = load is None
        if load is None:
            return
        now = time.monotonic()
        if self.prev is not None and now > self.prev[0]:
            dt = now - self.prev[0]
            self.throughput = ((load["prefill_tokens"] - self.prev[1]) / dt, (load["gen_tokens"] - self.prev[2]) / dt)
        self.prev = (now, load["prefill_tokens"], load["gen_tokens"])
        self.load = load

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        yield GaugeMetricFamily("rollout_engine_load_stale",
                                "1 when the scheduler did not answer this scrape (busy, e.g. receiving weights)",
                                value=1.0 if self.stale else 0.0)
        load = self.load
        if load is None:
            return
        kv_total = max(load["kv_total"], 1)
        gauges = {
            "rollout_num_running_reqs": ("Requests running in the scheduler", load["running"]),
            "rollout_num_queue_reqs": ("Requests waiting in the scheduler's queue", load["waiting"]),
            "rollout_kv_used_tokens": ("KV cache slots in use (not counting evictable prefix cache)",
                                       load["kv_used"]),
            "rollout_kv_total_tokens": ("KV cache slots in total", load["kv_total"]),
            "rollout_kv_cache_usage": ("Fraction of KV cache slots in use", load["kv_used"] / kv_total),
            "rollout_prefix_cache_tokens": ("Tokens held by the radix prefix cache", load["cached_tokens"]),
            "rollout_prefill_throughput": ("Prefill tokens/s between the last two scrapes", self.throughput[0]),
            "rollout_gen_throughput": ("Generated tokens/s between the last two scrapes", self.throughput[1]),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(value))
        counters = {
            "rollout_generation_tokens": ("Tokens sampled by the scheduler", load["gen_tokens"]),
            "rollout_prefill_computed_tokens": ("Prompt tokens computed by prefill (cache misses)",
                                                load["prefill_tokens"]),
            "rollout_retractions": ("Running requests preempted for KV space", load["retractions"]),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=float(value))
        version = str(load.get("weight_version", ""))
        yield InfoMetricFamily("rollout_weight_version", "The served weight version", value={"version": version})
        if version.isdigit():
            yield GaugeMetricFamily("rollout_weight_version_number", "The served weight version, when numeric",
                                    value=float(version))
