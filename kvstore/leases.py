"""Leases: pins on blocks for a TTL, so they are not dropped between a lookup and a fetch.

`LeaseTable` is pure bookkeeping with an injected clock; `Leases` pins and unpins the blocks of the
store's placement as leases are taken and end, under the store's lock. Expiry is lazy (the store
calls `expire()` on each operation) and periodic (the server's sweeper), so nothing stays pinned once
requests stop. Each lease names the caller that took it and the bytes it pins, and the table keeps
each caller's total, for the store's per-caller cap.
"""

from __future__ import annotations

import heapq
import math
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvstore.errors import InvalidRequest, StoreFull, UnknownLease
from kvstore.placement import Entry, Placement, need
from protos.block_hash import BlockHash

MAX_TTL_S = 60.0  # the default longest lease; a longer request is given this much


RENEW_STEP_S = 1.0  # a renewal that moves a lease's end by less is left out

@dataclass(slots=True)
class Lease:
    lease_id: str
    entries: list[tuple[BlockHash, Entry]]  # (key, the index entry that was pinned)
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

    def add(self, entries: list[tuple[BlockHash, Entry]], ttl_s: float, caller: str | None = None, size: int = 0) -> Lease:
        lease = Lease(uuid.uuid4().hex, entries, self._clock() + ttl_s, caller, size)
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))
        if caller is not None:
            self._pinned_by[caller] = self._pinned_by.get(caller, 0) + size
        return lease

    def get(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def grow(self, lease: Lease, entries: list[tuple[BlockHash, Entry]], ttl_s: float, size: int) -> None:
        """Adds `entries` (`size` bytes) to a live lease, which then ends `ttl_s` from now if that is a second later
        or more."""
        lease.entries.extend(entries)
        lease.size += size
        if lease.caller is not None:
            self._pinned_by[lease.caller] = self._pinned_by.get(lease.caller, 0) + size
        expires_at = self._clock() + ttl_s
        if expires_at >= lease.expires_at + RENEW_STEP_S:  # a heap row per renewal: at most one a second
            lease.expires_at = expires_at
            heapq.heappush(self._expiry, (expires_at, lease.lease_id))

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
            lease = self._leases.get(lease_id)
            if lease is None or lease.expires_at > now:  # ended already, or renewed (a later row stands for it)
                continue
            del self._leases[lease_id]
            self._ended(lease)
            out.append(lease)
        if not self._leases:
            self._expiry.clear()
        return out


class Leases:
    """The store's leases on its placement's blocks: taking one pins its blocks out of eviction, and its release
    or expiry unpins them. Caps the leases held (StoreFull past it), each lease's TTL (a longer one is given
    `max_ttl_s`) and the bytes each caller's leases pin (`max_pinned_bytes_per_caller`; None: no cap)."""

    def __init__(self, placement: Placement, clock: Callable[[], float], *, max_ttl_s: float,
                 max_pinned_bytes_per_caller: int | None) -> None:
        self.table = LeaseTable(clock)
        self.placement = placement
        self.max_ttl_s = max_ttl_s
        self.max_pinned_bytes_per_caller = max_pinned_bytes_per_caller

    def __len__(self) -> int:
        return len(self.table)

    def ttl(self, requested: float | None) -> float | None:
        """The TTL a lease asked for gets (None or 0: no lease); InvalidRequest for a negative or NaN one."""
        if requested is not None and not (requested >= 0 and not math.isnan(requested)):
            raise InvalidRequest(f"lease_ttl_s must be 0 (no lease) or more, got {requested:g}")
        return min(requested, self.max_ttl_s) if requested else requested

    def take(self, hits: list[tuple[BlockHash, Entry]], ttl_s: float, caller: str | None) -> str:
        """Pins `hits` under a new lease of `caller`'s; returns its id."""
        if len(self.table) >= self.table.max_leases:
            raise StoreFull(f"too many leases held ({len(self.table)}); release some")
        size = sum(e.size for _, e in hits)
        self._check_cap(caller, size)
        for key, entry in hits:
            self.placement.pin(key, entry)
        return self.table.add(hits, ttl_s, caller, size).lease_id

    def extend(self, lease_id: str, hits: list[tuple[BlockHash, Entry]], ttl_s: float, caller: str | None = None
               ) -> bool:
        """Pins `hits` under the live lease `lease_id` too (counted against its caller's cap), renewed for `ttl_s`;
        False where it has ended or another caller took it. StoreFull past its caller's cap."""
        lease = self.table.get(lease_id)
        if lease is None or lease.caller != caller:
            return False
        size = sum(e.size for _, e in hits)
        self._check_cap(lease.caller, size)
        for key, entry in hits:
            self.placement.pin(key, entry)
        self.table.grow(lease, hits, ttl_s, size)
        return True

    def release(self, lease_id: str) -> None:
        lease = self.table.pop(lease_id)
        if lease is None:
            raise UnknownLease(f"no lease {lease_id!r} (never taken, released or expired)")
        self._unpin_all(lease.entries)

    def expire(self) -> None:
        for lease in self.table.expired():
            self._unpin_all(lease.entries)

    def pinned_by_caller(self) -> dict[str, int]:
        return self.table.pinned_by_caller()

    def check(self) -> None:
        """Raises IntegrityError unless each block's pin count and each caller's pinned bytes match the leases."""
        pins: dict[int, int] = {}
        by_caller: dict[str, int] = {}
        for lease in self.table:
            for _, entry in lease.entries:
                pins[id(entry)] = pins.get(id(entry), 0) + 1
            if lease.caller is not None:
                by_caller[lease.caller] = by_caller.get(lease.caller, 0) + lease.size
        for entry in self.placement.entries.values():
            need(entry.pins == pins.get(id(entry), 0), "pin count != leases holding the block")
        need(by_caller == self.table.pinned_by_caller(), "bytes pinned per caller != their leases")

    def _check_cap(self, caller: str | None, size: int) -> None:
        cap = self.max_pinned_bytes_per_caller
        if caller is None or cap is None:
            return
        held = self.table.pinned_bytes(caller)
        if held + size > cap:
            raise StoreFull(f"caller {caller} holds leases on {held} bytes; a lease on {size} more would pass its "
                            f"cap of {cap} bytes (--max-pinned-bytes-per-caller): release leases, or look up "
                            "without one")

    def _unpin_all(self, entries: list[tuple[BlockHash, Entry]]) -> None:
        for key, entry in reversed(entries):  # tail first: parents end up more recent
            self.placement.unpin(key, entry)
