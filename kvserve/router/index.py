"""Which blocks each decode replica holds, as its Events say (docs/DESIGN.md, "Router"): two indexes of block
hashes, its node's store and its engine's KV pool, capped in entries and in bytes so that a replica can neither
steer placement nor grow the router by what it sends. One that lies is distrusted: all it said is dropped until
it is heard again. No gRPC here: plain bytes in, tested in milliseconds."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from protos.block_hash import BlockHash
from protos.bounds import Lie
from protos.kvserve.v1 import kvstore_pb2

# What one entry of a BlockIndex costs past its hash's own bytes: the hash's bytes object (33 bytes of
# header, 80 in all with pymalloc's rounding for a 32-byte hash) and its dict slot (37-60 bytes measured
# between resizes, CPython 3.11), rounded up.
ENTRY_BYTES = 128
# A replica's two indexes together (half each): 419,430 blocks an index at 32 + 128 bytes, 6.7 M tokens
# at 16 a block, more than an 8B model's KV pool on an H200 (~50 k blocks); 8 replicas cost 1 GiB at most,
# whatever they send.
INDEX_BYTES = 128 << 20


class BlockIndex:
    """The block hashes one replica's node holds, oldest first: at most `capacity` of them and `capacity_bytes`
    (`nbytes`: each hash's length + ENTRY_BYTES), the oldest forgotten."""

    def __init__(self, capacity: int, capacity_bytes: int = INDEX_BYTES // 2) -> None:
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self.nbytes = 0
        self._blocks: dict[BlockHash, None] = {}
        self._lock = threading.Lock()

    def add(self, hashes: Sequence[bytes]) -> None:
        with self._lock:
            for h in hashes:
                if h in self._blocks:
                    del self._blocks[BlockHash(h)]  # seen again: now the newest
                else:
                    self.nbytes += len(h) + ENTRY_BYTES
                self._blocks[BlockHash(h)] = None
            while self._blocks and (len(self._blocks) > self.capacity or self.nbytes > self.capacity_bytes):
                oldest = next(iter(self._blocks))
                del self._blocks[oldest]
                self.nbytes -= len(oldest) + ENTRY_BYTES

    def remove(self, hashes: Sequence[bytes]) -> None:
        with self._lock:
            for h in hashes:
                if h in self._blocks:
                    del self._blocks[BlockHash(h)]
                    self.nbytes -= len(h) + ENTRY_BYTES

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.nbytes = 0

    def __contains__(self, h: BlockHash) -> bool:
        return h in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)


class Holdings:
    """One replica's blocks: `store` (its node's store) and `pool` (its engine's KV pool), each at most
    `capacity` entries and `capacity_bytes`; `lie`, why none of it is believed, until `trust_again`."""

    def __init__(self, capacity: int, capacity_bytes: int) -> None:
        self.store = BlockIndex(capacity, capacity_bytes)
        self.pool = BlockIndex(capacity, capacity_bytes)
        self.lie: Lie | None = None
        self._bounds = (capacity, capacity_bytes)
        self._lock = threading.Lock()  # what it claimed is added under it too: none of it outlives a lie

    @property
    def trusted(self) -> bool:
        return self.lie is None

    @property
    def nbytes(self) -> int:
        return self.store.nbytes + self.pool.nbytes

    def leading(self, hashes: Sequence[BlockHash]) -> int:
        """How many of the leading `hashes` the replica holds, in its pool or its node's store; 0 when it lied."""
        if self.lie is not None:
            return 0
        n = 0
        for h in hashes:
            if h not in self.pool and h not in self.store:
                break
            n += 1
        return n

    def learned(self, hashes: Sequence[BlockHash]) -> None:
        """A request whose prompt has `hashes` was sent there: the replica will hold its blocks."""
        with self._lock:
            if self.lie is None:
                self.store.add(hashes)

    def apply(self, event: kvstore_pb2.Event, snapshot: bool = False) -> bool:
        """Adds or removes what a checked event names; False (nothing done) once the replica has lied. The
        first event of a stream (`snapshot`) begins its pool anew: the new index takes the old one's place
        once it holds that event's hashes, so the pool never looks empty in between."""
        index = self.pool if event.tier == kvstore_pb2.TIER_ENGINE else self.store
        with self._lock:
            if self.lie is not None:
                return False
            if snapshot and event.tier == kvstore_pb2.TIER_ENGINE:
                fresh = BlockIndex(*self._bounds)
                if event.kind == kvstore_pb2.Event.KIND_STORED:
                    fresh.add(event.hashes)
                self.pool = fresh
            elif event.kind == kvstore_pb2.Event.KIND_STORED:
                index.add(event.hashes)
            else:
                index.remove(event.hashes)
        return True

    def distrust(self, lie: Lie) -> bool:
        """Drops all the replica claimed, since it lied; False when it was distrusted already."""
        with self._lock:
            if self.lie is not None:
                return False
            self.lie = lie.with_traceback(None)  # whose frames hold the message that lied
            self.store.clear()
            self.pool.clear()
        return True

    def trust_again(self) -> None:
        """Its events are followed again, from empty indexes."""
        with self._lock:
            self.store.clear()
            self.pool.clear()
            self.lie = None
