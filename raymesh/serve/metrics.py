"""The server's Prometheus metrics (prometheus_client), on a registry of its own per server, so
two servers in one process never share or clash over a metric. GET /metrics serves them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self, max_batch_size: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "raymesh_serve_requests", "HTTP requests answered", ["route", "code"], registry=r
        )
        self.latency = Histogram(
            "raymesh_serve_request_seconds",
            "Time from a request's arrival to its answer",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, max_batch_size})
        self.batch_size = Histogram(
            "raymesh_serve_batch_size",
            "Requests per batch sent to a replica",
            buckets=[s for s in sizes if s <= max_batch_size],
            registry=r,
        )
        self.queue_depth = Gauge("raymesh_serve_queue_depth", "Requests waiting", registry=r)
        self.replicas = Gauge("raymesh_serve_replicas", "Replicas ready", registry=r)
        self.replicas_lost = Counter(
            "raymesh_serve_replicas_lost", "Replicas lost (and replaced)", registry=r
        )
        self.retries = Counter(
            "raymesh_serve_retries", "Requests resent after their replica was lost", registry=r
        )
        self.scale_decisions = Counter(
            "raymesh_serve_scale_decisions", "Autoscaling decisions carried out", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
