"""The stored form of a block, in the disk tier (LMDB) and the remote tier (Redis): a header, then the payload.

Header (96 bytes, little endian): magic b"KVSR" (KV store record), layout version u16, flags u16, xxh3-64 of
the payload u64, payload size u64, write sequence u64 (restores LRU order after a restart), digest (32 bytes),
tag (32 bytes). The tag binds the record to the block hash it is stored under: a record moved to another
hash, forged, or written under another record key is a `ForeignRecord`, a miss.
- With a record key (kvstore/record_key.py): digest = BLAKE3 of the payload, tag = HMAC-SHA256 of the
  header's fields before the tag, then the block hash. The header alone is checked when the disk tier is
  indexed at start; the payload against its digest on every read.
- Without one (plaintext): digest zero, tag = xxh3-128 of the same. A record moved between hashes is still a
  miss, but whoever can write a tier can forge a record: the documented limit of plaintext mode.

The tag covers the block hash alone because that is the store's whole key: the hash already commits to the
namespace (model, KV dtype, block size, cache salt: engine/hashing.py), and the remote tier's key prefix only
keeps deployments' keys apart in one Redis (a record copied between prefixes is the same block).

The host and device tiers keep no records: which block a slot holds, and its checksum, live in the store's
memory, and their shared memory is mapped only by processes of the store's user (kvstore/arena.py), which may
put any block anyway and could read the record key; a changed slot fails its checksum.
"""

from __future__ import annotations

import hmac
import struct
from typing import NamedTuple

import xxhash

from kvstore.record_key import TAG_BYTES, RecordKey
from kvstore.types import Buffer

RECORD_MAGIC = b"KVSR"
RECORD_VERSION = 2  # of this layout; a change bumps it (the remote tier's keys carry it: no old record is read as new)
_FIELDS = struct.Struct("<4sHHQQQ32s")  # what the tag covers, before the block hash
_HEADER = struct.Struct(f"<{_FIELDS.size}s{TAG_BYTES}s")
HEADER_BYTES = _HEADER.size
FLAG_EPHEMERAL = 1
_NO_DIGEST = bytes(32)


def checksum(payload: Buffer) -> int:
    """xxh3-64 of a payload: the checksum carried by BlockChunk.checksum."""
    return xxhash.xxh3_64_intdigest(payload)


class BlockHeader(NamedTuple):
    flags: int
    checksum: int
    size: int
    seq: int
    digest: bytes = _NO_DIGEST

    @property
    def ephemeral(self) -> bool:
        return bool(self.flags & FLAG_EPHEMERAL)


class CorruptBlock(ValueError):
    """A stored block whose header or checksum does not match its payload (damage, or an older layout)."""


class ForeignRecord(CorruptBlock):
    """A record the store did not write under this block hash: moved from another, forged, or written under
    another record key (another deployment). Counted as a MAC failure."""


def _tag(fields: bytes, key: bytes, record_key: RecordKey | None) -> bytes:
    if record_key is None:
        return xxhash.xxh3_128_digest(fields + key).ljust(TAG_BYTES, b"\0")
    return record_key.tag(fields + key)


def pack_header(key: bytes, payload: Buffer, checksum_: int, record_key: RecordKey | None, *,
                ephemeral: bool = False, seq: int = 0) -> bytes:
    """The header of `payload` stored under block hash `key`. With a record key this reads the whole payload
    (its digest): call it outside the store's lock."""
    digest = _NO_DIGEST if record_key is None else record_key.digest(payload)
    fields = _FIELDS.pack(RECORD_MAGIC, RECORD_VERSION, FLAG_EPHEMERAL if ephemeral else 0, checksum_, len(payload),
                          seq, digest)
    return fields + _tag(fields, key, record_key)


def unpack_header(data: Buffer, key: bytes, record_key: RecordKey | None) -> BlockHeader:
    """The header at the start of `data`, checked to be this store's for block hash `key` (its payload is not
    read: see `verify`). Raises CorruptBlock, or ForeignRecord when the tag does not match."""
    view = memoryview(data)
    if len(view) < HEADER_BYTES:
        raise CorruptBlock(f"block record of {len(view)} bytes is shorter than its header")
    fields, tag = _HEADER.unpack_from(view)
    magic, version, flags, csum, size, seq, digest = _FIELDS.unpack(fields)
    if magic != RECORD_MAGIC:
        raise CorruptBlock(f"not a kvserve store record (magic {magic!r})")
    if version != RECORD_VERSION:  # layout 1 kept flags (0 or 1) where the version is now
        raise CorruptBlock(f"a record of layout {version}, this store reads {RECORD_VERSION}")
    if not hmac.compare_digest(tag, _tag(fields, key, record_key)):
        raise ForeignRecord("its tag does not match its block hash: moved, forged, or written under another record key")
    return BlockHeader(flags, csum, size, seq, digest)


def verify(header: BlockHeader, payload: Buffer, record_key: RecordKey | None) -> None:
    """Checks a payload against its (checked) header: size and checksum (CorruptBlock), then with a record key
    its digest (ForeignRecord: a payload the store did not write)."""
    if len(payload) != header.size:
        raise CorruptBlock(f"payload is {len(payload)} bytes, header says {header.size}")
    if checksum(payload) != header.checksum:
        raise CorruptBlock("payload checksum does not match its header")
    if record_key is not None and not hmac.compare_digest(record_key.digest(payload), header.digest):
        raise ForeignRecord("payload does not match the digest its tag covers")


def pack_record(key: bytes, payload: Buffer, checksum_: int, record_key: RecordKey | None) -> bytes:
    """Header and payload as one value (the remote tier's)."""
    return b"".join((pack_header(key, payload, checksum_, record_key), payload))


def unpack_record(key: bytes, data: Buffer, record_key: RecordKey | None) -> tuple[memoryview, int]:
    """The verified payload of the record stored under `key`, and its checksum; raises CorruptBlock or
    ForeignRecord."""
    view = memoryview(data)
    header = unpack_header(view, key, record_key)
    payload = view[HEADER_BYTES:]
    verify(header, payload, record_key)
    return payload, header.checksum
