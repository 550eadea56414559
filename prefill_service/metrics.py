"""Prometheus metrics of the prefill service, in the Server's registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvserve.engine.metrics import EngineMetrics
from kvserve.rpc.metrics import LATENCY_BUCKETS


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
        self.running = Gauge(p + "running_requests", "Requests in the engine: queued, loading KV or computing",
                             registry=registry)
        self.waiting = Gauge(p + "waiting_requests", "Requests not yet in the engine (tokenizing, store lookup)",
                             registry=registry)
        self.engine = EngineMetrics(registry, p)
