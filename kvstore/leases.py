"""Leases: pins on blocks for a TTL, so they are not dropped between a lookup and a fetch.

Pure bookkeeping with an injected clock; the store pins and unpins. Expiry is lazy (the store
calls `expired()` on each operation) and periodic (the server's sweeper), so nothing stays
pinned once requests stop.
"""

from __future__ import annotations

import heapq
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from protos.block_hash import BlockHash

MAX_TTL_S = 600.0


@dataclass(slots=True)
class Lease:
    lease_id: str
    entries: list[tuple[BlockHash, Any]]  # (key, the index entry that was pinned)
    expires_at: float


class LeaseTable:
    def __init__(self, clock: Callable[[], float], max_leases: int = 100_000) -> None:
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._expiry: list[tuple[float, str]] = []  # heap; stale rows skipped
        self.max_leases = max_leases

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[Lease]:
        return iter(self._leases.values())

    def add(self, entries: list[tuple[BlockHash, Any]], ttl_s: float) -> Lease:
        lease = Lease(uuid.uuid4().hex, entries, self._clock() + ttl_s)
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))
        return lease

    def pop(self, lease_id: str) -> Lease | None:
        return self._leases.pop(lease_id, None)

    def expired(self) -> list[Lease]:
        """Removes and returns every lease whose TTL has passed."""
        now = self._clock()
        out: list[Lease] = []
        while self._expiry and self._expiry[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiry)
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                out.append(lease)
        if not self._leases:
            self._expiry.clear()
        return out
