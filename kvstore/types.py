"""Names and results shared across the store, its server and its client (no grpc, no torch)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TypeAlias

Buffer: TypeAlias = bytes | bytearray | memoryview  # a payload, or a view of one
Payload: TypeAlias = Buffer | tuple[Buffer, ...]  # a payload in parts (e.g. a header and a tensor), stored as one


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


@dataclass(frozen=True, slots=True)
class StoreStats:
    tiers: list[TierStats] = field(default_factory=list)
    leases: int = 0
    pinned_blocks: int = 0
    checksum_failures: int = 0
    disk_write_failures: int = 0  # blocks the disk tier failed to write, and so does not hold
    removed_blocks: int = 0  # removed because a reader found them bad

    def tier(self, name: str) -> TierStats:
        return next(t for t in self.tiers if t.tier == name)
