"""Prometheus metrics of a store, read from its stats at scrape time (no double bookkeeping)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.store import BlockStore

_PER_TIER: list[tuple[type[GaugeMetricFamily] | type[CounterMetricFamily], str, str]] = [
    (GaugeMetricFamily, "blocks", "Blocks held per tier"),
    (GaugeMetricFamily, "bytes", "Payload bytes held per tier"),
    (GaugeMetricFamily, "capacity_bytes", "Byte capacity per tier"),
    (CounterMetricFamily, "hits", "Block accesses (Lookup, Get) served by the tier"),
    (CounterMetricFamily, "misses", "Block accesses that did not find the block in the tier"),
    (CounterMetricFamily, "evictions", "Blocks dropped from the store by the tier"),
    (CounterMetricFamily, "demotions", "Blocks moved down out of the tier"),
    (CounterMetricFamily, "promotions", "Blocks moved up out of the tier on a hit"),
]


class StoreCollector(Collector):
    def __init__(self, store: BlockStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        stats = self.store.stats()
        for family, name, doc in _PER_TIER:  # name: a TierStats field
            metric = family(f"kvserve_kvstore_{name}", doc, labels=["tier"])
            for t in stats.tiers:
                metric.add_metric([t.tier], getattr(t, name))
            yield metric
        yield CounterMetricFamily(
            "kvserve_kvstore_checksum_failures", "Corrupt blocks found, deleted and reported as misses",
            value=stats.checksum_failures,
        )
        available = GaugeMetricFamily("kvserve_kvstore_tier_available",
                                      "0 once a tier failed at runtime (disk full, read-only or damaged) and takes no "
                                      "more blocks", labels=["tier"])
        for t in stats.tiers:
            available.add_metric([t.tier], int(t.available))
        yield available
        yield CounterMetricFamily(
            "kvserve_kvstore_disk_write_failures", "Blocks the disk tier failed to write (it does not hold them)",
            value=stats.disk_write_failures,
        )
        yield CounterMetricFamily(
            "kvserve_kvstore_removed_blocks", "Blocks removed because a reader found them bad (Remove)",
            value=stats.removed_blocks,
        )
        yield GaugeMetricFamily("kvserve_kvstore_leases", "Leases held", value=stats.leases)
        quarantined = any(getattr(s.storage, "quarantined", None) is not None for s in self.store.tiers)
        yield GaugeMetricFamily("kvserve_kvstore_disk_quarantined",
                                "1 when the disk tier found at start was damaged, moved aside and started empty",
                                value=int(quarantined))
        yield GaugeMetricFamily("kvserve_kvstore_pinned_blocks", "Blocks pinned by leases", value=stats.pinned_blocks)
