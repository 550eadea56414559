"""The wire contract of a busy server's hint: a RESOURCE_EXHAUSTED worth retrying carries trailing metadata
`retry-after-ms`, how long to wait before trying again. One without it (a request that can never fit, a
per-caller cap) will fail the same way again."""

from __future__ import annotations

RETRY_AFTER = "retry-after-ms"


def retry_after_s(call: object) -> float | None:
    """The hint on a failed call (a grpc.Call, sync or its metadata tuple), in seconds; None when it gave none."""
    trailers = getattr(call, "trailing_metadata", None)
    for key, value in (trailers() if callable(trailers) else None) or ():
        if key == RETRY_AFTER:
            try:
                return max(0.0, int(value) / 1000)
            except ValueError:
                return None
    return None
