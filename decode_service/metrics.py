"""Prometheus metrics of the decode service (the front door), in the Server's registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvserve.engine.metrics import EngineMetrics
from kvserve.rpc.metrics import LATENCY_BUCKETS

ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class DecodeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        p = "kvserve_decode_"
        self.requests = Counter(p + "requests", "Generate requests by outcome", ["outcome"], registry=registry)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens received", registry=registry)
        self.cached_tokens = Counter(p + "cached_tokens", "Prompt tokens whose KV prefill found in the store",
                                     registry=registry)
        self.computed_tokens = Counter(p + "computed_tokens", "Prompt tokens computed, by prefill or here (local)",
                                       registry=registry)
        self.prefills = Counter(p + "prefills", "Requests by where their prompt was computed: local (this "
                                "service's engine) or disaggregated (the prefill service)", ["path"],
                                registry=registry)
        for path in ("local", "disaggregated"):  # both on the page from the start, at 0
            self.prefills.labels(path=path)
        self.prefill_fallbacks = Counter(
            p + "prefill_fallbacks", "Requests whose prompt this service computed because prefill could not: "
            "unavailable (no replica answers), overloaded (RESOURCE_EXHAUSTED) or failed (an internal error, or "
            "no answer within --prefill-timeout-s)", ["reason"], registry=registry,
        )
        for reason in ("unavailable", "overloaded", "failed"):
            self.prefill_fallbacks.labels(reason=reason)
        self.recomputed_tokens = Counter(
            p + "recomputed_tokens", "Prompt tokens decode recomputed because their KV was missing or bad",
            registry=registry,
        )
        self.generated_tokens = Counter(p + "generated_tokens", "Tokens generated", registry=registry)
        self.stored_blocks = Counter(p + "stored_blocks", "New KV blocks of generated tokens put into the store",
                                     registry=registry)
        self.store_failures = Counter(
            p + "store_failures", "Store calls that failed or timed out (decode recomputed instead)",
            ["op"], registry=registry,
        )
        self.bad_blocks = Counter(p + "bad_blocks", "Fetched blocks that failed verification, by kind",
                                  ["kind"], registry=registry)
        self.ttft = Histogram(p + "ttft_seconds", "Request arrival to first token sent",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between consecutive tokens sent",
                             buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram(p + "request_seconds", "Request arrival to final result",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.running = Gauge(p + "running_requests", "Requests whose sequence is in the decode engine (queued, "
                             "loading KV, computing or decoding)", registry=registry)
        self.waiting = Gauge(p + "waiting_requests", "Requests not yet in the decode engine (prefill, hand-off)",
                             registry=registry)
        self.engine = EngineMetrics(registry, p)

    def running_and_waiting(self) -> tuple[int, int]:
        get = self.registry.get_sample_value
        return int(get("kvserve_decode_running_requests") or 0), int(get("kvserve_decode_waiting_requests") or 0)
