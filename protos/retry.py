"""The wire contract of a busy server's hint: a RESOURCE_EXHAUSTED worth retrying carries trailing metadata
`retry-after-ms`, how long to wait before trying again. One without it (a request that can never fit, a
per-caller cap) will fail the same way again. And how soon a stream that ended is followed again
(StreamBackoff)."""

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


class StreamBackoff:
    """How long to wait before following a stream again (an Events stream that ended): `first`, doubling to
    `most` while the streams keep ending soon after they begin (a server refusing one more, say), and `first`
    again after one that lasted `most`."""

    def __init__(self, first: float = 0.5, most: float = 5.0) -> None:
        self.first, self.most = first, most
        self._next = first

    def after(self, lived_s: float) -> float:
        """The wait after a stream that lived `lived_s` seconds."""
        if lived_s > self.most:
            self._next = self.first
        wait, self._next = self._next, min(2 * self._next, self.most)
        return wait
