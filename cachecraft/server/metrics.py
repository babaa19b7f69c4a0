"""``GET /metrics``: the server's figures in Prometheus' text format (prometheus-client).

Requests by endpoint and status, request and time-to-first-token histograms, chunk
lookups by tier (``miss`` included: the hit rate of a tier is its share of the lookups),
the recompute fraction, and, read when scraped, bytes and entries per tier, the queue and
the chunk orders stored exactly in idle time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from cachecraft.pipeline import Answer
    from cachecraft.server.service import Service

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _TierCollector:
    """Bytes and entries per tier, the queue and the orders made exact while idle, read when
    scraped."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def collect(self):
        held = GaugeMetricFamily("cachecraft_tier_bytes", "Bytes each tier holds", labels=["tier"])
        entries = GaugeMetricFamily("cachecraft_tier_entries", "Chunk-caches each tier holds", labels=["tier"])
        budget = GaugeMetricFamily("cachecraft_tier_budget_bytes", "Byte budget of each tier", labels=["tier"])
        for name, state in self.service.pipeline.store.usage().items():
            held.add_metric([name], state.bytes)
            entries.add_metric([name], state.entries)
            budget.add_metric([name], state.budget)
        queue = GaugeMetricFamily("cachecraft_queued_requests", "Requests waiting for the model or computing")
        queue.add_metric([], self.service.queued)
        exact = CounterMetricFamily("cachecraft_orders_made_exact", "Chunk orders stored as a full prefill's KV "
                                    "while no request waited (exact_when_idle)")
        exact.add_metric([], self.service.counters.made_exact)
        yield from (held, entries, budget, queue, exact)


class Metrics:
    """The server's registry (one per application, so tests can run several)."""

    def __init__(self, service: Service) -> None:
        self.registry = CollectorRegistry()
        self.http = Counter("cachecraft_http_requests", "HTTP requests by path and status",
                            ["path", "status"], registry=self.registry)
        self.latency = Histogram("cachecraft_http_request_seconds", "Whole HTTP request time", ["path"],
                                 buckets=TTFT_BUCKETS, registry=self.registry)
        self.ttft = Histogram("cachecraft_ttft_seconds", "Time to first token of answered requests",
                              ["method"], buckets=TTFT_BUCKETS, registry=self.registry)
        self.lookups = Counter("cachecraft_chunk_lookups", "Chunk lookups by the tier that served them "
                               "(miss: none)", ["tier"], registry=self.registry)
        self.recompute = Histogram("cachecraft_recompute_fraction", "Share of chunk tokens recomputed",
                                   buckets=(0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0), registry=self.registry)
        self.registry.register(_TierCollector(service))

    def observe_http(self, path: str, status: int, seconds: float) -> None:
        """Count one HTTP request (paths outside the API are grouped, so labels stay few)."""
        label = path if path.startswith("/v1/") or path in ("/healthz", "/metrics") else "other"
        self.http.labels(label, str(status)).inc()
        self.latency.labels(label).observe(seconds)

    def observe_answer(self, answer: Answer) -> None:
        """Record what one answer's cache did."""
        self.ttft.labels(answer.method.split("@")[0]).observe(answer.ttft_s)
        self.recompute.observe(answer.recompute_fraction)
        for chunk in answer.chunks:
            self.lookups.labels(chunk.tier).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
