"""The bookkeeping of the paged KV cache's blocks: reference counts, a free list, and the blocks of
finished sequences kept by hash for reuse (automatic prefix caching). No tensors: the KV itself is
in engine.kv_cache.

A block is in exactly one state:
- free: no owner, no hash; on the free list, or never used yet (fresh: its memory not yet touched);
- used: owned by one or more sequences (reference count > 0);
- cached: no owner but holds the KV of a known prefix hash; reused by a later sequence that
  asks for the same hash, or evicted (least recently freed first) when free blocks run out.

Every operation is O(1) per block. Only the engine's thread calls it.

Fresh blocks are taken lowest first, before the free list, so a pool touches the least memory it can for what
it holds. With ``keep_cached``, a pool touches a fresh block only where no free block is left and fewer than
``keep_cached`` blocks are cached; else it evicts: its resident memory then follows the peak of the blocks in
use (plus ``keep_cached``), not its size (the services' pools, whose store keeps what they evict). ``release``
makes an idle pool fresh again, so that its memory can be given back (engine.kv_cache.KVCache.release).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from protos.block_hash import BlockHash


class PoolExhausted(RuntimeError):
    """More blocks were asked for than are free or evictable; the scheduler checks before it asks."""


@dataclass(frozen=True, slots=True)
class PoolState:
    """A copy of a pool's bookkeeping, as ``check_pool_state`` reads it (``BlockPool.state``)."""

    num_blocks: int
    fresh: int  # blocks fresh.. have never been taken
    free: tuple[int, ...]  # the free list, in order
    cached: tuple[int, ...]  # oldest first
    refs: tuple[int, ...]  # per block
    hashes: tuple[BlockHash | None, ...]  # per block
    by_hash: Mapping[BlockHash, int]


def check_pool_state(s: PoolState) -> None:
    """Raises AssertionError unless free + used + cached == total and every index agrees."""
    free, cached = set(s.free) | set(range(s.fresh, s.num_blocks)), set(s.cached)
    assert len(set(s.free)) == len(s.free), "a block is on the free list twice"
    assert all(b < s.fresh for b in s.free), "a fresh block is on the free list"
    assert not free & cached, "a block is both free and cached"
    used = {b for b in range(s.num_blocks) if s.refs[b] > 0}
    assert not used & (free | cached), "a block in use is also free or cached"
    assert len(free) + len(cached) + len(used) == s.num_blocks, (
        f"free {len(free)} + cached {len(cached)} + used {len(used)} != {s.num_blocks}"
    )
    assert all(s.hashes[b] is None for b in free), "a free block keeps a hash"
    assert all(s.hashes[b] is not None for b in cached), "a cached block has no hash"
    assert all(s.hashes[b] == h for h, b in s.by_hash.items()), "hash index disagrees with blocks"
    assert sum(h is not None for h in s.hashes) == len(s.by_hash), "a block hash is not indexed"


class BlockPool:
    def __init__(self, num_blocks: int, keep_cached: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._by_hash: dict[BlockHash, int] = {}
        self._fresh = 0  # blocks _fresh.. have never been taken
        self._free: deque[int] = deque()
        self.keep_cached = keep_cached
        self._cached: OrderedDict[int, None] = OrderedDict()  # oldest first: evicted first
        self.num_evicted = 0
        # With ``record_changes``, the hashes named and evicted since ``take_changes`` (e.g. for a router
        # that places requests where their blocks are).
        self.record_changes = False
        self._named: list[BlockHash] = []
        self._evicted: list[BlockHash] = []

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_blocks - self._fresh

    @property
    def num_touched(self) -> int:
        """Blocks ever taken: the pool's memory in use (the rest may never have been touched)."""
        return self._fresh

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - len(self._cached)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take: free ones, then cached ones (evicting them)."""
        return self.num_free + len(self._cached)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for one owner (reference count 1), evicting cached blocks when no free one is left."""
        if n > self.num_available:
            raise PoolExhausted(f"{n} blocks asked for, {self.num_available} of {self.num_blocks} available")
        blocks = []
        for _ in range(n):
            fresh = self._fresh < self.num_blocks
            if fresh and (self.keep_cached is None or (not self._free and len(self._cached) < self.keep_cached)):
                block = self._fresh
                self._fresh += 1
            elif self._free:
                block = self._free.popleft()
            elif not self._cached:
                block = self._fresh
                self._fresh += 1
            else:
                block, _ = self._cached.popitem(last=False)
                evicted = self._hash[block]
                assert evicted is not None
                del self._by_hash[evicted]
                self._hash[block] = None
                self.num_evicted += 1
                if self.record_changes:
                    self._evicted.append(evicted)
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def count_hits(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading ``hashes`` the pool holds, without taking them."""
        n = 0
        for h in hashes:
            if h not in self._by_hash:
                break
            n += 1
        return n

    def take_hits(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks of the leading ``hashes`` the pool holds, each with one more reference."""
        blocks = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._cached[block]
            self._refs[block] += 1
            blocks.append(block)
        return blocks

    def take_changes(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(hashes named, hashes evicted) since the last call, when ``record_changes`` is on, as the pool holds
        them now: a hash evicted and named again since (or named, then evicted) is only where it ended, since
        the two lists do not say in which order it happened."""
        held = self._by_hash
        named = [h for h in dict.fromkeys(self._named) if h in held]
        evicted = [h for h in dict.fromkeys(self._evicted) if h not in held]
        self._named, self._evicted = [], []
        return named, evicted

    def retain(self, blocks: Iterable[int]) -> None:
        """One more reference to each block in use (e.g. until its KV has been copied out)."""
        for block in blocks:
            assert self._refs[block] > 0, f"block {block} is not in use"
            self._refs[block] += 1

    def register(self, block: int, block_hash: BlockHash) -> None:
        """``block`` (used, now full) holds the KV of ``block_hash``. A hash already held by another block
        keeps that one; this block then stays unnamed and is freed plainly."""
        assert self._refs[block] > 0, f"block {block} is not in use"
        if self._hash[block] is None and block_hash not in self._by_hash:
            self._hash[block] = block_hash
            self._by_hash[block_hash] = block
            if self.record_changes:
                self._named.append(block_hash)

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block. Give a sequence's blocks in order: they are released in
        reverse, so the tail of a prefix is evicted before its head."""
        for block in reversed(list(blocks)):
            refs = self._refs[block] - 1
            assert refs >= 0, f"block {block} freed more often than taken"
            self._refs[block] = refs
            if refs:
                continue
            if self._hash[block] is None:
                self._free.append(block)
            else:
                self._cached[block] = None

    def release(self) -> int:
        """Evicts every cached block and takes every block as fresh again, where no block is in use (else does
        nothing): the blocks touched until now, returned, may have their memory given back."""
        if self.num_used:
            return 0
        for block in self._cached:
            evicted = self._hash[block]
            assert evicted is not None
            del self._by_hash[evicted]
            self._hash[block] = None
            if self.record_changes:
                self._evicted.append(evicted)
        self.num_evicted += len(self._cached)
        self._cached.clear()
        self._free.clear()
        touched, self._fresh = self._fresh, 0
        return touched

    def state(self) -> PoolState:
        """A copy of the bookkeeping, for ``check_integrity`` and for tests."""
        return PoolState(self.num_blocks, self._fresh, tuple(self._free), tuple(self._cached), tuple(self._refs),
                         tuple(self._hash), dict(self._by_hash))

    def check_integrity(self) -> None:
        """Raises AssertionError unless free + used + cached == total and every index agrees."""
        check_pool_state(self.state())
