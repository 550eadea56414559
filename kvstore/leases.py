"""Leases: pins on blocks for a TTL, so they are not dropped between a lookup and a fetch.

Pure bookkeeping with an injected clock; the store pins and unpins. Expiry is lazy (the store
calls `expired()` on each operation) and periodic (the server's sweeper), so nothing stays
pinned once requests stop. Each lease names the caller that took it and the bytes it pins, and the
table keeps each caller's total, for the store's per-caller cap.
"""

from __future__ import annotations

import heapq
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from protos.block_hash import BlockHash

MAX_TTL_S = 60.0  # the default longest lease; a longer request is given this much


@dataclass(slots=True)
class Lease:
    lease_id: str
    entries: list[tuple[BlockHash, Any]]  # (key, the index entry that was pinned)
    expires_at: float
    caller: str | None = None  # who took it (None: an in-process caller, never capped)
    size: int = 0  # bytes it pins


class LeaseTable:
    def __init__(self, clock: Callable[[], float], max_leases: int = 100_000) -> None:
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._expiry: list[tuple[float, str]] = []  # heap; stale rows skipped
        self._pinned_by: dict[str, int] = {}  # caller -> bytes its leases pin
        self.max_leases = max_leases

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[Lease]:
        return iter(self._leases.values())

    def add(self, entries: list[tuple[BlockHash, Any]], ttl_s: float, caller: str | None = None, size: int = 0) -> Lease:
        lease = Lease(uuid.uuid4().hex, entries, self._clock() + ttl_s, caller, size)
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))
        if caller is not None:
            self._pinned_by[caller] = self._pinned_by.get(caller, 0) + size
        return lease

    def pop(self, lease_id: str) -> Lease | None:
        return self._ended(self._leases.pop(lease_id, None))

    def pinned_bytes(self, caller: str) -> int:
        """Bytes the caller's live leases pin (a block in two of its leases counts twice)."""
        return self._pinned_by.get(caller, 0)

    def pinned_by_caller(self) -> dict[str, int]:
        return dict(self._pinned_by)

    def _ended(self, lease: Lease | None) -> Lease | None:
        if lease is not None and lease.caller is not None:
            left = self._pinned_by[lease.caller] - lease.size
            if left:
                self._pinned_by[lease.caller] = left
            else:
                del self._pinned_by[lease.caller]
        return lease

    def expired(self) -> list[Lease]:
        """Removes and returns every lease whose TTL has passed."""
        now = self._clock()
        out: list[Lease] = []
        while self._expiry and self._expiry[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiry)
            lease = self._ended(self._leases.pop(lease_id, None))
            if lease is not None:
                out.append(lease)
        if not self._leases:
            self._expiry.clear()
        return out
