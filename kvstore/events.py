"""Store events (blocks stored, blocks removed) fanned out to subscribers.

Each subscriber has a bounded queue; when a slow subscriber's queue is full the oldest events
are dropped (and counted in `dropped`), so a stuck router never slows the store down.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import NamedTuple

from kvstore.types import Tier
from protos.block_hash import BlockHash


class StoreEvent(NamedTuple):
    stored: bool  # False: removed
    key: BlockHash
    tier: Tier | None


class Subscription:
    def __init__(self, hub: EventHub, maxlen: int) -> None:
        self._hub = hub
        self._queue: deque[StoreEvent] = deque(maxlen=maxlen)
        self._cond = threading.Condition()
        self.dropped = 0
        self.closed = False

    def push(self, event: StoreEvent) -> None:
        with self._cond:
            if len(self._queue) == self._queue.maxlen:
                self.dropped += 1
            self._queue.append(event)
            self._cond.notify()

    def take(self, timeout_s: float) -> list[StoreEvent]:
        """All queued events, waiting up to timeout_s for the first; [] on timeout or close."""
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self.closed, timeout=timeout_s)
            out = list(self._queue)
            self._queue.clear()
            return out

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        self._hub.unsubscribe(self)


class EventHub:
    def __init__(self, queue_len: int = 10_000) -> None:
        self._subs: list[Subscription] = []
        self._lock = threading.Lock()
        self.queue_len = queue_len

    @property
    def subscribers(self) -> int:
        """How many subscriptions are open."""
        return len(self._subs)

    def subscribe(self) -> Subscription:
        sub = Subscription(self, self.queue_len)
        with self._lock:
            self._subs = [*self._subs, sub]
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subs = [s for s in self._subs if s is not sub]

    def publish(self, event: StoreEvent) -> None:
        for sub in self._subs:
            sub.push(event)

    def close(self) -> None:
        for sub in list(self._subs):
            sub.close()
