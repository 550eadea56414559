"""A kvserve service's Prometheus page, read back: `kvserve stats` and the benchmarks scrape them."""

from __future__ import annotations


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name with labels: value}, comments dropped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
