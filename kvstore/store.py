"""The tier manager: one index over every tier, placement, demotion, promotion, leases.

Blocks are exclusive to one tier. Writes land in the highest tier that can make room; making
room demotes that tier's eviction victims to the next tier, and the last tier drops them.
A hit in a lower tier is promoted on read. One lock guards the index and bookkeeping; it is
never held across network I/O, disk commits (the disk tier writes behind) or payload reads
from disk or shared memory (those retry if the block moved meanwhile).

Hits and misses count block accesses by Lookup and by Get alike: a hit in tier T is a miss in
every tier above it, and a block found nowhere is a miss in every tier. Demotions and
promotions count on the tier the block leaves; evictions on the tier that drops it.

Limits per caller: a block above `max_block_bytes` is refused, a lease longer than
`max_lease_ttl_s` gets that much, and one caller's leases pin at most `max_pinned_bytes_per_caller`
(callers are named by the server; in-process calls name none and are not capped). A tier that fails
at runtime (a disk that fills up, turns read-only or is damaged) takes no more blocks; the blocks it
could not write are forgotten, so stats never count what is not held.

A remote tier (Redis or Valkey, shared by every node) sits under the local tiers, outside the index:
each block stored here (but ephemeral ones) is written behind to it, and on a local miss Lookup and Get
ask it for the blocks they lack, without the lock, and promote its hits into the local tiers. Such a
hit counts as a miss in every local tier and as a hit of the remote (kvstore/remote_tier.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

from kvstore.block_format import CorruptBlock, ForeignRecord, checksum
from kvstore.disk_tier import DiskTier
from kvstore.errors import BlockTooLarge, InvalidRequest, StoreFull, UnknownLease
from kvstore.events import EventHub, StoreEvent
from kvstore.eviction import EvictionPolicy
from kvstore.leases import MAX_TTL_S, LeaseTable
from kvstore.tier import ArenaTier, TierStorage
from kvstore.types import Buffer, LookupResult, StoreStats, Tier, TierStats
from protos.block_hash import HASH_BYTES, BlockHash

if TYPE_CHECKING:
    from kvstore.remote_tier import RemoteTier

log = logging.getLogger(__name__)

_READ_RETRIES = 4
_NO_ARENA = "this server has no arena for same-host clients: send block data"
MAX_RESERVATION_BLOCKS = 4096
RESERVATION_TTL_S = 30.0  # a client that reserved slots and never put: they return after this


@dataclass(slots=True)
class Entry:
    size: int
    checksum: int
    ephemeral: bool
    level: int  # index of its tier in BlockStore.tiers
    pins: int = 0


@dataclass(slots=True)
class TierSlot:
    """A tier's storage with its capacity, eviction order and counters."""

    storage: TierStorage
    capacity: int
    policy: EvictionPolicy
    used: int = 0
    pinned: int = 0  # bytes of pinned blocks (not in policy)
    blocks: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0

    @property
    def tier(self) -> Tier:
        return self.storage.tier


class BlockRead(NamedTuple):
    payload: Buffer | None  # None when served by shm_offset
    shm_offset: int | None  # same-host path: the block's slot in the shared-memory arena
    size: int
    checksum: int
    tier: Tier


class FlushResult(NamedTuple):
    moved: int  # blocks moved from memory tiers to disk
    left: int  # blocks still only in memory (deadline passed or disk too small)
    durable: bool  # disk writes all committed


@dataclass(slots=True)
class Reservation:
    slots: dict[int, int]  # arena offset -> slot size, not yet put
    expires: float


Write = Callable[[TierSlot, int], None]  # writes one block into a tier slot, given its write sequence


class IntegrityError(AssertionError):
    pass


def check_key(key: BlockHash) -> None:
    if len(key) != HASH_BYTES:
        raise InvalidRequest(f"block hash must be {HASH_BYTES} bytes, got {len(key)}")


class BlockStore:
    """Tiers from top to bottom, each a (storage, capacity_bytes) pair."""

    def __init__(
        self,
        tiers: Sequence[tuple[TierStorage, int]],
        *,
        clock: Callable[[], float] = time.monotonic,
        events: EventHub | None = None,
        max_block_bytes: int | None = None,
        max_lease_ttl_s: float = MAX_TTL_S,
        max_pinned_bytes_per_caller: int | None = None,
        remote: RemoteTier | None = None,
    ) -> None:
        """`max_block_bytes`: None, the largest tier's capacity. `max_pinned_bytes_per_caller`: None, no cap.
        `remote`: a shared tier under the local ones, started here and closed by `close`."""
        if not tiers:
            raise ValueError("a store needs at least one tier")
        if max_lease_ttl_s <= 0 or (max_block_bytes is not None and max_block_bytes <= 0):
            raise ValueError("the longest lease and the largest block must be > 0")
        self.tiers = [TierSlot(storage, cap, EvictionPolicy()) for storage, cap in tiers]
        # the arena same-host clients open: the device tier's, else the host tier's shared memory
        self.shm_tier = next((s.storage for s in self.tiers if isinstance(s.storage, ArenaTier)), None)
        self.events = events or EventHub()
        self.checksum_failures = 0  # damaged blocks found in a local tier
        self.mac_failures = 0  # disk records not this deployment's under their key (ForeignRecord), at start or read
        self.removed_blocks = 0  # removed at a reader's request (Remove)
        self._max_block_bytes = max_block_bytes
        self.max_lease_ttl_s = max_lease_ttl_s
        self.max_pinned_bytes_per_caller = max_pinned_bytes_per_caller
        self._index: dict[BlockHash, Entry] = {}
        self._leases = LeaseTable(clock)
        self._lock = threading.Lock()
        self._clock = clock
        self._reservations: dict[str, Reservation] = {}
        self._seq = 0
        self._disk = next((s.storage for s in self.tiers if isinstance(s.storage, DiskTier)), None)
        if self._disk is not None:
            self._rebuild_from_disk(len(self.tiers) - 1)
            self._disk.on_lost = self._forget_lost
        self.remote = remote
        if remote is not None:
            remote.start(self._peek)

    @property
    def max_block_bytes(self) -> int:
        largest = max(slot.capacity for slot in self.tiers)
        return largest if self._max_block_bytes is None else min(largest, self._max_block_bytes)

    @property
    def block_limit(self) -> str:
        """What bounds a block's size, for messages."""
        largest = max(slot.capacity for slot in self.tiers)
        if self._max_block_bytes is None or largest <= self._max_block_bytes:
            return f"the largest tier ({largest} bytes)"
        return f"the store's --max-block-bytes ({self._max_block_bytes} bytes)"

    # -- public operations ---------------------------------------------------------------------

    def put(self, key: BlockHash, payload: Buffer, checksum_: int | None = None, *, ephemeral: bool = False) -> bool:
        """Stores a block; False when the hash is already there, whatever the payload (blocks are
        immutable: the first write wins and puts are idempotent)."""
        check_key(key)
        if not payload:
            raise InvalidRequest("empty block payload")
        actual = checksum(payload)
        if checksum_ is not None and checksum_ != actual:
            raise InvalidRequest(f"checksum mismatch for block {key.hex()[:16]}: nothing stored")
        self._check_size(len(payload))
        return self._insert(key, len(payload), actual, ephemeral, self._writer(key, payload, actual, ephemeral))

    def reserve(self, sizes: Sequence[int], keys: Sequence[BlockHash] = ()) -> tuple[str, list[int | None]]:
        """Arena slots for a same-host client to fill and then name in `put_reserved`: (reservation
        id, one offset per size). Room is made by demoting, as for a put. With `keys` (one per size),
        a block already stored gets None instead of a slot, and is touched as a put would."""
        shm = self.shm_tier
        if shm is None:
            raise InvalidRequest(_NO_ARENA)
        if not 0 < len(sizes) <= MAX_RESERVATION_BLOCKS:
            raise InvalidRequest(f"reserve 1 to {MAX_RESERVATION_BLOCKS} slots at a time, not {len(sizes)}")
        if keys and len(keys) != len(sizes):
            raise InvalidRequest(f"{len(keys)} hashes for {len(sizes)} sizes: give one per size, or none")
        for key in keys:
            check_key(key)
        for size in sizes:
            if size <= 0:
                raise InvalidRequest("empty block payload")
            self._check_size(size)
        level = next(lv for lv, slot in enumerate(self.tiers) if slot.storage is shm)
        offsets: list[int | None] = []
        slots: dict[int, int] = {}
        with self._lock:
            self._expire_leases()
            stored = [key in self._index for key in keys] if keys else [False] * len(sizes)
            self._touch_chain([key for key in keys if key in self._index])
            wanted = sum(size for size, s in zip(sizes, stored, strict=True) if not s)
            if wanted + self._reserved_bytes() > self.tiers[level].capacity // 2:
                raise StoreFull(f"reservations would hold more than half the {shm.tier.label} tier: put in smaller "
                                "batches")
            for size, is_stored in zip(sizes, stored, strict=True):
                if is_stored:
                    offsets.append(None)
                    continue
                offset = shm.reserve(size) if self._make_room(level, size) else None
                if offset is None:
                    for o in slots:
                        shm.release(o)
                    raise StoreFull(f"no arena slot for a block of {size} bytes")
                slots[offset] = size
                offsets.append(offset)
            if not slots:
                return "", offsets
            rid = uuid.uuid4().hex
            self._reservations[rid] = Reservation(slots, self._clock() + RESERVATION_TTL_S)
        return rid, offsets

    def put_reserved(self, key: BlockHash, reservation_id: str, offset: int, size: int, checksum_: int = 0, *,
                     ephemeral: bool = False) -> bool:
        """Stores the block a same-host client wrote into a reserved slot; the slot becomes the block
        (no copy). The client's checksum (of the arena's kind) is taken as is (computed here when 0): every
        reader verifies it, so bytes that do not match it, now or later, are a miss, never data."""
        check_key(key)
        shm = self.shm_tier
        if shm is None:
            raise InvalidRequest(_NO_ARENA)
        with self._lock:
            reservation = self._reservations.get(reservation_id)
            reserved = None if reservation is None else reservation.slots.get(offset)
            if reservation is None or reserved is None or not 0 < size <= reserved:
                raise InvalidRequest(f"no reserved slot at {offset} for {size} bytes under reservation {reservation_id!r}")
            del reservation.slots[offset]
        try:
            with self._lock:
                csum = checksum_ or shm.slot_checksum(offset, size)
            # The entry's checksum is the store's xxh3 of the payload: a device slot's is of another kind, so
            # it stays unknown (0) until the block's bytes first leave the arena (`_known_checksum`).
            write = self._reserved_writer(key, shm, offset, size, csum, ephemeral)
            return self._insert(key, size, csum if shm.xxh3_slots else 0, ephemeral, write, reserved=offset)
        except BaseException:  # raised before anything took the slot (a device copy too): it goes back
            with self._lock:
                shm.release(offset)
            raise

    def end_reservation(self, reservation_id: str) -> None:
        """Returns the slots of a reservation that were not put."""
        with self._lock:
            reservation = self._reservations.pop(reservation_id, None)
            if reservation is not None:
                self._release_slots(reservation)

    def lookup(self, keys: Sequence[BlockHash], lease_ttl_s: float | None = None, *,
               caller: str | None = None) -> LookupResult:
        """How many leading keys are present and where; with a TTL, pins them under a lease of at most
        `max_lease_ttl_s`, counted against `caller`'s cap (StoreFull past it)."""
        for key in keys:
            check_key(key)
        if lease_ttl_s is not None and not (lease_ttl_s >= 0 and not math.isnan(lease_ttl_s)):
            raise InvalidRequest(f"lease_ttl_s must be 0 (no lease) or more, got {lease_ttl_s:g}")
        if lease_ttl_s:
            lease_ttl_s = min(lease_ttl_s, self.max_lease_ttl_s)
        fetched = self._fetch_remote(keys, prefix=True)
        with self._lock:
            self._expire_leases()
            hits: list[tuple[BlockHash, Entry]] = []
            for key in keys:
                entry = self._index.get(key)
                if entry is None:
                    self._count_miss()
                    break
                self._count_hit(entry.level, remote=key in fetched)
                hits.append((key, entry))
            self._touch_chain([k for k, _ in hits])
            lease_id = None
            if lease_ttl_s and hits:
                if len(self._leases) >= self._leases.max_leases:
                    raise StoreFull(f"too many leases held ({len(self._leases)}); release some")
                size = sum(e.size for _, e in hits)
                self._check_pin_cap(caller, size)
                for key, entry in hits:
                    self._pin(key, entry)
                lease_id = self._leases.add(hits, lease_ttl_s, caller, size).lease_id
            tiers = [self.tiers[e.level].tier.label for _, e in hits]
        return LookupResult(len(hits), tiers, lease_id, lease_ttl_s if lease_id else None)

    def remove(self, keys: Sequence[BlockHash]) -> int:
        """Drops blocks from whichever tier holds them, announced on Events (a reader found them bad: a
        later put of the same hash is stored again); returns how many were stored. A lease that pinned
        one keeps nothing of it."""
        for key in keys:
            check_key(key)
        removed = 0
        with self._lock:
            for key in keys:
                entry = self._index.get(key)
                if entry is not None:
                    self._remove(key, entry)
                    removed += 1
            self.removed_blocks += removed
        return removed

    def get(self, keys: Sequence[BlockHash], *, via_shm: bool = False) -> Iterator[BlockRead | None]:
        """Reads blocks one by one (lazily), after touching them as a chain (and fetching those missing here
        from the remote tier)."""
        for key in keys:
            check_key(key)
        fetched = self._fetch_remote(keys, prefix=False)
        with self._lock:
            self._expire_leases()
            self._touch_chain(keys)
        for key in keys:
            yield self._read(key, via_shm=via_shm, fetched=key in fetched)

    def locate(self, keys: Sequence[BlockHash]) -> list[tuple[int, int, int] | None]:
        """Where each block lies in the arena, for a same-host client to copy it: (offset, size, checksum),
        or None where it is not in the arena (absent, or in another tier: `get` reads those). Touches
        the chain; counts the arena's hits (`get` counts the rest)."""
        for key in keys:
            check_key(key)
        shm = self.shm_tier
        out: list[tuple[int, int, int] | None] = []
        with self._lock:
            self._expire_leases()
            self._touch_chain(keys)
            for key in keys:
                entry = self._index.get(key)
                found = shm.slot(key) if shm is not None and entry is not None else None
                if entry is None or found is None:
                    out.append(None)
                    continue
                self._count_hit(entry.level)
                out.append((found[0], entry.size, found[2]))
        return out

    def _read(self, key: BlockHash, *, via_shm: bool = False, fetched: bool = False) -> BlockRead | None:
        """One block, or None for a miss (a corrupt block is deleted and counted, then a miss)."""
        for _ in range(_READ_RETRIES):
            with self._lock:
                entry = self._index.get(key)
                if entry is None:
                    self._count_miss()
                    return None
                level = entry.level
                slot = self.tiers[level]
                shm = self.shm_tier
                if via_shm and shm is not None and slot.storage is shm:
                    found = shm.slot(key)
                    if found is not None:
                        self._count_hit(level, remote=fetched)
                        return BlockRead(None, found[0], entry.size, found[2], slot.tier)
            try:
                payload = slot.storage.read(key)
            except CorruptBlock as exc:
                self._drop_corrupt(key, entry, exc)
                return None
            if payload is None:
                self._drop_if_lost(key, entry, level)
                continue
            with self._lock:
                if self._index.get(key) is not entry:
                    continue  # dropped and stored again meanwhile: read the block now there
                self._count_hit(level, remote=fetched)
            csum = self._known_checksum(entry, payload)
            if level > 0:
                try:
                    self._promote(key, entry, payload)
                except Exception:  # optional work (a device tier out of memory): the block is read all the same
                    log.warning("promoting block %s failed", key.hex()[:16], exc_info=True)
            return BlockRead(payload, None, entry.size, csum, slot.tier)
        with self._lock:
            self._count_miss()
        return None

    def _fetch_remote(self, keys: Sequence[BlockHash], *, prefix: bool) -> set[BlockHash]:
        """Asks the remote tier for the blocks missing here (for a prefix, those after the leading local
        hits, until its first gap) and places its hits in the local tiers; returns their keys. Never
        under the lock."""
        if self.remote is None:
            return set()
        with self._lock:
            if prefix:
                first = next((i for i, key in enumerate(keys) if key not in self._index), len(keys))
                missing = list(keys[first:])
            else:
                missing = [key for key in dict.fromkeys(keys) if key not in self._index]
        if not missing:
            return set()
        found = self.remote.get_prefix(missing) if prefix else self.remote.get(missing)
        fetched: set[BlockHash] = set()
        for key, block in zip(missing, found, strict=False):
            if block is None:
                continue
            payload, csum = block
            try:
                self._check_size(len(payload))
                if self._insert(key, len(payload), csum, False, self._writer(key, payload, csum, False), share=False):
                    fetched.add(key)
            except (BlockTooLarge, StoreFull):
                if prefix:
                    break
        return fetched

    def _peek(self, key: BlockHash) -> tuple[Buffer, int] | None:
        """A block's payload and checksum, without counting or promoting it (for the remote tier's writer)."""
        for _ in range(_READ_RETRIES):
            with self._lock:
                entry = self._index.get(key)
                if entry is None:
                    return None
                slot = self.tiers[entry.level]
            try:
                payload = slot.storage.read(key)
            except CorruptBlock:
                return None  # its next reader drops it
            if payload is not None:
                return payload, self._known_checksum(entry, payload)
        return None

    def touch(self, keys: Sequence[BlockHash]) -> None:
        """Marks a chain of blocks (prefix order) used, tail first: parents end up more recent."""
        with self._lock:
            self._touch_chain(keys)

    def release(self, lease_id: str) -> None:
        with self._lock:
            lease = self._leases.pop(lease_id)
            if lease is None:
                raise UnknownLease(f"no lease {lease_id!r} (never taken, released or expired)")
            self._unpin_all(lease.entries)

    def sweep(self) -> None:
        """Expires leases whose TTL has passed (the server calls this periodically)."""
        with self._lock:
            self._expire_leases()

    def stats(self) -> StoreStats:
        with self._lock:
            self._expire_leases()
            tiers = [
                TierStats(s.tier.label, s.blocks, s.used, s.capacity, s.hits, s.misses, s.evictions, s.demotions, s.promotions,
                          available=s.storage.failure is None)
                for s in self.tiers
            ]
            pinned = sum(1 for e in self._index.values() if e.pins > 0)
            failed_writes = self._disk.failed_writes if self._disk is not None else 0
            stats = StoreStats(tiers, len(self._leases), pinned, self.checksum_failures, failed_writes,
                               self.removed_blocks, mac_failures=self.mac_failures)
        return stats if self.remote is None else replace(stats, remote=self.remote.stats())

    def tier_of(self, key: BlockHash) -> Tier | None:
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None else self.tiers[entry.level].tier

    def eviction_order(self, tier: Tier) -> list[BlockHash]:
        """Unpinned blocks of a tier, next victim first."""
        with self._lock:
            return next(s for s in self.tiers if s.tier == tier).policy.order()

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def flush_to_disk(self, timeout_s: float = 10.0) -> FlushResult:
        """Moves every memory-tier block to disk (LRU first, so the newest survive a small disk)
        and waits for the disk writes, all within timeout_s. Not durable when the disk tier has
        dropped writes (it failed at runtime): it then takes nothing."""
        deadline = time.monotonic() + timeout_s
        moved = left = 0
        if self._disk is None:
            return FlushResult(0, len(self._index), False)
        if self._disk.failure is not None:
            with self._lock:
                left = sum(1 for e in self._index.values() if e.level < len(self.tiers) - 1)
            return FlushResult(0, left, False)
        disk_level = len(self.tiers) - 1
        with self._lock:
            for level in range(disk_level):
                slot = self.tiers[level]
                pinned = [k for k, e in self._index.items() if e.level == level and e.pins > 0]
                for key in [*slot.policy.order(), *pinned]:
                    entry = self._index[key]
                    if time.monotonic() > deadline or not self._make_room(disk_level, entry.size):
                        left += 1
                        continue
                    payload = self._read_locked(slot, key)
                    if payload is None:  # corrupt (counted): not worth keeping either
                        self._remove(key, entry)
                        continue
                    csum = self._known_checksum(entry, payload)
                    self._move(key, entry, disk_level, self._writer(key, payload, csum, entry.ephemeral))
                    moved += 1
        durable = self._disk.flush(max(0.0, deadline - time.monotonic()))
        return FlushResult(moved, left, durable)

    def close(self, timeout_s: float = 30.0) -> None:
        """Closes every tier, waiting at most about timeout_s for pending disk writes (and a little for the
        remote tier's)."""
        if self.remote is not None:
            self.remote.close()
        self.events.close()
        for slot in self.tiers:
            slot.storage.close(timeout_s)

    def check_integrity(self) -> None:
        """Raises IntegrityError unless bytes per tier <= capacity and index, tiers, eviction
        order and leases all agree."""
        with self._lock:
            self._check_integrity()

    # -- placement -----------------------------------------------------------------------------

    def _check_size(self, size: int) -> None:
        if size > self.max_block_bytes:
            raise BlockTooLarge(f"block of {size} bytes exceeds {self.block_limit}")

    def _check_pin_cap(self, caller: str | None, size: int) -> None:
        cap = self.max_pinned_bytes_per_caller
        if caller is None or cap is None:
            return
        held = self._leases.pinned_bytes(caller)
        if held + size > cap:
            raise StoreFull(f"caller {caller} holds leases on {held} bytes; a lease on {size} more would pass its "
                            f"cap of {cap} bytes (--max-pinned-bytes-per-caller): release leases, or look up "
                            "without one")

    @staticmethod
    def _writer(key: BlockHash, payload: Buffer, csum: int, ephemeral: bool) -> Write:
        """Writes a block into the tier chosen under the lock."""

        def write(slot: TierSlot, seq: int) -> None:
            slot.storage.write(key, payload, csum, ephemeral=ephemeral, seq=seq)

        return write

    @staticmethod
    def _reserved_writer(key: BlockHash, shm: ArenaTier, offset: int, size: int, slot_csum: int, ephemeral: bool
                         ) -> Write:
        """The arena slot a same-host client filled becomes the block in the arena's tier (no copy); any
        other tier (the arena's is full of pinned blocks) takes a copy of its bytes, and the slot goes back."""

        def write(slot: TierSlot, seq: int) -> None:
            if slot.storage is shm:
                shm.adopt(key, offset, size, slot_csum)
                return
            payload = shm.copy_slot(offset, size, slot_csum)
            if payload is None:
                raise InvalidRequest(f"the bytes in slot {offset} do not match the checksum put with them")
            csum = slot_csum if shm.xxh3_slots else checksum(payload)
            slot.storage.write(key, payload, csum, ephemeral=ephemeral, seq=seq)
            shm.release(offset)

        return write

    @staticmethod
    def _known_checksum(entry: Entry, payload: Buffer) -> int:
        """The entry's checksum; taken now from its payload where it was not known (a block a client put
        into a device arena slot, whose own checksum is of another kind)."""
        if not entry.checksum:
            entry.checksum = checksum(payload)
        return entry.checksum

    def _insert(self, key: BlockHash, size: int, csum: int, ephemeral: bool, write: Write,
                reserved: int | None = None, share: bool = True) -> bool:
        """Places a new block (False: it was there). `share`: written behind to the remote tier, unless
        ephemeral (a block from the remote is not)."""
        shm = self.shm_tier
        with self._lock:
            self._expire_leases()
            existing = self._index.get(key)
            if existing is not None:
                if existing.pins == 0:
                    self.tiers[existing.level].policy.touch(key)
                if reserved is not None and shm is not None:
                    shm.release(reserved)
                return False
            level = next((lv for lv in range(len(self.tiers)) if self._make_room(lv, size, reserved is not None)), None)
            if level is None:
                failed = [f"{s.tier.label}: {s.storage.failure}" for s in self.tiers if s.storage.failure is not None]
                why = f"; unavailable tiers: {', '.join(failed)}" if failed else ""
                raise StoreFull(f"no tier can take a block of {size} bytes: every tier is full of pinned blocks{why}")
            slot = self.tiers[level]
            self._seq += 1
            write(slot, self._seq)
            entry = Entry(size, csum, ephemeral, level)
            self._index[key] = entry
            self._account(slot, key, entry, +1)
            self.events.publish(StoreEvent(True, key, slot.tier))
        self._backpressure()
        if share and not ephemeral and self.remote is not None:
            self.remote.write_behind(key, size)
        return True

    def _make_room(self, level: int, size: int, have_slot: bool = False) -> bool:
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

    def _demote(self, key: BlockHash, level: int) -> None:
        entry = self._index[key]
        slot = self.tiers[level]
        below = level + 1
        if below < len(self.tiers) and self._make_room(below, entry.size):
            payload = self._read_locked(slot, key)
            if payload is not None:
                csum = self._known_checksum(entry, payload)
                self._move(key, entry, below, self._writer(key, payload, csum, entry.ephemeral))
                slot.demotions += 1
                return
        self._remove(key, entry)
        slot.evictions += 1

    def _promote(self, key: BlockHash, entry: Entry, payload: Buffer) -> None:
        with self._lock:
            if self._index.get(key) is not entry or entry.level == 0:
                return  # gone, or moved by a concurrent reader: blocks are immutable, nothing lost
            src = entry.level
            self._pin(key, entry)  # so making room above cannot demote it out from under us
            try:
                target = next((lv for lv in range(src) if self._make_room(lv, entry.size)), None)
            finally:
                self._unpin(key, entry)
            if target is None:
                return
            self._move(key, entry, target, self._writer(key, payload, entry.checksum, entry.ephemeral))
            self.tiers[src].promotions += 1
        self._backpressure()

    def _move(self, key: BlockHash, entry: Entry, dst: int, write: Write) -> None:
        src_slot, dst_slot = self.tiers[entry.level], self.tiers[dst]
        self._seq += 1
        write(dst_slot, self._seq)
        src_slot.storage.delete(key)
        self._account(src_slot, key, entry, -1)
        entry.level = dst
        self._account(dst_slot, key, entry, +1)

    def _remove(self, key: BlockHash, entry: Entry) -> None:
        slot = self.tiers[entry.level]
        slot.storage.delete(key)
        self._account(slot, key, entry, -1)
        del self._index[key]
        self.events.publish(StoreEvent(False, key, slot.tier))

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

    def _touch_chain(self, keys: Sequence[BlockHash]) -> None:
        # Tail first, so each parent ends up more recent than its children.
        for key in reversed(keys):
            entry = self._index.get(key)
            if entry is not None and entry.pins == 0:
                self.tiers[entry.level].policy.touch(key)

    def _backpressure(self) -> None:
        if self._disk is not None:
            self._disk.wait_for_room()

    # -- pins and leases -----------------------------------------------------------------------

    def _pin(self, key: BlockHash, entry: Entry) -> None:
        entry.pins += 1
        if entry.pins == 1:
            slot = self.tiers[entry.level]
            slot.policy.remove(key)
            slot.pinned += entry.size

    def _unpin(self, key: BlockHash, entry: Entry) -> None:
        entry.pins -= 1
        if entry.pins == 0 and self._index.get(key) is entry:
            slot = self.tiers[entry.level]
            slot.pinned -= entry.size
            slot.policy.add(key, ephemeral=entry.ephemeral)

    def _unpin_all(self, entries: list[tuple[BlockHash, Entry]]) -> None:
        for key, entry in reversed(entries):  # tail first: parents end up more recent
            self._unpin(key, entry)

    def _expire_leases(self) -> None:
        for lease in self._leases.expired():
            self._unpin_all(lease.entries)
        now = self._clock()
        for rid in [r for r, res in self._reservations.items() if res.expires < now]:
            self._release_slots(self._reservations.pop(rid))

    def _reserved_bytes(self) -> int:
        return sum(sum(r.slots.values()) for r in self._reservations.values())

    def _release_slots(self, reservation: Reservation) -> None:
        shm = self.shm_tier
        assert shm is not None
        for offset in reservation.slots:
            shm.release(offset)
        reservation.slots.clear()

    # -- failures ------------------------------------------------------------------------------

    def _drop_corrupt(self, key: BlockHash, entry: Entry, exc: CorruptBlock) -> None:
        with self._lock:
            self._count_bad(exc)
            self._count_miss()
            if self._index.get(key) is entry:
                self._remove(key, entry)

    def _forget_lost(self, keys: Collection[BlockHash] | None) -> None:
        """The disk tier could not write `keys` (None: it lost everything, damaged): they are not held."""
        assert self._disk is not None
        level = len(self.tiers) - 1
        with self._lock:
            if keys is None:
                keys = [k for k, e in self._index.items() if e.level == level]
            lost = [(k, e) for k in keys if (e := self._index.get(k)) is not None and e.level == level]
            for key, entry in lost:
                self._remove(key, entry)
        if lost:
            log.info("forgot %d blocks the disk tier does not hold (%s)", len(lost), self._disk.failure)

    def _drop_if_lost(self, key: BlockHash, entry: Entry, level: int) -> None:
        # A read found nothing where the index said: either it moved meanwhile (retry) or its
        # storage lost it (a failed disk write): then forget it.
        with self._lock:
            if self._index.get(key) is entry and entry.level == level:
                self._remove(key, entry)

    def _read_locked(self, slot: TierSlot, key: BlockHash) -> Buffer | None:
        # Under the lock, for demotion: a corrupt block is counted and not carried down.
        try:
            return slot.storage.read(key)
        except CorruptBlock as exc:
            self._count_bad(exc)
            return None

    def _count_bad(self, exc: CorruptBlock) -> None:
        if isinstance(exc, ForeignRecord):
            self.mac_failures += 1
        else:
            self.checksum_failures += 1

    def _count_hit(self, level: int, remote: bool = False) -> None:
        if remote:  # just promoted from the remote tier: a miss in every local one
            self._count_miss()
            return
        for slot in self.tiers[:level]:
            slot.misses += 1
        self.tiers[level].hits += 1

    def _count_miss(self) -> None:
        for slot in self.tiers:
            slot.misses += 1

    # -- start-up and checks -------------------------------------------------------------------

    def _rebuild_from_disk(self, level: int) -> None:
        assert self._disk is not None
        records = sorted(self._disk.scan(), key=lambda kh: kh[1].seq)
        self.mac_failures += self._disk.foreign_records
        slot = self.tiers[level]
        for key, header in records:
            entry = Entry(header.size, header.checksum, header.ephemeral, level)
            self._index[key] = entry
            self._account(slot, key, entry, +1)
            self._seq = max(self._seq, header.seq)
        while slot.used > slot.capacity:  # capacity shrank since the last run
            victim = slot.policy.victim()
            assert victim is not None
            self._remove(victim, self._index[victim])
            slot.evictions += 1

    def _check_integrity(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise IntegrityError(what)

        pins: dict[int, int] = {}
        for lease in self._leases:
            for _, entry in lease.entries:
                pins[id(entry)] = pins.get(id(entry), 0) + 1
        for level, slot in enumerate(self.tiers):
            entries = {k: e for k, e in self._index.items() if e.level == level}
            label = slot.tier.label
            need(slot.used == sum(e.size for e in entries.values()), f"{label}: used bytes != sum of block sizes")
            need(slot.used <= slot.capacity, f"{label}: {slot.used} bytes used > capacity {slot.capacity}")
            need(slot.blocks == len(entries), f"{label}: block count off")
            need(slot.pinned == sum(e.size for e in entries.values() if e.pins), f"{label}: pinned bytes off")
            unpinned = {k for k, e in entries.items() if e.pins == 0}
            need(set(slot.policy.order()) == unpinned and len(slot.policy) == len(unpinned), f"{label}: LRU != unpinned blocks")
            need(slot.storage.keys() == set(entries), f"{label}: storage keys != index keys")
        for entry in self._index.values():
            need(entry.pins == pins.get(id(entry), 0), "pin count != leases holding the block")
        by_caller: dict[str, int] = {}
        for lease in self._leases:
            if lease.caller is not None:
                by_caller[lease.caller] = by_caller.get(lease.caller, 0) + lease.size
        need(by_caller == self._leases.pinned_by_caller(), "bytes pinned per caller != their leases")
