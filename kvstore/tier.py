"""The one interface every storage tier implements; the store walks tiers through it."""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from kvstore.block_format import CorruptBlock
from kvstore.slab import SlabAllocator
from kvstore.types import Buffer, Tier
from protos.block_hash import BlockHash


class TierStorage(ABC):
    """Bytes of blocks in one tier. Knows nothing of capacity, LRU order or leases (the store does).

    `read` may run concurrently with `write`/`delete` from other threads and returns None for a
    block that is not (or no longer) there; it may return a read-only view that stays valid
    after the block is deleted. `write` and `delete` are called under the store's lock,
    so they must be quick (memory) or deferred (disk).
    """

    tier: Tier

    @abstractmethod
    def write(self, key: BlockHash, payload: Buffer, checksum: int, *, ephemeral: bool, seq: int) -> None: ...

    @abstractmethod
    def read(self, key: BlockHash) -> Buffer | None: ...

    @abstractmethod
    def delete(self, key: BlockHash) -> None: ...

    @abstractmethod
    def keys(self) -> set[BlockHash]: ...

    def has_room(self, size: int) -> bool:
        """Whether a block of `size` bytes can be written now, beyond the store's byte count (a
        slab arena can be out of slots of one size while bytes are free)."""
        return True

    @property
    def failure(self) -> str | None:
        """Why the tier stopped taking blocks at runtime (a disk that filled up, turned read-only or was
        damaged), else None. The store then places nothing there; what it holds is read while it can be."""
        return None

    def flush(self, timeout_s: float | None = None) -> bool:
        """Makes written blocks durable; True when everything was flushed in time."""
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Releases the tier; a tier that writes behind waits at most about timeout_s."""
        return None


class ArenaTier(TierStorage):
    """A tier whose blocks lie in slots of one shared buffer that same-host clients open (kvstore/arena.py):
    the host tier's shared memory, or the device tier's GPU memory. A client reserves slots, fills them
    and names them in a put (`reserve`, `adopt`); a get names the slots to copy from (`slot`).

    Subclasses set `socket` (the ArenaSocket that hands the buffer out) and say whether slot checksums
    are the store's xxh3 (`xxh3_slots`) or their own kind."""

    xxh3_slots = True
    socket: Any

    def __init__(self, directory: Path, size: int) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.slots = SlabAllocator(size)
        self._slots: dict[BlockHash, tuple[int, int, int]] = {}  # key -> (offset, size, checksum)

    @abstractmethod
    def slot_checksum(self, offset: int, size: int) -> int:
        """The checksum (of this arena's kind) of the `size` bytes at `offset`."""

    @abstractmethod
    def copy_slot(self, offset: int, size: int, checksum: int) -> bytes | None:
        """A copy of the `size` bytes at `offset` if they match `checksum` (of this arena's kind), else None."""

    def read(self, key: BlockHash) -> bytes | None:
        """A verified copy (the slot may be reused once the block goes). Raises CorruptBlock when
        the slot still holds the block but its bytes changed (another process wrote there)."""
        found = self._slots.get(key)
        if found is None:
            return None
        offset, size, csum = found
        payload = self.copy_slot(offset, size, csum)
        if payload is not None:
            return payload
        if self._slots.get(key) == found:
            raise CorruptBlock(f"{self.tier.label} arena slot at {offset} no longer holds block {key.hex()[:16]}")
        return None  # moved meanwhile

    def has_room(self, size: int) -> bool:
        return self.slots.has_room(size)

    def reserve(self, size: int) -> int | None:
        """A slot for a client to fill before `adopt`, or None."""
        return self.slots.alloc(size)

    def release(self, offset: int) -> None:
        self.slots.free(offset)

    def adopt(self, key: BlockHash, offset: int, size: int, checksum: int) -> None:
        """Makes a reserved slot, filled by a client, block `key` (no copy)."""
        self._slots[key] = (offset, size, checksum)

    def slot(self, key: BlockHash) -> tuple[int, int, int] | None:
        """(offset, size, checksum) of the block's slot, for a same-host client to copy from."""
        return self._slots.get(key)

    def delete(self, key: BlockHash) -> None:
        found = self._slots.pop(key, None)
        if found is not None:
            self.slots.free(found[0])

    def keys(self) -> set[BlockHash]:
        return set(self._slots)

    def _alloc(self, size: int) -> int:
        offset = self.slots.alloc(size)
        if offset is None:  # the store checks has_room first
            raise MemoryError(f"no free {self.tier.label} arena slot for {size} bytes")
        return offset

    def close(self, timeout_s: float = 30.0) -> None:
        self.socket.close()
        self._slots.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
