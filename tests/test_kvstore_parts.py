"""Small parts of the store on their own: eviction policy, chunking, block format, leases, events."""

from __future__ import annotations

import pytest

from kvstore.block_format import (
    HEADER_BYTES,
    CorruptBlock,
    ForeignRecord,
    checksum,
    open_payload,
    pack_record,
    unpack_header,
)
from kvstore.errors import BlockTooLarge, InvalidRequest
from kvstore.events import EventHub, StoreEvent
from kvstore.eviction import EvictionPolicy
from kvstore.leases import LeaseTable
from kvstore.record_key import RecordKey
from kvstore.types import Tier
from kvstore.wire import BlockAssembler, split_block
from protos.kvserve.v1 import kvstore_pb2 as pb
from tests.kvstore_fixtures import FakeClock, key, payload


def test_policy_ephemeral_first_then_lru() -> None:
    policy = EvictionPolicy()
    for name, eph in [("a", False), ("t", True), ("b", False)]:
        policy.add(key(name), ephemeral=eph)
    policy.touch(key("a"))
    assert policy.order() == [key("t"), key("b"), key("a")]
    assert policy.victim() == key("t")
    policy.remove(key("t"))
    assert policy.victim() == key("b") and len(policy) == 2 and key("a") in policy
    policy.remove(key("b"))
    policy.remove(key("a"))
    assert policy.victim() is None


def test_split_and_reassemble_any_size() -> None:
    for size in (1, 10, 4096, 10_000):
        data = payload(size, size)
        chunks = list(split_block(key(size), data, checksum(data), chunk_bytes=4096))
        assert all(len(c.data) <= 4096 for c in chunks)
        assert len(chunks) == -(-size // 4096)
        asm = BlockAssembler(max_block_bytes=1 << 20)
        done = [b for c in chunks if (b := asm.feed(c)) is not None]
        asm.finish()
        assert [(b.key, b.payload, b.checksum) for b in done] == [(key(size), data, checksum(data))]


def test_assembler_rejects_inconsistent_chunks() -> None:
    head = pb.BlockChunk(hash=key(1), total_size=8, checksum=1, data=b"abcd")
    cases = [
        [pb.BlockChunk(hash=b"x" * 31, total_size=1, data=b"a")],
        [pb.BlockChunk(hash=key(1), total_size=8, offset=4, data=b"abcd")],
        [pb.BlockChunk(hash=key(1), total_size=0)],
        [pb.BlockChunk(hash=key(1), total_size=2, data=b"abc")],
        [head, pb.BlockChunk(hash=key(1), offset=3, data=b"defg")],
        [head, pb.BlockChunk(hash=key(1), offset=4, data=b"defgh")],
        [head, pb.BlockChunk(hash=key(2), offset=4, data=b"efgh")],
        [pb.BlockChunk(hash=key(1), total_size=4, data=b"ab", shm_offset=0)],
    ]
    for chunks in cases:
        asm = BlockAssembler(max_block_bytes=100)
        with pytest.raises(InvalidRequest):
            for c in chunks:
                asm.feed(c)
    with pytest.raises(BlockTooLarge):
        BlockAssembler(max_block_bytes=7).feed(head)
    asm = BlockAssembler(max_block_bytes=100)
    asm.feed(head)
    with pytest.raises(InvalidRequest, match="ended inside"):
        asm.finish()


@pytest.mark.parametrize("record_key", [None, RecordKey(b"k" * 32)], ids=["plaintext", "sealed"])
def test_block_header_detects_damage(record_key: RecordKey | None) -> None:
    data = b"payload"
    record = bytes(pack_record(key(1), data, checksum(data), record_key, ephemeral=True, seq=7))
    header = unpack_header(record, key(1), record_key)
    assert (header.size, header.seq, header.ephemeral) == (len(data), 7, True)
    assert open_payload(header, key(1), record[HEADER_BYTES:], record_key) == data
    damaged_payload = bytearray(record[HEADER_BYTES:])
    damaged_payload[1] ^= 1
    with pytest.raises(CorruptBlock) as damaged:  # sealed: it does not open (a ForeignRecord, a MAC failure)
        open_payload(header, key(1), damaged_payload, record_key)
    assert isinstance(damaged.value, ForeignRecord) == (record_key is not None)
    with pytest.raises(CorruptBlock):
        open_payload(header, key(1), record[HEADER_BYTES:-1], record_key)
    with pytest.raises(CorruptBlock):
        unpack_header(b"XXXX" + record[4:], key(1), record_key)
    with pytest.raises(CorruptBlock):
        unpack_header(record[:10], key(1), record_key)
    with pytest.raises(ForeignRecord):  # the same record under another key
        unpack_header(record, key(2), record_key)
    seq_changed = bytearray(record)
    seq_changed[24] ^= 1
    with pytest.raises(ForeignRecord):
        unpack_header(seq_changed, key(1), record_key)


def test_lease_table_expires_in_ttl_order() -> None:
    clock = FakeClock()
    table = LeaseTable(clock)
    short = table.add([], 1.0)
    long = table.add([], 5.0)
    clock.advance(1.0)
    assert [lease.lease_id for lease in table.expired()] == [short.lease_id]
    assert table.pop(short.lease_id) is None
    clock.advance(4.0)
    assert [lease.lease_id for lease in table.expired()] == [long.lease_id]
    assert len(table) == 0


def test_slow_subscriber_drops_oldest_events() -> None:
    hub = EventHub(queue_len=3)
    sub = hub.subscribe()
    for i in range(5):
        hub.publish(StoreEvent(True, key(i), Tier.HOST))
    assert [e.key for e in sub.take(0)] == [key(2), key(3), key(4)]
    assert sub.dropped == 2
    sub.close()
    hub.publish(StoreEvent(False, key(9), None))
    assert sub.take(0) == []


def test_a_block_claiming_a_huge_size_costs_only_the_bytes_received() -> None:
    import tracemalloc

    assembler = BlockAssembler(1 << 40)
    tracemalloc.start()
    try:
        assert assembler.feed(pb.BlockChunk(hash=key(1), total_size=1 << 30, data=b"x")) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # a 1-byte chunk claiming 1 GiB used to allocate the whole GiB
