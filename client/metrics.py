"""A kvserve service's Prometheus page, read back: `kvserve stats` and the benchmarks scrape them."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample: value}, each sample named as the page writes it: the full sample
    name (`_total`, `_created`, `_bucket` kept) and its labels in page order, `name{a="x",b="y"}`.
    Raises ValueError on a malformed page."""
    return {sample_key(s.name, s.labels): float(s.value)
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample_key(name: str, labels: dict[str, str]) -> str:
    """`name{a="x",b="y"}`, label values escaped as in the exposition format; a bare `name` without labels."""
    if not labels:
        return name
    escaped = (v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"") for v in labels.values())
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, escaped, strict=True)) + "}"
