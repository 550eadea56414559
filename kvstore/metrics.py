"""Prometheus metrics of a store, read from its stats at scrape time (no double bookkeeping)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.store import BlockStore
from kvstore.types import LATENCY_BUCKETS_S, RemoteStats

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
_REMOTE: list[tuple[type[GaugeMetricFamily] | type[CounterMetricFamily], str, str]] = [
    (CounterMetricFamily, "hits", "Blocks missing locally that the remote tier had (promoted into the local tiers)"),
    (CounterMetricFamily, "misses", "Blocks missing locally that the remote tier did not give (absent, bad, or an error)"),
    (CounterMetricFamily, "checksum_failures", "Remote values that failed their checksum: damaged (misses)"),
    (CounterMetricFamily, "mac_failures",
     "Remote values not written under their key by this deployment: moved, forged, or under another record key "
     "(misses)"),
    (CounterMetricFamily, "read_bytes", "Bytes read from the remote tier"),
    (CounterMetricFamily, "written_blocks", "Blocks written to the remote tier"),
    (CounterMetricFamily, "written_bytes", "Bytes written to the remote tier"),
    (CounterMetricFamily, "dropped_writes",
     "Blocks never written to the remote tier: its queue was full, the write failed, or the block was gone"),
    (GaugeMetricFamily, "queued_blocks", "Blocks waiting to be written to the remote tier"),
    (GaugeMetricFamily, "queued_bytes", "Bytes waiting to be written to the remote tier"),
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
        yield CounterMetricFamily(
            "kvserve_kvstore_mac_failures", "Disk records not written under their key by this deployment (moved, "
            "forged, or under another record key), found at start or on a read: deleted, reported as misses",
            value=stats.mac_failures,
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
        if stats.remote is not None:
            yield from _remote_metrics(stats.remote)


def _remote_metrics(remote: RemoteStats) -> Iterator[Metric]:
    for family, name, doc in _REMOTE:  # name: a RemoteStats field
        yield family(f"kvserve_kvstore_remote_{name}", doc, value=getattr(remote, name))
    errors = CounterMetricFamily("kvserve_kvstore_remote_errors", "Calls to the remote tier that failed or timed out",
                                 labels=["op"])
    errors.add_metric(["read"], remote.read_errors)
    errors.add_metric(["write"], remote.write_errors)
    yield errors
    breaker = GaugeMetricFamily("kvserve_kvstore_remote_breaker",
                                "1 for the remote tier's circuit breaker state: closed (calls go through), open "
                                "(failing: no calls for a cool-down), half_open (one probe let through)",
                                labels=["state"])
    for state in ("closed", "open", "half_open"):
        breaker.add_metric([state], int(remote.breaker == state))
    yield breaker
    latency = HistogramMetricFamily("kvserve_kvstore_remote_latency_seconds",
                                    "Seconds of each call to the remote tier (a read, or a pipelined batch of writes)",
                                    labels=["op"])
    for op, lat in (("read", remote.read_latency), ("write", remote.write_latency)):
        counts = lat.buckets or (0,) * (len(LATENCY_BUCKETS_S) + 1)
        cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
        bounds = [*(f"{b:g}" for b in LATENCY_BUCKETS_S), "+Inf"]
        latency.add_metric([op], list(zip(bounds, cumulative, strict=True)), lat.seconds)
    yield latency
