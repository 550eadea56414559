"""A request's cancellation: set once from any thread (gRPC's RPC-termination callback)."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Cancellation:
    """Set once, from any thread (e.g. gRPC's RPC-termination callback); runs listeners once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._listeners: list[Callable[[], None]] = []

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            listeners, self._listeners = self._listeners, []
        for fn in listeners:
            fn()

    def on_cancel(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if not self._cancelled:
                self._listeners.append(fn)
                return
        fn()
