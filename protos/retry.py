"""Retrying, one way for every caller. A busy server's RESOURCE_EXHAUSTED worth retrying carries trailing
metadata `retry-after-ms`, how long to wait before trying again; one without it (a request that can never fit, a
per-caller cap) will fail the same way again. `Backoff` says how long to wait before each next try."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

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


@dataclass(slots=True)
class Backoff:
    """The waits before the tries of one thing (a service started again, a stream followed again, busy replicas
    asked again): `initial_s`, doubling up to `max_s` while tries keep failing, and `initial_s` again after a try
    that lasted `stable_s`. With `jitter`, each wait is drawn below its step (full jitter), so that callers
    refused together do not come back together; a server's hint is waited on top. Never more than `max_s`."""

    initial_s: float = 0.5
    max_s: float = 30.0
    stable_s: float = 60.0
    jitter: bool = False
    rng: random.Random = field(default_factory=random.Random, repr=False, compare=False)
    next_s: float = field(init=False)  # the next step, before jitter and hint

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"a backoff needs 0 < initial_s ({self.initial_s}) <= max_s ({self.max_s})")
        self.next_s = self.initial_s

    def delay(self, lasted_s: float | None = None, hint_s: float | None = None) -> float:
        """The wait before the next try, after one that lasted `lasted_s` (None: it failed as it began) and was
        answered with a retry-after hint of `hint_s` (None: none)."""
        if lasted_s is not None and lasted_s >= self.stable_s:
            self.next_s = self.initial_s
        step, self.next_s = self.next_s, min(2 * self.next_s, self.max_s)
        wait = self.rng.uniform(0, step) if self.jitter else step
        return min(self.max_s, (hint_s or 0.0) + wait)
