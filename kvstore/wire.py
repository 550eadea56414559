"""Blocks on the wire: split into BlockChunks of at most 4 MiB, and put back together."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from kvserve.rpc.server import MAX_MESSAGE_BYTES
from kvstore.errors import BlockTooLarge, InvalidRequest
from kvstore.types import Buffer
from protos.block_hash import HASH_BYTES, BlockHash
from protos.kvserve.v1 import kvstore_pb2 as pb

CHUNK_BYTES = MAX_MESSAGE_BYTES


def split_block(key: BlockHash, payload: Buffer, checksum: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.BlockChunk]:
    """The chunks of one block; the first (offset 0) carries total size and checksum."""
    total = len(payload)
    if total <= chunk_bytes:
        yield pb.BlockChunk(hash=key, total_size=total, checksum=checksum, offset=0, data=bytes(payload))
        return
    view = memoryview(payload)
    for offset in range(0, total, chunk_bytes):
        piece = bytes(view[offset : offset + chunk_bytes])
        if offset == 0:
            yield pb.BlockChunk(hash=key, total_size=total, checksum=checksum, offset=0, data=piece)
        else:
            yield pb.BlockChunk(hash=key, offset=offset, data=piece)


class Assembled(NamedTuple):
    key: BlockHash
    payload: bytes | None  # None when the block lies in the shared-memory arena
    shm_offset: int | None
    total_size: int
    checksum: int


class BlockAssembler:
    """Feeds chunks in stream order; returns each block once its last chunk arrives.

    Raises InvalidRequest for inconsistent chunking and BlockTooLarge for a block larger than
    `max_block_bytes` (checked on its first chunk, before any payload is buffered).
    """

    def __init__(self, max_block_bytes: int, limit: str | None = None) -> None:
        """`limit` names what bounds a block, for the message (default: the largest tier)."""
        self.max_block_bytes = max_block_bytes
        self.limit = limit or f"the largest tier ({max_block_bytes} bytes)"
        self._head: pb.BlockChunk | None = None
        self._buf: bytearray | None = None
        self._received = 0

    @property
    def in_block(self) -> bool:
        return self._head is not None

    def feed(self, chunk: pb.BlockChunk) -> Assembled | None:
        if self._head is None:
            return self._start(chunk)
        head = self._head
        if chunk.hash != head.hash:
            raise InvalidRequest(f"block {head.hash.hex()[:16]} ended after {self._received} of {head.total_size} bytes")
        if chunk.offset != self._received or not chunk.data or self._received + len(chunk.data) > head.total_size:
            raise InvalidRequest(
                f"chunk at offset {chunk.offset} with {len(chunk.data)} bytes does not follow "
                f"{self._received} of {head.total_size} bytes of block {head.hash.hex()[:16]}"
            )
        assert self._buf is not None
        self._buf += chunk.data  # memory grows with the bytes received, never with a size merely claimed
        self._received += len(chunk.data)
        return self._finish_if_whole()

    def finish(self) -> None:
        if self._head is not None:
            raise InvalidRequest(
                f"stream ended inside block {self._head.hash.hex()[:16]} "
                f"({self._received} of {self._head.total_size} bytes)"
            )

    def _start(self, chunk: pb.BlockChunk) -> Assembled | None:
        if len(chunk.hash) != HASH_BYTES:
            raise InvalidRequest(f"block hash must be {HASH_BYTES} bytes, got {len(chunk.hash)}")
        if chunk.offset != 0:
            raise InvalidRequest(f"first chunk of block {chunk.hash.hex()[:16]} has offset {chunk.offset}, not 0")
        if chunk.total_size == 0:
            raise InvalidRequest(f"block {chunk.hash.hex()[:16]} is empty")
        if chunk.total_size > self.max_block_bytes:
            raise BlockTooLarge(f"block of {chunk.total_size} bytes exceeds {self.limit}")
        if chunk.HasField("shm_offset"):
            if chunk.data:
                raise InvalidRequest("a chunk carries either data or shm_offset, not both")
            return Assembled(BlockHash(chunk.hash), None, chunk.shm_offset, chunk.total_size, chunk.checksum)
        if len(chunk.data) > chunk.total_size:
            raise InvalidRequest(f"chunk of {len(chunk.data)} bytes exceeds its block's total size {chunk.total_size}")
        if len(chunk.data) == chunk.total_size:
            return Assembled(BlockHash(chunk.hash), chunk.data, None, chunk.total_size, chunk.checksum)
        if not chunk.data:
            raise InvalidRequest(f"first chunk of block {chunk.hash.hex()[:16]} carries no data")
        self._head = chunk
        self._buf = bytearray(chunk.data)
        self._received = len(chunk.data)
        return None

    def _finish_if_whole(self) -> Assembled | None:
        head = self._head
        assert head is not None and self._buf is not None
        if self._received < head.total_size:
            return None
        block = Assembled(BlockHash(head.hash), bytes(self._buf), None, head.total_size, head.checksum)
        self._head, self._buf, self._received = None, None, 0
        return block
