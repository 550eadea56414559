"""The router's Decode servicer: the front door's API, each call passed to a replica."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kvserve.router.router import Router
from protos.kvserve.v1 import decode_pb2, decode_pb2_grpc

FORWARDED_METADATA = ("authorization",)
HELD_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry, router: Router) -> None:
        p = "kvserve_router_"
        Gauge(p + "healthy_replicas", "Decode replicas that answer health checks and load",
              registry=registry).set_function(lambda: router.num_healthy)
        Gauge(p + "replicas", "Decode replicas the --decode addresses name", registry=registry
              ).set_function(lambda: len(router.replicas))
        self.routed = Counter(p + "requests", "Requests sent to a decode replica, by replica and policy",
                              ["replica", "policy"], registry=registry)
        self.held_blocks = Histogram(p + "held_blocks", "Leading prompt blocks the chosen replica held",
                                     buckets=HELD_BUCKETS, registry=registry)
        Gauge(p + "distrusted_replicas", "Decode replicas whose claims (blocks, load) are not believed now, "
              "since they lied", registry=registry).set_function(lambda: router.num_distrusted)
        Gauge(p + "index_bytes", "Bytes the router's indexes of the replicas' blocks hold",
              registry=registry).set_function(lambda: router.index_bytes)
        Gauge(p + "ejected_replicas", "Decode replicas out of choice now for failing requests in a row",
              registry=registry).set_function(lambda: router.num_ejected)
        registry.register(_Counts(router))

    def observe(self, replica: str, policy: str, held: int) -> None:
        self.routed.labels(replica=replica, policy=policy).inc()
        self.held_blocks.observe(held)


class _Counts(Collector):
    """What the router counts itself, read at each scrape."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[CounterMetricFamily]:
        lies = CounterMetricFamily("kvserve_router_replica_lies", "Times a decode replica was distrusted, by "
                                   "what it lied about (hash, count, kind, tier, load)", labels=["replica", "reason"])
        for (replica, reason), n in sorted(self.router.lies().items()):
            lies.add_metric([replica, reason], n)
        yield lies
        refused = CounterMetricFamily("kvserve_router_refused", "Requests a decode replica refused as busy "
                                      "(RESOURCE_EXHAUSTED before its first response), by replica", labels=["replica"])
        for replica, n in sorted(self.router.refusals().items()):
            refused.add_metric([replica], n)
        yield refused
        yield CounterMetricFamily("kvserve_router_overloaded", "Requests refused as busy (RESOURCE_EXHAUSTED, with "
                                  "retry-after-ms) after every replica refused them", value=self.router.overloaded)
        migrations = CounterMetricFamily("kvserve_router_migrations", "Streams moved to another replica after "
                                         "theirs died, by outcome: resumed (another replica took it up), limit "
                                         "(moved --max-migrations times already), failed (no replica took it up)",
                                         labels=["outcome"])
        for outcome, n in sorted(self.router.migrations().items()):
            migrations.add_metric([outcome], n)
        yield migrations
        yield _by_replica("kvserve_router_first_token_timeouts", "Calls the router cancelled for want of a first "
                          "response within --first-token-timeout-s, by replica", self.router.first_token_timeouts())
        yield _by_replica("kvserve_router_ejections", "Times a decode replica was ejected for failing "
                          "--eject-after requests in a row, by replica", self.router.ejections())


def _by_replica(name: str, documentation: str, counts: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=["replica"])
    for replica, n in sorted(counts.items()):
        family.add_metric([replica], n)
    return family


class RouterServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    def Generate(  # noqa: N802 - gRPC method name
        self, request: decode_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[decode_pb2.GenerateResponse]:
        metadata = [(k, v) for k, v in context.invocation_metadata() if k in FORWARDED_METADATA]

        def on_call(call: Any) -> None:
            if not context.add_callback(call.cancel):  # the caller went away: so does the replica's work
                call.cancel()  # it went before this call began (while the router waited out a busy round)

        yield from self.router.generate(request, metadata, context.time_remaining, on_call)
