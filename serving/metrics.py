"""What every kvserve service's request metrics share: latency buckets and a request's outcome label."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from prometheus_client import Counter

from kvstore.serving import ServiceError

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def outcome_of(exc: BaseException | None) -> str:
    """A request's outcome label: ok, the lower-case gRPC status name it ends with, or cancelled.

    Follows the error interceptor's mapping (kvstore.serving): ServiceError, then a `grpc_status`
    attribute, then ValueError as invalid_argument; anything else is internal.
    """
    if exc is None:
        return "ok"
    if isinstance(exc, ServiceError):
        return exc.code.name.lower()
    code_name = getattr(exc, "grpc_status", None)
    if isinstance(code_name, str) and code_name in grpc.StatusCode.__members__:
        return code_name.lower()
    if isinstance(exc, ValueError):
        return "invalid_argument"
    if isinstance(exc, GeneratorExit):
        return "cancelled"
    return "internal"


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
