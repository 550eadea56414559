"""The one interface every storage tier implements; the store walks tiers through it."""

from __future__ import annotations

from abc import ABC, abstractmethod

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
