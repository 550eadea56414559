"""Where each block lies: one index over every tier, placement, demotion, promotion and eviction order.

Blocks are exclusive to one tier. A new block goes to the highest tier that can make room; making room
demotes that tier's eviction victims to the next tier, and the last tier drops them. A pinned block is
out of its tier's eviction order, so it is never a victim. Each tier keeps its bytes used, bytes pinned
and block count, which `check` proves against the index. Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.block_format import CorruptBlock, checksum
from kvstore.errors import InvalidRequest, StoreFull
from kvstore.events import EventHub, StoreEvent
from kvstore.eviction import EvictionPolicy
from kvstore.store_stats import StoreCounters
from kvstore.tier import TierStorage
from kvstore.types import Buffer, Tier, TierStats
from protos.block_hash import HASH_BYTES, BlockHash

if TYPE_CHECKING:
    from kvstore.disk_tier import DiskTier


@dataclass(slots=True)
class Entry:
    size: int
    checksum: int  # the store's xxh3 of the payload; 0 until known (a block a client put into a device slot)
    ephemeral: bool
    level: int  # index of its tier in Placement.tiers
    pins: int = 0


@dataclass(slots=True)
class TierSlot:
    """A tier's storage with its capacity, eviction order and occupancy."""

    storage: TierStorage
    capacity: int
    policy: EvictionPolicy
    used: int = 0
    pinned: int = 0  # bytes of pinned blocks (not in policy)
    blocks: int = 0

    @property
    def tier(self) -> Tier:
        return self.storage.tier


Write = Callable[[TierSlot, int], None]  # writes one block into a tier slot, given its write sequence


class IntegrityError(AssertionError):
    pass


def check_key(key: BlockHash) -> None:
    if len(key) != HASH_BYTES:
        raise InvalidRequest(f"block hash must be {HASH_BYTES} bytes, got {len(key)}")


def need(ok: bool, what: str) -> None:
    if not ok:
        raise IntegrityError(what)


def writer(key: BlockHash, payload: Buffer, csum: int, ephemeral: bool) -> Write:
    """Writes a block into the tier chosen under the lock."""

    def write(slot: TierSlot, seq: int) -> None:
        slot.storage.write(key, payload, csum, ephemeral=ephemeral, seq=seq)

    return write


def known_checksum(entry: Entry, payload: Buffer) -> int:
    """The entry's checksum; taken now from its payload where it was not known (a block a client put into a
    device arena slot, whose own checksum is of another kind)."""
    if not entry.checksum:
        entry.checksum = checksum(payload)
    return entry.checksum


class Placement:
    """The index of blocks over the tiers, top to bottom, and each tier's occupancy and eviction order."""

    def __init__(self, tiers: Sequence[tuple[TierStorage, int]], counters: StoreCounters, events: EventHub) -> None:
        self.tiers = [TierSlot(storage, cap, EvictionPolicy()) for storage, cap in tiers]
        self.entries: dict[BlockHash, Entry] = {}
        self.counters = counters
        self.events = events
        self._seq = 0  # write sequence: the disk tier's records replay in this order at start

    def level_of(self, storage: TierStorage) -> int:
        return next(lv for lv, slot in enumerate(self.tiers) if slot.storage is storage)

    def tier_of(self, key: BlockHash) -> Tier | None:
        entry = self.entries.get(key)
        return None if entry is None else self.tiers[entry.level].tier

    def eviction_order(self, tier: Tier) -> list[BlockHash]:
        """Unpinned blocks of a tier, next victim first."""
        return next(s for s in self.tiers if s.tier == tier).policy.order()

    def occupancy(self) -> list[TierStats]:
        """Each tier's blocks, bytes, capacity and availability (no counters)."""
        return [TierStats(s.tier.label, s.blocks, s.used, s.capacity, available=s.storage.failure is None)
                for s in self.tiers]

    def pinned_blocks(self) -> int:
        return sum(1 for e in self.entries.values() if e.pins > 0)

    def insert(self, key: BlockHash, size: int, csum: int, ephemeral: bool, write: Write, have_slot: bool) -> None:
        """Places a new block in the highest tier that can make room (StoreFull where none can). `have_slot`: the
        block's storage is already taken (a reserved arena slot)."""
        level = next((lv for lv in range(len(self.tiers)) if self.make_room(lv, size, have_slot)), None)
        if level is None:
            failed = [f"{s.tier.label}: {s.storage.failure}" for s in self.tiers if s.storage.failure is not None]
            why = f"; unavailable tiers: {', '.join(failed)}" if failed else ""
            raise StoreFull(f"no tier can take a block of {size} bytes: every tier is full of pinned blocks{why}")
        slot = self.tiers[level]
        self._seq += 1
        write(slot, self._seq)
        entry = Entry(size, csum, ephemeral, level)
        self.entries[key] = entry
        self._account(slot, key, entry, +1)
        self.events.publish(StoreEvent(True, key, slot.tier))

    def make_room(self, level: int, size: int, have_slot: bool = False) -> bool:
        """Frees `size` bytes in tier `level` (and a slot, unless the block `have_slot` already) by
        demoting its victims; False if it cannot."""
        slot = self.tiers[level]
        if size > slot.capacity - slot.pinned or slot.storage.failure is not None:
            return False
        while slot.capacity - slot.used < size:
            victim = slot.policy.victim()
            if victim is None:  # unreachable while the accounting holds
                raise IntegrityError(f"tier {slot.tier.label}: no victim but {slot.used} bytes used")
            self._demote(victim, level)
        while not have_slot and not slot.storage.has_room(size):
            victim = slot.policy.victim()
            if victim is None:  # the rest is pinned or reserved
                return False
            self._demote(victim, level)
        return True

    def promote(self, key: BlockHash, entry: Entry, payload: Buffer) -> bool:
        """Moves a block just read from a lower tier to the highest one above it that can make room; False
        where it stays (gone, moved meanwhile, or no room above)."""
        if self.entries.get(key) is not entry or entry.level == 0:
            return False  # gone, or moved by a concurrent reader: blocks are immutable, nothing lost
        src = entry.level
        self.pin(key, entry)  # so making room above cannot demote it out from under us
        try:
            target = next((lv for lv in range(src) if self.make_room(lv, entry.size)), None)
        finally:
            self.unpin(key, entry)
        if target is None:
            return False
        self._move(key, entry, target, writer(key, payload, entry.checksum, entry.ephemeral))
        self.counters.tiers[src].promotions += 1
        return True

    def move_down(self, dst: int, deadline: float) -> tuple[int, int]:
        """Moves every block above tier `dst` into it, least recent first and pinned ones last, until `deadline`
        (time.monotonic); returns (moved, left). A corrupt block (counted) is dropped."""
        moved = left = 0
        for level in range(dst):
            slot = self.tiers[level]
            pinned = [k for k, e in self.entries.items() if e.level == level and e.pins > 0]
            for key in [*slot.policy.order(), *pinned]:
                entry = self.entries[key]
                if time.monotonic() > deadline or not self.make_room(dst, entry.size):
                    left += 1
                    continue
                payload = self.read_locked(slot, key)
                if payload is None:  # corrupt (counted): not worth keeping either
                    self.remove(key, entry)
                    continue
                csum = known_checksum(entry, payload)
                self._move(key, entry, dst, writer(key, payload, csum, entry.ephemeral))
                moved += 1
        return moved, left

    def remove(self, key: BlockHash, entry: Entry) -> None:
        slot = self.tiers[entry.level]
        slot.storage.delete(key)
        self._account(slot, key, entry, -1)
        del self.entries[key]
        self.events.publish(StoreEvent(False, key, slot.tier))

    def forget(self, keys: Collection[BlockHash] | None, level: int) -> int:
        """Drops those of `keys` that tier `level` holds (None: all it holds); returns how many."""
        if keys is None:
            keys = [k for k, e in self.entries.items() if e.level == level]
        lost = [(k, e) for k in keys if (e := self.entries.get(k)) is not None and e.level == level]
        for key, entry in lost:
            self.remove(key, entry)
        return len(lost)

    def touch(self, keys: Sequence[BlockHash]) -> None:
        """Marks a chain of blocks used. Tail first, so each parent ends up more recent than its children."""
        for key in reversed(keys):
            entry = self.entries.get(key)
            if entry is not None and entry.pins == 0:
                self.tiers[entry.level].policy.touch(key)

    def pin(self, key: BlockHash, entry: Entry) -> None:
        """Takes the block out of its tier's eviction order (counted: pins nest)."""
        entry.pins += 1
        if entry.pins == 1:
            slot = self.tiers[entry.level]
            slot.policy.remove(key)
            slot.pinned += entry.size

    def unpin(self, key: BlockHash, entry: Entry) -> None:
        entry.pins -= 1
        if entry.pins == 0 and self.entries.get(key) is entry:
            slot = self.tiers[entry.level]
            slot.pinned -= entry.size
            slot.policy.add(key, ephemeral=entry.ephemeral)

    def read_locked(self, slot: TierSlot, key: BlockHash) -> Buffer | None:
        """A block's payload, read under the lock (to demote or flush it): a corrupt block is counted, then None."""
        try:
            return slot.storage.read(key)
        except CorruptBlock as exc:
            self.counters.bad(exc)
            return None

    def rebuild(self, disk: DiskTier) -> None:
        """Indexes what the disk tier (the last) holds from an earlier run, in write order; past its capacity (it
        shrank since) the least recent blocks are dropped."""
        level = len(self.tiers) - 1
        records = sorted(disk.scan(), key=lambda kh: kh[1].seq)
        self.counters.mac_failures += disk.foreign_records
        slot = self.tiers[level]
        for key, header in records:
            entry = Entry(header.size, header.checksum, header.ephemeral, level)
            self.entries[key] = entry
            self._account(slot, key, entry, +1)
            self._seq = max(self._seq, header.seq)
        while slot.used > slot.capacity:
            victim = slot.policy.victim()
            assert victim is not None
            self.remove(victim, self.entries[victim])
            self.counters.tiers[level].evictions += 1

    def check(self) -> None:
        """Raises IntegrityError unless bytes per tier <= capacity and index, tiers and eviction order agree."""
        for level, slot in enumerate(self.tiers):
            entries = {k: e for k, e in self.entries.items() if e.level == level}
            label = slot.tier.label
            need(slot.used == sum(e.size for e in entries.values()), f"{label}: used bytes != sum of block sizes")
            need(slot.used <= slot.capacity, f"{label}: {slot.used} bytes used > capacity {slot.capacity}")
            need(slot.blocks == len(entries), f"{label}: block count off")
            need(slot.pinned == sum(e.size for e in entries.values() if e.pins), f"{label}: pinned bytes off")
            unpinned = {k for k, e in entries.items() if e.pins == 0}
            need(set(slot.policy.order()) == unpinned and len(slot.policy) == len(unpinned),
                 f"{label}: LRU != unpinned blocks")
            need(slot.storage.keys() == set(entries), f"{label}: storage keys != index keys")

    def _demote(self, key: BlockHash, level: int) -> None:
        entry = self.entries[key]
        slot = self.tiers[level]
        below = level + 1
        if below < len(self.tiers) and self.make_room(below, entry.size):
            payload = self.read_locked(slot, key)
            if payload is not None:
                csum = known_checksum(entry, payload)
                self._move(key, entry, below, writer(key, payload, csum, entry.ephemeral))
                self.counters.tiers[level].demotions += 1
                return
        self.remove(key, entry)
        self.counters.tiers[level].evictions += 1

    def _move(self, key: BlockHash, entry: Entry, dst: int, write: Write) -> None:
        src_slot, dst_slot = self.tiers[entry.level], self.tiers[dst]
        self._seq += 1
        write(dst_slot, self._seq)
        src_slot.storage.delete(key)
        self._account(src_slot, key, entry, -1)
        entry.level = dst
        self._account(dst_slot, key, entry, +1)

    @staticmethod
    def _account(slot: TierSlot, key: BlockHash, entry: Entry, sign: int) -> None:
        slot.used += sign * entry.size
        slot.blocks += sign
        if entry.pins > 0:
            slot.pinned += sign * entry.size
        elif sign > 0:
            slot.policy.add(key, ephemeral=entry.ephemeral)
        else:
            slot.policy.remove(key)
