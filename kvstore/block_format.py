"""The stored form of a block, on disk, in shared memory and in the remote tier: a small header, then
the payload.

Header (32 bytes, little endian): magic b"KVSR" (KV store record), flags u32, xxh3-64 checksum u64,
payload size u64, write sequence u64 (restores LRU order after a restart).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

RECORD_MAGIC = b"KVSR"
RECORD_VERSION = 1  # of this layout; a change bumps it (the remote tier's keys carry it: no old record is read as new)
_HEADER = struct.Struct("<4sIQQQ")
HEADER_BYTES = _HEADER.size
FLAG_EPHEMERAL = 1


def checksum(payload: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of a payload: the checksum carried by BlockChunk.checksum."""
    return xxhash.xxh3_64_intdigest(payload)


class BlockHeader(NamedTuple):
    flags: int
    checksum: int
    size: int
    seq: int

    @property
    def ephemeral(self) -> bool:
        return bool(self.flags & FLAG_EPHEMERAL)


class CorruptBlock(ValueError):
    """A stored block whose header or checksum does not match its payload."""


def pack_header(size: int, checksum_: int, *, ephemeral: bool = False, seq: int = 0) -> bytes:
    return _HEADER.pack(RECORD_MAGIC, FLAG_EPHEMERAL if ephemeral else 0, checksum_, size, seq)


def unpack_header(data: bytes | memoryview) -> BlockHeader:
    if len(data) < HEADER_BYTES:
        raise CorruptBlock(f"block record of {len(data)} bytes is shorter than its header")
    magic, flags, csum, size, seq = _HEADER.unpack_from(data)
    if magic != RECORD_MAGIC:
        raise CorruptBlock(f"not a kvserve store record (magic {magic!r})")
    return BlockHeader(flags, csum, size, seq)


def verify(header: BlockHeader, payload: bytes | memoryview) -> None:
    if len(payload) != header.size:
        raise CorruptBlock(f"payload is {len(payload)} bytes, header says {header.size}")
    if checksum(payload) != header.checksum:
        raise CorruptBlock("payload checksum does not match its header")


def pack_record(payload: bytes | bytearray | memoryview, checksum_: int) -> bytes:
    """Header and payload as one value (the remote tier's)."""
    return b"".join((pack_header(len(payload), checksum_), payload))


def unpack_record(data: bytes | memoryview) -> tuple[memoryview, int]:
    """The verified payload of a record and its checksum; raises CorruptBlock."""
    view = memoryview(data)
    header = unpack_header(view)
    payload = view[HEADER_BYTES:]
    verify(header, payload)
    return payload, header.checksum
