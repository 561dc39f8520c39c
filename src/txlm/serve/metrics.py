"""Prometheus metrics of one server (their own registry: two apps in one process do not mix)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "txlm_requests", "requests by route and status", ["route", "status"], registry=r
        )
        self.prompt_tokens = Counter("txlm_prompt_tokens", "prompt tokens read", registry=r)
        self.generated_tokens = Counter("txlm_generated_tokens", "tokens generated", registry=r)
        self.queue_depth = Gauge("txlm_queue_depth", "requests waiting for a row", registry=r)
        self.batch_size = Gauge("txlm_batch_size", "rows in the decoding batch", registry=r)
        self.sessions = Gauge("txlm_sessions", "sessions kept", registry=r)
        self.session_bytes = Gauge("txlm_session_bytes", "bytes of the sessions' memories",
                                   registry=r)  # fmt: skip
        self.ttft = Histogram(
            "txlm_time_to_first_token_seconds", "from a request's arrival to its first token",
            buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.token_latency = Histogram(
            "txlm_token_latency_seconds", "one decoding step of the batch", buckets=_LATENCY,
            registry=r,
        )  # fmt: skip

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
