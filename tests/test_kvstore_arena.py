"""The shared-memory arena: slab slots, the fd hand-out, and what other processes cannot break."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import grpc
import pytest

from kvstore import KVStoreClient, arena
from kvstore.arena import Arena, ArenaSocket
from kvstore.arena_map import ArenaMap
from kvstore.block_format import checksum
from kvstore.slab import PAGE_BYTES, SlabAllocator, slot_bytes
from protos.kvserve.v1 import kvstore_pb2 as pb
from tests.kvstore_fixtures import key, payload, run_in_threads, running_server
from tests.polling import wait_until

MiB = 1024 * 1024


def test_slots_of_one_size_fill_the_buffer_then_reuse_the_oldest_free_first() -> None:
    slots = SlabAllocator(3 * PAGE_BYTES)
    size = 256 * 1024 + 64  # a tiny-llama block: its slot is its size rounded to 64 bytes
    assert slot_bytes(size) == size
    offsets = []
    while (offset := slots.alloc(size)) is not None:
        offsets.append(offset)
    assert len(set(offsets)) == 31  # one run of two pages (at least 16 slots a run), 3% unused
    assert not slots.has_room(size) and slots.has_room(100)  # the third page is still free
    slots.free(offsets[3])
    slots.free(offsets[7])
    assert slots.alloc(size) == offsets[3] and slots.alloc(size) == offsets[7]


def test_an_empty_run_goes_back_for_another_size() -> None:
    slots = SlabAllocator(PAGE_BYTES)
    small = [slots.alloc(1000) for _ in range(10)]
    assert all(o is not None for o in small)
    assert not slots.has_room(PAGE_BYTES)  # the only page holds the small slots
    for o in small[:-1]:
        slots.free(o)  # type: ignore[arg-type]
    assert not slots.has_room(PAGE_BYTES)  # one slot still in use holds the run
    slots.free(small[-1])  # type: ignore[arg-type]
    big = slots.alloc(PAGE_BYTES)
    assert big == 0 and slots.slot_size(big) == PAGE_BYTES
    assert slots.alloc(1000) is None


def test_a_block_larger_than_the_buffer_has_no_room() -> None:
    slots = SlabAllocator(PAGE_BYTES)
    assert not slots.has_room(PAGE_BYTES + 1) and slots.alloc(PAGE_BYTES + 1) is None


def test_the_segment_cannot_be_resized_by_anyone(tmp_path: Path) -> None:
    # Truncating a mapped file is what turns a reader's next access into SIGBUS: the arena's
    # seals refuse it, to the store itself and to a client holding the fd it was handed.
    arena = Arena(PAGE_BYTES)
    served = ArenaSocket(arena, tmp_path / "arena.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(served.path))
        _, fds, _, _ = socket.recv_fds(s, 4096, 1)
    try:
        for fd in (arena.fd, fds[0]):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 2 * PAGE_BYTES)
    finally:
        os.close(fds[0])
        served.close()
        arena.close()


def test_an_arena_in_a_folder_deeper_than_a_socket_address_is_served(tmp_path: Path) -> None:
    # sun_path holds 107 bytes: a data dir deeper than that (a long --data-dir, pytest-xdist's tmp_path)
    # made the store fail to start with "AF_UNIX path too long".
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    arena = Arena(PAGE_BYTES)
    served = ArenaSocket(arena, deep / "arena.sock")
    try:
        assert len(str(served.path)) > 107 and served.path.exists()
        opened = ArenaMap(served.path)
        assert opened.size == PAGE_BYTES
        opened.close()
    finally:
        served.close()
        arena.close()


def test_a_socket_that_is_not_an_arena_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "impostor.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(1)
        with pytest.raises(OSError):
            ArenaMap(path, timeout_s=0.5)  # accepts, says nothing: a timeout, then bytes over gRPC
    with pytest.raises(OSError):
        ArenaMap(tmp_path / "absent.sock")


def test_garbage_written_into_a_slot_is_a_miss_and_counted(tmp_path: Path) -> None:
    with running_server(tmp_path) as server, KVStoreClient(server.address) as c:
        assert c.shm_dir() is not None
        c.put([(key(1), payload(1, 5000)), (key(2), payload(2, 5000))])
        shm = server.store.shm_tier
        assert shm is not None
        offset, size, _ = shm.slot(key(1))  # type: ignore[misc]
        shm.arena.view[offset : offset + size] = b"\0" * size  # another process scribbles on it
        assert c.get([key(1), key(2)]) == [None, payload(2, 5000)]
        assert c.stats().checksum_failures == 1 and c.lookup([key(1)]).num_hits == 0
        c.put([(key(1), payload(1, 5000))])  # the real block can be stored again
        assert c.get([key(1)]) == [payload(1, 5000)]
        server.store.check_integrity()


def test_same_host_readers_and_writers_in_threads_get_exact_bytes(tmp_path: Path) -> None:
    # A small host tier: puts evict and slots are reused while other threads copy out of them.
    config = dict(host_capacity=1 * MiB, disk_capacity=32 * MiB, disk_path=tmp_path / "db")
    with running_server(tmp_path, **config) as server:

        def work(t: int) -> None:
            with KVStoreClient(server.address, timeout_s=30) as c:
                for round_ in range(8):
                    blocks = [(key(f"{t}-{round_}-{i}"), payload(f"{t}-{round_}-{i}", 30_000)) for i in range(6)]
                    assert c.put(blocks) == 6
                    got = c.get([k for k, _ in blocks] + [key(f"{(t + 1) % 4}-{round_}-0")])
                    assert got[:6] == [p for _, p in blocks]
                    assert got[6] in (None, payload(f"{(t + 1) % 4}-{round_}-0", 30_000))
                    bufs = [memoryview(bytearray(30_000)) for _ in blocks]
                    assert c.get_into([k for k, _ in blocks], bufs) == [30_000] * 6
                    assert [bytes(b) for b in bufs] == [p for _, p in blocks]

        run_in_threads(work, 4)
        server.store.check_integrity()
        assert server.store.stats().checksum_failures == 0


def test_a_put_with_a_bad_hash_gets_the_grpc_status_and_reserves_nothing(tmp_path: Path) -> None:
    with running_server(tmp_path) as server, KVStoreClient(server.address) as c:
        good = (key(1), payload(1, 5000))
        with pytest.raises(grpc.RpcError) as info:  # the second block's hash is malformed
            c.put([good, (b"short", payload(2, 5000))])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # refused on the arena channel, then by gRPC
        assert not server.store.reserved_bytes
        assert c.put([good]) == 0  # blocks go in prefix order: the one before the bad one was stored
        assert checksum(c.get([key(1)])[0] or b"") == checksum(payload(1, 5000))


def test_a_put_of_stored_blocks_copies_nothing(tmp_path: Path) -> None:
    blocks = [(key(i), payload(i, 5000)) for i in range(4)]
    with running_server(tmp_path) as server, KVStoreClient(server.address) as c:
        assert c.put(blocks[:2]) == 2
        channel = c.arena_channel()
        assert channel is not None
        request = pb.ReserveRequest(sizes=[5000] * 4, hashes=[k for k, _ in blocks])
        reply = pb.ReserveResponse.FromString(channel.call(arena.RESERVE, request.SerializeToString(), 5.0))
        assert list(reply.stored) == [True, True, False, False]
        staged = [pb.BlockChunk(hash=key(2), total_size=5000, shm_offset=reply.offsets[2])]
        put = pb.PutRequest(staged=staged, reservation_id=reply.reservation_id)
        channel.call(arena.PUT, put.SerializeToString(), 5.0)
        assert not server.store.reserved_bytes  # the unused slot went back when the put ended
        assert c.put(blocks) == 1  # only block 3 is new: copied and put
        assert c.put(blocks[:2]) == 0  # nothing new: no put at all
        assert c.get([k for k, _ in blocks])[3] == payload(3, 5000)
        server.store.check_integrity()


def test_reservations_made_on_the_arena_channel_end_when_it_closes(tmp_path: Path) -> None:
    with running_server(tmp_path) as server, KVStoreClient(server.address) as c:
        channel = c.arena_channel()
        assert channel is not None
        reply = pb.ReserveResponse.FromString(
            channel.call(arena.RESERVE, pb.ReserveRequest(sizes=[5000, 5000]).SerializeToString(), 5.0))
        assert server.store.reserved_bytes == 10000
        channel.close()  # a client that dies between reserving and putting
        wait_until(lambda: not server.store.reserved_bytes, timeout_s=5, interval_s=0.01,
                   message="the closed channel's reservation was kept")
        assert all(server.store.shm_tier.slots.slot_size(o) is None for o in reply.offsets)  # type: ignore[union-attr]


def test_a_refused_call_on_the_arena_channel_names_its_status_and_the_channel_goes_on(tmp_path: Path) -> None:
    with running_server(tmp_path) as server, KVStoreClient(server.address) as c:
        channel = c.arena_channel()
        assert channel is not None
        with pytest.raises(arena.LocalCallError) as info:
            channel.call(99, b"", 5.0)
        assert info.value.status == "INVALID_ARGUMENT"
        with pytest.raises(arena.LocalCallError) as info:
            channel.call(arena.RESERVE, pb.ReserveRequest(sizes=[1 << 40]).SerializeToString(), 5.0)
        assert info.value.status == "RESOURCE_EXHAUSTED"
        for method in (arena.LOOKUP, arena.GET, arena.RESERVE, arena.PUT):  # a message that does not parse
            with pytest.raises(arena.LocalCallError) as info:
                channel.call(method, b"\xff\xfe" * 10, 5.0)
            assert info.value.status == "INVALID_ARGUMENT" and "malformed" in info.value.message
        with pytest.raises(arena.LocalCallError) as info:
            channel.call(arena.LOOKUP, pb.LookupRequest(hashes=[b"short"]).SerializeToString(), 5.0)
        assert info.value.status == "INVALID_ARGUMENT" and "32 bytes" in info.value.message
        assert c.put([(key(1), payload(1, 5000))]) == 1 and c.get([key(1)]) == [payload(1, 5000)]
        assert not server.store.reserved_bytes and server.store.stats().tier("host").blocks == 1


def test_a_call_that_times_out_closes_the_channel_so_its_late_reply_answers_no_other(tmp_path: Path) -> None:
    """A slow answer (a store busy, not stopped) that comes after its caller gave up would be read as the reply
    to the next call on the connection: the channel closes under the call that timed out, and the calls after
    it fail as it did (TimeoutError) instead of reading someone else's answer."""
    def slow_then_fast(method: int, body: bytes, peer: arena.Connection) -> bytes:
        if body == b"slow":
            time.sleep(0.3)
        return b"reply to " + body

    shared = Arena(PAGE_BYTES)
    server = ArenaSocket(shared, tmp_path / "arena.sock", slow_then_fast)
    channel = ArenaMap(tmp_path / "arena.sock")
    try:
        assert channel.methods == set(arena.METHODS)  # what the greeting says this store answers
        assert channel.call(arena.LOOKUP, b"first", 1.0) == b"reply to first"
        with pytest.raises(TimeoutError):
            channel.call(arena.LOOKUP, b"slow", 0.1)
        time.sleep(0.4)  # the slow reply has been sent by now
        with pytest.raises(TimeoutError):
            channel.call(arena.LOOKUP, b"next", 1.0)
    finally:
        channel.close()
        server.close()
        shared.close()


def test_a_client_asks_a_store_on_its_arena_channel_only_what_the_store_says_it_answers(tmp_path: Path) -> None:
    """A store from before Lookup moved to the arena's channel names no methods in its greeting: a client then
    looks up by gRPC and still moves blocks through the arena."""
    with running_server(tmp_path) as server, KVStoreClient(server.address) as c:
        channel = c.arena_channel()
        assert channel is not None and arena.LOOKUP in channel.methods
        asked: list[int] = []
        call = channel.call
        channel.call = lambda method, *a: asked.append(method) or call(method, *a)  # type: ignore[method-assign]
        channel.methods = frozenset({arena.GET, arena.RESERVE, arena.PUT})
        assert c.put([(key(1), payload(1, 5000))]) == 1
        assert c.lookup([key(1)]).num_hits == 1 and c.get([key(1)]) == [payload(1, 5000)]
        assert arena.LOOKUP not in asked and {arena.RESERVE, arena.PUT, arena.GET} <= set(asked)
        assert server.store.stats().tier("host").blocks == 1


def test_a_caller_on_the_arena_channel_is_its_process_or_where_the_store_cannot_see_it_its_connection() -> None:
    assert arena.Connection(4242, number=7).caller == "local-pid:4242"
    assert arena.Connection(0, number=7).caller == "local-connection:7"  # another container's PID namespace
