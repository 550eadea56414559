"""The tier manager: the store's public face over its placement, leases, reservations and counters.

Blocks are exclusive to one tier (kvstore/placement.py). Writes land in the highest tier that can make room;
making room demotes that tier's eviction victims to the next tier, and the last tier drops them. A hit in a
lower tier is promoted on read. One lock guards the index and bookkeeping of every piece; it is never held
across network I/O, disk commits (the disk tier writes behind) or payload reads from disk or shared memory
(those retry if the block moved meanwhile). Hits and misses count as kvstore/store_stats.py says.

Limits per caller: a block above `max_block_bytes` is refused, a lease longer than `max_lease_ttl_s` gets that
much, and one caller's leases pin at most `max_pinned_bytes_per_caller` (kvstore/leases.py; callers are named
by the server; in-process calls name none and are not capped). A tier that fails at runtime (a disk that fills
up, turns read-only or is damaged) takes no more blocks; the blocks it could not write are forgotten, so stats
never count what is not held.

A remote tier (Redis or Valkey, shared by every node) sits under the local tiers, outside the index: each block
stored here (but ephemeral ones) is written behind to it, and on a local miss Lookup and Get ask it for the
blocks they lack, without the lock, and promote its hits into the local tiers. Such a hit counts as a miss in
every local tier and as a hit of the remote (kvstore/remote_tier.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from kvstore.block_format import CorruptBlock, checksum
from kvstore.disk_tier import DiskTier
from kvstore.errors import BlockTooLarge, InvalidRequest, StoreFull
from kvstore.events import EventHub
from kvstore.leases import MAX_TTL_S, Leases
from kvstore.placement import Entry, Placement, Write, check_key, known_checksum, writer
from kvstore.reservations import Reservations, check_request, reserved_writer
from kvstore.store_stats import StoreCounters
from kvstore.tier import ArenaTier, TierStorage
from kvstore.types import Buffer, LookupResult, StoreStats, Tier
from protos.block_hash import BlockHash

if TYPE_CHECKING:
    from kvstore.remote_tier import RemoteTier

log = logging.getLogger(__name__)

_READ_RETRIES = 4


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
        self.events = events or EventHub()
        self._counters = StoreCounters(len(tiers))
        self._placement = Placement(tiers, self._counters, self.events)
        self.tiers = self._placement.tiers
        # the arena same-host clients open: the device tier's, else the host tier's shared memory
        self.shm_tier = next((s.storage for s in self.tiers if isinstance(s.storage, ArenaTier)), None)
        self._max_block_bytes = max_block_bytes
        self._leases = Leases(self._placement, clock, max_ttl_s=max_lease_ttl_s,
                              max_pinned_bytes_per_caller=max_pinned_bytes_per_caller)
        self._reservations = Reservations(self.shm_tier, clock)
        self._lock = threading.Lock()
        self._disk = next((s.storage for s in self.tiers if isinstance(s.storage, DiskTier)), None)
        if self._disk is not None:
            self._placement.rebuild(self._disk)
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

    @property
    def max_lease_ttl_s(self) -> float:
        return self._leases.max_ttl_s

    @property
    def max_pinned_bytes_per_caller(self) -> int | None:
        return self._leases.max_pinned_bytes_per_caller

    @property
    def checksum_failures(self) -> int:
        """Damaged blocks found in a local tier."""
        return self._counters.checksum_failures

    @property
    def mac_failures(self) -> int:
        """Disk records not this deployment's under their key, found at start or on a read."""
        return self._counters.mac_failures

    @property
    def removed_blocks(self) -> int:
        """Blocks removed at a reader's request (Remove)."""
        return self._counters.removed_blocks

    @property
    def reserved_bytes(self) -> int:
        """Bytes of arena slots reserved by same-host clients and not yet put."""
        with self._lock:
            return self._reservations.reserved_bytes

    def pinned_bytes_by_caller(self) -> dict[str, int]:
        """Bytes each named caller's live leases pin."""
        with self._lock:
            return self._leases.pinned_by_caller()

    def checksum_of(self, key: BlockHash) -> int | None:
        """A stored block's xxh3 as the store knows it: 0 until its bytes first leave a device arena slot a client
        put it in (that slot's checksum is of another kind); None when the block is not stored."""
        with self._lock:
            entry = self._placement.entries.get(key)
            return None if entry is None else entry.checksum

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
        return self._insert(key, len(payload), actual, ephemeral, writer(key, payload, actual, ephemeral))

    def reserve(self, sizes: Sequence[int], keys: Sequence[BlockHash] = ()) -> tuple[str, list[int | None]]:
        """Arena slots for a same-host client to fill and then name in `put_reserved`: (reservation
        id, one offset per size). Room is made by demoting, as for a put. With `keys` (one per size),
        a block already stored gets None instead of a slot, and is touched as a put would."""
        shm = self._reservations.arena()
        check_request(sizes, keys, self._check_size)
        level = self._placement.level_of(shm)
        with self._lock:
            self._expire()
            entries = self._placement.entries
            stored = [key in entries for key in keys] if keys else [False] * len(sizes)
            self._placement.touch([key for key in keys if key in entries])
            return self._reservations.open(sizes, stored, lambda size: self._placement.make_room(level, size),
                                           self.tiers[level].capacity)

    def put_reserved(self, key: BlockHash, reservation_id: str, offset: int, size: int, checksum_: int = 0, *,
                     ephemeral: bool = False) -> bool:
        """Stores the block a same-host client wrote into a reserved slot; the slot becomes the block
        (no copy). The client's checksum (of the arena's kind) is taken as is (computed here when 0): every
        reader verifies it, so bytes that do not match it, now or later, are a miss, never data."""
        check_key(key)
        shm = self._reservations.arena()
        with self._lock:
            self._reservations.take(reservation_id, offset, size)
        try:
            with self._lock:
                csum = checksum_ or shm.slot_checksum(offset, size)
            # The entry's checksum is the store's xxh3 of the payload: a device slot's is of another kind, so
            # it stays unknown (0) until the block's bytes first leave the arena (`known_checksum`).
            write = reserved_writer(key, shm, offset, size, csum, ephemeral)
            return self._insert(key, size, csum if shm.xxh3_slots else 0, ephemeral, write, reserved=offset)
        except BaseException:  # raised before anything took the slot (a device copy too): it goes back
            with self._lock:
                shm.release(offset)
            raise

    def end_reservation(self, reservation_id: str) -> None:
        """Returns the slots of a reservation that were not put."""
        with self._lock:
            self._reservations.end(reservation_id)

    def lookup(self, keys: Sequence[BlockHash], lease_ttl_s: float | None = None, *,
               caller: str | None = None) -> LookupResult:
        """How many leading keys are present and where; with a TTL, pins them under a lease of at most
        `max_lease_ttl_s`, counted against `caller`'s cap (StoreFull past it)."""
        for key in keys:
            check_key(key)
        lease_ttl_s = self._leases.ttl(lease_ttl_s)
        fetched = self._fetch_remote(keys, prefix=True)
        with self._lock:
            self._expire()
            hits: list[tuple[BlockHash, Entry]] = []
            for key in keys:
                entry = self._placement.entries.get(key)
                if entry is None:
                    self._counters.miss()
                    break
                self._counters.hit(entry.level, remote=key in fetched)
                hits.append((key, entry))
            self._placement.touch([k for k, _ in hits])
            lease_id = self._leases.take(hits, lease_ttl_s, caller) if lease_ttl_s and hits else None
            tiers = [self.tiers[e.level].tier.label for _, e in hits]
        return LookupResult(len(hits), tiers, lease_id, lease_ttl_s if lease_id else None)

    def lease_ttl(self, requested: float | None) -> float | None:
        """The TTL a lease asked for gets (None or 0: no lease; at most `max_lease_ttl_s`); InvalidRequest for a
        negative or NaN one."""
        return self._leases.ttl(requested)

    def lease_stored(self, keys: Sequence[BlockHash], lease_ttl_s: float | None, *, caller: str | None = None,
                     lease_id: str | None = None) -> tuple[str | None, float | None]:
        """A lease on those of `keys` stored now (a put's blocks, new or not): a new one of `caller`'s, or with
        `lease_id` that live lease, renewed. (lease id, TTL it got), or (None, None) where none was taken: no TTL,
        no block, `lease_id` ended, or past a cap (the caller's pinned bytes, the leases held), which is no error:
        the blocks are stored all the same."""
        lease_ttl_s = self._leases.ttl(lease_ttl_s)
        if not lease_ttl_s:
            return None, None
        with self._lock:
            self._expire()
            entries = self._placement.entries
            hits = [(key, entries[key]) for key in dict.fromkeys(keys) if key in entries]
            if not hits and not lease_id:
                return None, None
            try:
                if lease_id:
                    taken = lease_id if self._leases.extend(lease_id, hits, lease_ttl_s, caller) else None
                else:
                    taken = self._leases.take(hits, lease_ttl_s, caller)
            except StoreFull as exc:
                log.info("no lease on a put's %d blocks: %s", len(hits), exc)
                return None, None
        return (taken, lease_ttl_s) if taken else (None, None)

    def remove(self, keys: Sequence[BlockHash]) -> int:
        """Drops blocks from whichever tier holds them, announced on Events (a reader found them bad: a
        later put of the same hash is stored again); returns how many were stored. A lease that pinned
        one keeps nothing of it."""
        for key in keys:
            check_key(key)
        removed = 0
        with self._lock:
            for key in keys:
                entry = self._placement.entries.get(key)
                if entry is not None:
                    self._placement.remove(key, entry)
                    removed += 1
            self._counters.removed_blocks += removed
        return removed

    def get(self, keys: Sequence[BlockHash], *, via_shm: bool = False) -> Iterator[BlockRead | None]:
        """Reads blocks one by one (lazily), after touching them as a chain (and fetching those missing here
        from the remote tier)."""
        for key in keys:
            check_key(key)
        fetched = self._fetch_remote(keys, prefix=False)
        with self._lock:
            self._expire()
            self._placement.touch(keys)
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
            self._expire()
            self._placement.touch(keys)
            for key in keys:
                entry = self._placement.entries.get(key)
                found = shm.slot(key) if shm is not None and entry is not None else None
                if entry is None or found is None:
                    out.append(None)
                    continue
                self._counters.hit(entry.level)
                out.append((found[0], entry.size, found[2]))
        return out

    def touch(self, keys: Sequence[BlockHash]) -> None:
        """Marks a chain of blocks (prefix order) used, tail first: parents end up more recent."""
        with self._lock:
            self._placement.touch(keys)

    def release(self, lease_id: str) -> None:
        with self._lock:
            self._leases.release(lease_id)

    def sweep(self) -> None:
        """Expires leases whose TTL has passed (the server calls this periodically)."""
        with self._lock:
            self._expire()

    def stats(self) -> StoreStats:
        with self._lock:
            self._expire()
            failed_writes = self._disk.failed_writes if self._disk is not None else 0
            stats = self._counters.stats(self._placement.occupancy(), leases=len(self._leases),
                                         pinned_blocks=self._placement.pinned_blocks(),
                                         disk_write_failures=failed_writes)
        return stats if self.remote is None else replace(stats, remote=self.remote.stats())

    def tier_of(self, key: BlockHash) -> Tier | None:
        with self._lock:
            return self._placement.tier_of(key)

    def eviction_order(self, tier: Tier) -> list[BlockHash]:
        """Unpinned blocks of a tier, next victim first."""
        with self._lock:
            return self._placement.eviction_order(tier)

    def __len__(self) -> int:
        return len(self._placement.entries)

    def __contains__(self, key: object) -> bool:
        return key in self._placement.entries

    def flush_to_disk(self, timeout_s: float = 10.0) -> FlushResult:
        """Moves every memory-tier block to disk (LRU first, so the newest survive a small disk)
        and waits for the disk writes, all within timeout_s. Not durable when the disk tier has
        dropped writes (it failed at runtime): it then takes nothing."""
        deadline = time.monotonic() + timeout_s
        if self._disk is None:
            return FlushResult(0, len(self._placement.entries), False)
        disk_level = len(self.tiers) - 1
        if self._disk.failure is not None:
            with self._lock:
                left = sum(1 for e in self._placement.entries.values() if e.level < disk_level)
            return FlushResult(0, left, False)
        with self._lock:
            moved, left = self._placement.move_down(disk_level, deadline)
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
            self._placement.check()
            self._leases.check()

    # -- reads ---------------------------------------------------------------------------------

    def _read(self, key: BlockHash, *, via_shm: bool = False, fetched: bool = False) -> BlockRead | None:
        """One block, or None for a miss (a corrupt block is deleted and counted, then a miss)."""
        for _ in range(_READ_RETRIES):
            with self._lock:
                entry = self._placement.entries.get(key)
                if entry is None:
                    self._counters.miss()
                    return None
                level = entry.level
                slot = self.tiers[level]
                shm = self.shm_tier
                if via_shm and shm is not None and slot.storage is shm:
                    found = shm.slot(key)
                    if found is not None:
                        self._counters.hit(level, remote=fetched)
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
                if self._placement.entries.get(key) is not entry:
                    continue  # dropped and stored again meanwhile: read the block now there
                self._counters.hit(level, remote=fetched)
            csum = known_checksum(entry, payload)
            if level > 0:
                try:
                    self._promote(key, entry, payload)
                except Exception:  # optional work (a device tier out of memory): the block is read all the same
                    log.warning("promoting block %s failed", key.hex()[:16], exc_info=True)
            return BlockRead(payload, None, entry.size, csum, slot.tier)
        with self._lock:
            self._counters.miss()
        return None

    def _fetch_remote(self, keys: Sequence[BlockHash], *, prefix: bool) -> set[BlockHash]:
        """Asks the remote tier for the blocks missing here (for a prefix, those after the leading local
        hits, until its first gap) and places its hits in the local tiers; returns their keys. Never
        under the lock."""
        if self.remote is None:
            return set()
        with self._lock:
            entries = self._placement.entries
            if prefix:
                first = next((i for i, key in enumerate(keys) if key not in entries), len(keys))
                missing = list(keys[first:])
            else:
                missing = [key for key in dict.fromkeys(keys) if key not in entries]
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
                if self._insert(key, len(payload), csum, False, writer(key, payload, csum, False), share=False):
                    fetched.add(key)
            except (BlockTooLarge, StoreFull):
                if prefix:
                    break
        return fetched

    def _peek(self, key: BlockHash) -> tuple[Buffer, int] | None:
        """A block's payload and checksum, without counting or promoting it (for the remote tier's writer)."""
        for _ in range(_READ_RETRIES):
            with self._lock:
                entry = self._placement.entries.get(key)
                if entry is None:
                    return None
                slot = self.tiers[entry.level]
            try:
                payload = slot.storage.read(key)
            except CorruptBlock:
                return None  # its next reader drops it
            if payload is not None:
                return payload, known_checksum(entry, payload)
        return None

    # -- writes --------------------------------------------------------------------------------

    def _check_size(self, size: int) -> None:
        if size > self.max_block_bytes:
            raise BlockTooLarge(f"block of {size} bytes exceeds {self.block_limit}")

    def _insert(self, key: BlockHash, size: int, csum: int, ephemeral: bool, write: Write,
                reserved: int | None = None, share: bool = True) -> bool:
        """Places a new block (False: it was there). `share`: written behind to the remote tier, unless
        ephemeral (a block from the remote is not)."""
        with self._lock:
            self._expire()
            if key in self._placement.entries:
                self._placement.touch([key])
                if reserved is not None and self.shm_tier is not None:
                    self.shm_tier.release(reserved)
                return False
            self._placement.insert(key, size, csum, ephemeral, write, have_slot=reserved is not None)
        self._backpressure()
        if share and not ephemeral and self.remote is not None:
            self.remote.write_behind(key, size)
        return True

    def _promote(self, key: BlockHash, entry: Entry, payload: Buffer) -> None:
        with self._lock:
            moved = self._placement.promote(key, entry, payload)
        if moved:
            self._backpressure()

    def _backpressure(self) -> None:
        if self._disk is not None:
            self._disk.wait_for_room()

    def _expire(self) -> None:
        """Ends the leases and reservations whose time has passed."""
        self._leases.expire()
        self._reservations.expire()

    # -- failures ------------------------------------------------------------------------------

    def _drop_corrupt(self, key: BlockHash, entry: Entry, exc: CorruptBlock) -> None:
        with self._lock:
            self._counters.bad(exc)
            self._counters.miss()
            if self._placement.entries.get(key) is entry:
                self._placement.remove(key, entry)

    def _forget_lost(self, keys: Collection[BlockHash] | None) -> None:
        """The disk tier could not write `keys` (None: it lost everything, damaged): they are not held."""
        assert self._disk is not None
        with self._lock:
            lost = self._placement.forget(keys, len(self.tiers) - 1)
        if lost:
            log.info("forgot %d blocks the disk tier does not hold (%s)", lost, self._disk.failure)

    def _drop_if_lost(self, key: BlockHash, entry: Entry, level: int) -> None:
        # A read found nothing where the index said: either it moved meanwhile (retry) or its
        # storage lost it (a failed disk write): then forget it.
        with self._lock:
            if self._placement.entries.get(key) is entry and entry.level == level:
                self._placement.remove(key, entry)
