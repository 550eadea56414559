"""Arena slots reserved for same-host clients, which fill them and then name them in a put.

A client asks for slots (`BlockStore.reserve`), writes its blocks there and puts them: each slot becomes its
block without a copy (`reserved_writer`). Slots not put go back to the arena when the client ends the
reservation, or after RESERVATION_TTL_S (a client that died). Reservations hold at most half the arena's tier.
Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.block_format import checksum
from kvstore.errors import InvalidRequest, StoreFull
from kvstore.placement import TierSlot, Write, check_key
from kvstore.tier import ArenaTier
from protos.block_hash import BlockHash

MAX_RESERVATION_BLOCKS = 4096
RESERVATION_TTL_S = 30.0  # a client that reserved slots and never put: they return after this
_NO_ARENA = "this server has no arena for same-host clients: send block data"


@dataclass(slots=True)
class Reservation:
    slots: dict[int, int]  # arena offset -> slot size, not yet put
    expires: float


def check_request(sizes: Sequence[int], keys: Sequence[BlockHash], check_size: Callable[[int], None]) -> None:
    """InvalidRequest unless 1 to MAX_RESERVATION_BLOCKS sizes, each > 0 (and passing `check_size`), and no keys
    or one well-formed key per size."""
    if not 0 < len(sizes) <= MAX_RESERVATION_BLOCKS:
        raise InvalidRequest(f"reserve 1 to {MAX_RESERVATION_BLOCKS} slots at a time, not {len(sizes)}")
    if keys and len(keys) != len(sizes):
        raise InvalidRequest(f"{len(keys)} hashes for {len(sizes)} sizes: give one per size, or none")
    for key in keys:
        check_key(key)
    for size in sizes:
        if size <= 0:
            raise InvalidRequest("empty block payload")
        check_size(size)


class Reservations:
    """The open reservations of the arena same-host clients open (None: the store has none)."""

    def __init__(self, shm: ArenaTier | None, clock: Callable[[], float]) -> None:
        self._shm = shm
        self._clock = clock
        self._open: dict[str, Reservation] = {}

    def __len__(self) -> int:
        return len(self._open)

    @property
    def reserved_bytes(self) -> int:
        """Bytes of slots reserved and not yet put."""
        return sum(sum(r.slots.values()) for r in self._open.values())

    def arena(self) -> ArenaTier:
        """The arena, or InvalidRequest where the store has none."""
        if self._shm is None:
            raise InvalidRequest(_NO_ARENA)
        return self._shm

    def open(self, sizes: Sequence[int], stored: Sequence[bool], make_room: Callable[[int], bool],
             capacity: int) -> tuple[str, list[int | None]]:
        """A slot for each size but the `stored` ones (None), room made by `make_room(size)`: (reservation id,
        offsets). StoreFull past half of `capacity` (the arena tier's), or where a slot cannot be had."""
        shm = self.arena()
        wanted = sum(size for size, s in zip(sizes, stored, strict=True) if not s)
        if wanted + self.reserved_bytes > capacity // 2:
            raise StoreFull(f"reservations would hold more than half the {shm.tier.label} tier: put in smaller "
                            "batches")
        offsets: list[int | None] = []
        slots: dict[int, int] = {}
        for size, is_stored in zip(sizes, stored, strict=True):
            if is_stored:
                offsets.append(None)
                continue
            offset = shm.reserve(size) if make_room(size) else None
            if offset is None:
                for o in slots:
                    shm.release(o)
                raise StoreFull(f"no arena slot for a block of {size} bytes")
            slots[offset] = size
            offsets.append(offset)
        if not slots:
            return "", offsets
        rid = uuid.uuid4().hex
        self._open[rid] = Reservation(slots, self._clock() + RESERVATION_TTL_S)
        return rid, offsets

    def take(self, reservation_id: str, offset: int, size: int) -> None:
        """Takes the slot at `offset` out of its reservation, for a put of `size` bytes (InvalidRequest where the
        reservation has no such slot, or a smaller one)."""
        reservation = self._open.get(reservation_id)
        reserved = None if reservation is None else reservation.slots.get(offset)
        if reservation is None or reserved is None or not 0 < size <= reserved:
            raise InvalidRequest(f"no reserved slot at {offset} for {size} bytes under reservation {reservation_id!r}")
        del reservation.slots[offset]

    def end(self, reservation_id: str) -> None:
        """Returns the slots of a reservation that were not put."""
        reservation = self._open.pop(reservation_id, None)
        if reservation is not None:
            self._release(reservation)

    def expire(self) -> None:
        now = self._clock()
        for rid in [r for r, res in self._open.items() if res.expires < now]:
            self._release(self._open.pop(rid))

    def _release(self, reservation: Reservation) -> None:
        shm = self.arena()
        for offset in reservation.slots:
            shm.release(offset)
        reservation.slots.clear()


def reserved_writer(key: BlockHash, shm: ArenaTier, offset: int, size: int, slot_csum: int, ephemeral: bool
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
