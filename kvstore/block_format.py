"""The stored form of a block, in the disk tier (LMDB) and the remote tier (Redis): a header, then the payload.

Header (76 bytes, little endian): magic b"KVSR" (KV store record), layout version u16, flags u16, xxh3-64 of
the payload u64, payload size u64, write sequence u64 (restores LRU order after a restart), nonce (12 bytes),
tag (32 bytes). The tag binds the header to the block hash it is stored under: a record moved to another hash,
forged, or written under another record key is a `ForeignRecord`, a miss.
- With a record key (kvstore/record_key.py) the record is sealed: the payload is AES-256-GCM ciphertext (and
  its 16-byte tag) under a key of the block hash's own, with a random nonce and the header's fields and the
  block hash as associated data; the checksum field is 0 (an xxh3 of the KV in the clear would let a reader
  who guesses a prompt confirm it). The header's tag is HMAC-SHA256 of its fields, then the block hash: the
  header alone is checked when the disk tier is indexed at start, the payload opened on every read. Whoever
  reads a tier sees hashes, sizes and write order, and no byte of KV.
- Without one (plaintext, `--insecure`): nonce zero, the payload as it is, tag = xxh3-128 of the same. A
  record moved between hashes is still a miss, but whoever can read a tier reads the KV (and with the public
  weights, the prompts), and whoever can write it can forge a record: the documented limits of plaintext mode.

The tag covers the block hash alone because that is the store's whole key: the hash already commits to the
namespace (model, KV dtype, block size, cache salt: kvserve/engine/hashing.py), and the remote tier's key prefix only
keeps deployments' keys apart in one Redis (a record copied between prefixes is the same block).

The host and device tiers keep no records: which block a slot holds, and its checksum, live in the store's
memory, and their shared memory is mapped only by processes of the store's user (kvstore/arena.py), which may
put any block anyway and could read the record key; a changed slot fails its checksum.
"""

from __future__ import annotations

import hmac
import secrets
import struct
from typing import NamedTuple

import xxhash

from kvstore.record_key import NONCE_BYTES, SEAL_BYTES, TAG_BYTES, RecordKey
from kvstore.types import Buffer

RECORD_MAGIC = b"KVSR"
RECORD_VERSION = 3  # of this layout; a change bumps it (the remote tier's keys carry it: no old record is read as new)
_FIELDS = struct.Struct(f"<4sHHQQQ{NONCE_BYTES}s")  # what the tag covers, before the block hash
_HEADER = struct.Struct(f"<{_FIELDS.size}s{TAG_BYTES}s")
HEADER_BYTES = _HEADER.size
FLAG_EPHEMERAL = 1
_NO_NONCE = bytes(NONCE_BYTES)


def checksum(payload: Buffer) -> int:
    """xxh3-64 of a payload: the checksum carried by BlockChunk.checksum."""
    return xxhash.xxh3_64_intdigest(payload)


class BlockHeader(NamedTuple):
    flags: int
    checksum: int  # 0 in a sealed record: the store takes it from the opened payload
    size: int  # of the payload in the clear
    seq: int
    nonce: bytes = _NO_NONCE
    fields: bytes = b""  # as stored, the associated data of a sealed payload

    @property
    def ephemeral(self) -> bool:
        return bool(self.flags & FLAG_EPHEMERAL)


class CorruptBlock(ValueError):
    """A stored block whose header or checksum does not match its payload (damage, or an older layout)."""


class ForeignRecord(CorruptBlock):
    """A record the store did not write under this block hash: moved from another, forged, or written under
    another record key (another deployment). Counted as a MAC failure."""


def record_bytes(size: int, record_key: RecordKey | None) -> int:
    """The length of the record of a `size`-byte payload."""
    return HEADER_BYTES + size + (0 if record_key is None else SEAL_BYTES)


def _tag(fields: bytes, key: bytes, record_key: RecordKey | None) -> bytes:
    if record_key is None:
        return xxhash.xxh3_128_digest(fields + key).ljust(TAG_BYTES, b"\0")
    return record_key.tag(fields + key)


def pack_record(key: bytes, payload: Buffer, checksum_: int, record_key: RecordKey | None, *,
                ephemeral: bool = False, seq: int = 0) -> bytearray:
    """The record of `payload` stored under block hash `key`: one copy of the payload, encrypted on the way
    with a record key (call it outside the store's lock)."""
    size = memoryview(payload).nbytes
    sealed = record_key is not None
    nonce = secrets.token_bytes(NONCE_BYTES) if sealed else _NO_NONCE
    fields = _FIELDS.pack(RECORD_MAGIC, RECORD_VERSION, FLAG_EPHEMERAL if ephemeral else 0, 0 if sealed else checksum_,
                          size, seq, nonce)
    out = bytearray(record_bytes(size, record_key))
    out[:HEADER_BYTES] = fields + _tag(fields, key, record_key)
    if record_key is None:
        out[HEADER_BYTES:] = payload
    else:
        record_key.seal_into(memoryview(out)[HEADER_BYTES:], key, nonce, payload, fields + key)
    return out


def unpack_header(data: Buffer, key: bytes, record_key: RecordKey | None) -> BlockHeader:
    """The header at the start of `data`, checked to be this store's for block hash `key` (its payload is not
    read: see `open_payload`). Raises CorruptBlock, or ForeignRecord when the tag does not match."""
    view = memoryview(data)
    if len(view) < HEADER_BYTES:
        raise CorruptBlock(f"block record of {len(view)} bytes is shorter than its header")
    fields, tag = _HEADER.unpack_from(view)
    magic, version, flags, csum, size, seq, nonce = _FIELDS.unpack(fields)
    if magic != RECORD_MAGIC:
        raise CorruptBlock(f"not a kvserve store record (magic {magic!r})")
    if version != RECORD_VERSION:  # an older layout (2: payloads in the clear, under a BLAKE3 digest)
        raise CorruptBlock(f"a record of layout {version}, this store reads {RECORD_VERSION}")
    if not hmac.compare_digest(tag, _tag(fields, key, record_key)):
        raise ForeignRecord("its tag does not match its block hash: moved, forged, or written under another record key")
    return BlockHeader(flags, csum, size, seq, nonce, fields)


def open_payload(header: BlockHeader, key: bytes, body: Buffer, record_key: RecordKey | None) -> bytes:
    """The payload of a record whose (checked) header is `header` and whose bytes after it are `body`, as new
    bytes: opened with a record key (ForeignRecord: not what was sealed under this block hash), else checked
    against its size and checksum (CorruptBlock)."""
    body = memoryview(body)
    if len(body) != record_bytes(header.size, record_key) - HEADER_BYTES:
        raise CorruptBlock(f"payload is {len(body)} bytes, its header says {header.size}")
    if record_key is not None:
        try:
            return record_key.open(key, header.nonce, body, header.fields + key)
        except ValueError as exc:
            raise ForeignRecord(str(exc)) from None
    if checksum(body) != header.checksum:
        raise CorruptBlock("payload checksum does not match its header")
    return bytes(body)


def unpack_record(key: bytes, data: Buffer, record_key: RecordKey | None) -> tuple[bytes, int]:
    """The payload of the record stored under `key`, opened and verified, and its checksum; raises CorruptBlock
    or ForeignRecord."""
    view = memoryview(data)
    header = unpack_header(view, key, record_key)
    payload = open_payload(header, key, view[HEADER_BYTES:], record_key)
    return payload, header.checksum or checksum(payload)
