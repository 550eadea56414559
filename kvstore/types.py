"""Names and results shared across the store, its server and its client (no grpc, no torch)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

Buffer: TypeAlias = bytes | bytearray | memoryview  # a payload, or a view of one
Payload: TypeAlias = Buffer | tuple[Buffer, ...]  # a payload in parts (e.g. a header and a tensor), stored as one


class Sink(Protocol):
    """A destination of a read that copies the bytes in itself: a KV cache slot that checks the values on their
    way in (engine's handoff.transfer), while they pass through the cache anyway."""

    def __len__(self) -> int: ...

    def fill(self, src: memoryview) -> memoryview:
        """Copies ``src`` (at most len(self) bytes) into its first bytes; returns them as written."""


Part: TypeAlias = memoryview | Sink  # where a read puts one part of a block (its header, its tensor)


def fill(part: Part, src: memoryview) -> memoryview:
    """Copies ``src`` into the first bytes of ``part``; returns them as written."""
    if isinstance(part, memoryview):
        dest = part[: len(src)]
        dest[:] = src
        return dest
    return part.fill(src)


class Tier(enum.IntEnum):
    """Storage tiers, top to bottom; values match kvserve.v1.Tier."""

    DEVICE = 1
    HOST = 2
    DISK = 3

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class LookupResult:
    num_hits: int  # leading hashes present
    tiers: list[str]  # one tier name per hit: "device" | "host" | "disk"
    lease_id: str | None  # None when no lease was taken
    lease_ttl_s: float | None = None  # the TTL the lease got (the store clamps long ones)


@dataclass(frozen=True, slots=True)
class PutResult:
    num_new: int  # blocks the put stored (the others were stored already)
    lease_id: str | None = None  # a lease on every block of the put; None when none was asked for or taken
    lease_ttl_s: float | None = None  # the TTL the lease got


@dataclass(frozen=True, slots=True)
class TierStats:
    tier: str
    blocks: int
    bytes: int
    capacity_bytes: int
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    available: bool = True  # False: the tier failed at runtime (disk full, read-only, damaged) and takes no blocks


LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True, slots=True)
class Latency:
    """Calls and the seconds they took; `buckets`: how many took at most each of LATENCY_BUCKETS_S (not
    cumulative), then how many took longer."""

    calls: int = 0
    seconds: float = 0.0
    buckets: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class RemoteStats:
    """The remote tier's figures. Hits and misses count blocks asked for after a local miss; an error
    (a failed or timed-out call) is also a miss, or lost writes."""

    url: str  # without password
    breaker: str  # "closed" | "open" (calls skipped) | "half_open" (one probe let through)
    hits: int = 0
    misses: int = 0
    read_errors: int = 0
    write_errors: int = 0
    checksum_failures: int = 0  # damaged values
    mac_failures: int = 0  # values not written under their key by this deployment (moved, forged, another record key)
    read_bytes: int = 0
    written_blocks: int = 0
    written_bytes: int = 0
    dropped_writes: int = 0  # blocks never written: the queue was full, the write failed, or the block was gone
    queued_blocks: int = 0
    queued_bytes: int = 0
    read_latency: Latency = field(default_factory=Latency)
    write_latency: Latency = field(default_factory=Latency)


@dataclass(frozen=True, slots=True)
class StoreStats:
    tiers: list[TierStats] = field(default_factory=list)
    leases: int = 0
    pinned_blocks: int = 0
    checksum_failures: int = 0  # damaged blocks
    disk_write_failures: int = 0  # blocks the disk tier failed to write, and so does not hold
    removed_blocks: int = 0  # removed because a reader found them bad
    remote: RemoteStats | None = None  # None: no remote tier
    # disk records not written under their key by this deployment (moved, forged, another record key): misses
    mac_failures: int = 0

    def tier(self, name: str) -> TierStats:
        return next(t for t in self.tiers if t.tier == name)
