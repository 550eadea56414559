"""What every kvserve service's metrics share: latency buckets and a request's outcome label (the
engine's step metrics are kvserve/engine/metrics.py's)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import Counter

from kvserve.rpc.errors import status_of

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def outcome_of(exc: BaseException | None) -> str:
    """A request's outcome label: ok, cancelled (its caller went away), or the lower-case name of
    the gRPC status the request ends with (`kvserve.rpc.errors.status_of`)."""
    if exc is None:
        return "ok"
    if isinstance(exc, GeneratorExit):
        return "cancelled"
    return status_of(exc).name.lower()


@contextmanager
def count_outcome(requests: Counter) -> Iterator[None]:
    """Counts one request in `requests` (labelled by `outcome`) by the exception it ends with, if any."""
    error: BaseException | None = None
    try:
        yield
    except BaseException as exc:
        error = exc
        raise
    finally:
        requests.labels(outcome=outcome_of(error)).inc()
