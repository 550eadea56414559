"""Prometheus metrics of a store, read from its stats at scrape time (no double bookkeeping)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.store import BlockStore


class StoreCollector(Collector):
    def __init__(self, store: BlockStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        stats = self.store.stats()
        gauges = {
            "blocks": ("Blocks held per tier", lambda t: t.blocks),
            "bytes": ("Payload bytes held per tier", lambda t: t.bytes),
            "capacity_bytes": ("Byte capacity per tier", lambda t: t.capacity_bytes),
        }
        for name, (doc, get) in gauges.items():
            g = GaugeMetricFamily(f"kvstore_{name}", doc, labels=["tier"])
            for t in stats.tiers:
                g.add_metric([t.tier], get(t))
            yield g
        counters = {
            "hits": ("Block accesses (Lookup, Get) served by the tier", lambda t: t.hits),
            "misses": ("Block accesses that did not find the block in the tier", lambda t: t.misses),
            "evictions": ("Blocks dropped from the store by the tier", lambda t: t.evictions),
            "demotions": ("Blocks moved down out of the tier", lambda t: t.demotions),
            "promotions": ("Blocks moved up out of the tier on a hit", lambda t: t.promotions),
        }
        for name, (doc, get) in counters.items():
            c = CounterMetricFamily(f"kvstore_{name}", doc, labels=["tier"])
            for t in stats.tiers:
                c.add_metric([t.tier], get(t))
            yield c
        yield CounterMetricFamily(
            "kvstore_checksum_failures", "Corrupt blocks found, deleted and reported as misses",
            value=stats.checksum_failures,
        )
        yield GaugeMetricFamily("kvstore_leases", "Leases held", value=stats.leases)
        yield GaugeMetricFamily("kvstore_pinned_blocks", "Blocks pinned by leases", value=stats.pinned_blocks)
