"""Eviction order within one tier: ephemeral blocks first, then least recently used.

Only evictable (unpinned) blocks are tracked; the store removes a block while it is pinned and
adds it back when the last pin goes. Every operation is O(1). Prefix awareness comes from the
store touching a chain of hashes in reverse (tail first), so a parent is always more recent
than its children and the tail of a chain is evicted before its parents.
"""

from __future__ import annotations

from collections import OrderedDict

from protos.block_hash import BlockHash


class EvictionPolicy:
    def __init__(self) -> None:
        self._ephemeral: OrderedDict[BlockHash, None] = OrderedDict()
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()  # oldest first

    def add(self, key: BlockHash, *, ephemeral: bool) -> None:
        """Tracks `key` as the most recently used block of its class."""
        queue = self._ephemeral if ephemeral else self._lru
        queue[key] = None
        queue.move_to_end(key)

    def touch(self, key: BlockHash) -> None:
        for queue in (self._ephemeral, self._lru):
            if key in queue:
                queue.move_to_end(key)
                return

    def remove(self, key: BlockHash) -> None:
        self._ephemeral.pop(key, None)
        self._lru.pop(key, None)

    def victim(self) -> BlockHash | None:
        """The next block to evict, or None when nothing is evictable."""
        for queue in (self._ephemeral, self._lru):
            if queue:
                return next(iter(queue))
        return None

    def order(self) -> list[BlockHash]:
        """Every tracked block, next victim first (for tests and integrity checks)."""
        return [*self._ephemeral, *self._lru]

    def __contains__(self, key: object) -> bool:
        return key in self._ephemeral or key in self._lru

    def __len__(self) -> int:
        return len(self._ephemeral) + len(self._lru)
