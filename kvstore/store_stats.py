"""A store's counters of block accesses and failures, and the StoreStats they add up to.

Hits and misses count block accesses by Lookup and by Get alike: a hit in tier T is a miss in every tier
above it, and a block found nowhere is a miss in every tier. Demotions and promotions count on the tier
the block leaves; evictions on the tier that drops it. Plain counters: the store's lock guards them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvstore.block_format import CorruptBlock, ForeignRecord
from kvstore.types import StoreStats, TierStats


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0


class StoreCounters:
    """One TierCounters per tier, top to bottom, and the store-wide failure counts."""

    def __init__(self, num_tiers: int) -> None:
        self.tiers = [TierCounters() for _ in range(num_tiers)]
        self.checksum_failures = 0  # damaged blocks found in a local tier
        self.mac_failures = 0  # disk records not this deployment's under their key (ForeignRecord), at start or read
        self.removed_blocks = 0  # removed at a reader's request (Remove)

    def hit(self, level: int, *, remote: bool = False) -> None:
        """A block found in tier `level`; `remote`: just promoted from the remote tier, a miss in every local one."""
        if remote:
            self.miss()
            return
        for counters in self.tiers[:level]:
            counters.misses += 1
        self.tiers[level].hits += 1

    def miss(self) -> None:
        for counters in self.tiers:
            counters.misses += 1

    def bad(self, exc: CorruptBlock) -> None:
        """A damaged block, or a record that is not this deployment's under its key."""
        if isinstance(exc, ForeignRecord):
            self.mac_failures += 1
        else:
            self.checksum_failures += 1

    def stats(self, occupancy: Sequence[TierStats], *, leases: int, pinned_blocks: int,
              disk_write_failures: int) -> StoreStats:
        """`occupancy`: each tier's blocks, bytes, capacity and availability, top to bottom; the counters fill in
        the rest."""
        tiers = [replace(t, hits=c.hits, misses=c.misses, evictions=c.evictions, demotions=c.demotions,
                         promotions=c.promotions) for t, c in zip(occupancy, self.tiers, strict=True)]
        return StoreStats(tiers, leases, pinned_blocks, self.checksum_failures, disk_write_failures,
                          self.removed_blocks, mac_failures=self.mac_failures)
