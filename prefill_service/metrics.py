"""Prometheus metrics of the prefill service, in the Server's registry."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvstore.serving import ServiceError

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def outcome_of(exc: BaseException | None) -> str:
    """A request's outcome label: ok, a gRPC status name in lower case, or cancelled."""
    if exc is None:
        return "ok"
    if isinstance(exc, ServiceError):
        return exc.code.name.lower()
    if isinstance(exc, ValueError):
        return "invalid_argument"
    if isinstance(exc, GeneratorExit):
        return "cancelled"
    return "internal"


class PrefillMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        p = "kvserve_prefill_"
        self.requests = Counter(p + "requests", "Prefill requests by outcome", ["outcome"], registry=registry)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens received", registry=registry)
        self.cached_tokens = Counter(p + "cached_tokens", "Prompt tokens whose KV came from the store",
                                     registry=registry)
        self.computed_tokens = Counter(p + "computed_tokens", "Prompt tokens computed", registry=registry)
        self.generated_tokens = Counter(p + "generated_tokens", "First tokens sampled", registry=registry)
        self.stored_blocks = Counter(p + "stored_blocks", "New KV blocks put into the store", registry=registry)
        self.store_failures = Counter(
            p + "store_failures", "Store calls that failed or timed out (the request recomputed instead)",
            ["op"], registry=registry,
        )
        self.bad_blocks = Counter(p + "bad_blocks", "Fetched blocks that failed verification, by kind",
                                  ["kind"], registry=registry)
        self.ttft = Histogram(p + "ttft_seconds", "Request arrival to first token sampled",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.compute = Histogram(p + "compute_seconds", "Forward pass time per request",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.running = Gauge(p + "running_requests", "Requests in the forward pass", registry=registry)
        self.waiting = Gauge(p + "waiting_requests", "Requests waiting for the engine", registry=registry)

    @contextmanager
    def track(self) -> Iterator[None]:
        """Counts one request by its outcome (the exception it ends with, if any)."""
        error: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.requests.labels(outcome=outcome_of(error)).inc()
