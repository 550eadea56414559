"""BlockStore semantics with plain bytes and tiny capacities; check_integrity after every op."""

from __future__ import annotations

import contextlib
import os
import random
import time
from pathlib import Path

import pytest

from kvstore.block_format import checksum
from kvstore.disk_tier import DiskTier
from kvstore.errors import BlockTooLarge, InvalidRequest, StoreFull, UnknownLease
from kvstore.host_tier import ArenaHostTier
from kvstore.store import BlockStore
from kvstore.types import Tier
from tests.kvstore_fixtures import FakeClock, corrupt_lmdb_value, key, make_store, payload, run_in_threads

HOST, DISK = Tier.HOST, Tier.DISK


def put(store: BlockStore, i: int | str, size: int = 100, *, ephemeral: bool = False) -> bool:
    new = store.put(key(i), payload(i, size), ephemeral=ephemeral)
    store.check_integrity()
    return new


def read(store: BlockStore, i: int | str) -> bytes | None:
    (block,) = store.get([key(i)])
    store.check_integrity()
    return None if block is None else block.payload


def order(store: BlockStore, tier: Tier = HOST) -> list[bytes]:
    return store.eviction_order(tier)


def keys(*ids: int | str) -> list[bytes]:
    return [key(i) for i in ids]


def test_three_times_host_capacity_all_readable_from_disk(tmp_path: Path) -> None:
    store = make_store(host=1000, disk=10_000, tmp=tmp_path)
    for i in range(30):  # 3000 bytes into a 1000-byte host tier
        assert put(store, i)
        for slot in store.tiers:
            assert slot.used <= slot.capacity
    assert store.stats().tier("host").bytes == 1000
    assert store.stats().tier("disk").blocks == 20
    for i in range(30):
        assert read(store, i) == payload(i)
    store.close()


def test_lru_order_exact_and_victim_is_least_recent() -> None:
    store = make_store(host=400)  # four blocks of 100
    for i in "abcd":
        put(store, i)
    assert order(store) == keys(*"abcd")
    read(store, "a")
    assert order(store) == keys(*"bcda")
    put(store, "e")  # no disk: the victim is dropped
    assert order(store) == keys(*"cdae")
    assert key("b") not in store
    assert store.stats().tier("host").evictions == 1


def test_chain_is_evicted_tail_first() -> None:
    store = make_store(host=500)
    chain = keys(*"abcd")
    for k in chain:
        store.put(k, payload(k.hex()))
        store.check_integrity()
    store.touch(chain)  # as the servicer does after a Put stream
    assert order(store) == keys(*"dcba")
    store.lookup(chain)  # a lookup touches the chain in reverse, too
    put(store, "x")
    assert order(store) == keys(*"dcbax")
    put(store, "y")
    put(store, "z")
    assert [k in store for k in chain] == [True, True, False, False]  # d then c went first


def test_ephemeral_blocks_go_first() -> None:
    store = make_store(host=300)
    put(store, "a")
    put(store, "tail", ephemeral=True)
    put(store, "b")
    read(store, "tail")
    assert order(store) == keys("tail", "a", "b")
    put(store, "c")
    assert key("tail") not in store
    assert order(store) == keys(*"abc")


def test_demotion_then_promotion_on_hit(tmp_path: Path) -> None:
    store = make_store(host=300, disk=1000, tmp=tmp_path)
    for i in "abcd":
        put(store, i)
    assert store.tier_of(key("a")) == DISK
    assert read(store, "a") == payload("a")
    assert store.tier_of(key("a")) == HOST
    assert store.tier_of(key("b")) == DISK  # made room for the promoted block
    stats = store.stats()
    assert (stats.tier("disk").promotions, stats.tier("host").demotions) == (1, 2)
    assert (stats.tier("disk").hits, stats.tier("host").misses) == (1, 1)
    store.close()


def test_pinned_blocks_survive_pressure_and_new_writes_go_below(tmp_path: Path) -> None:
    store = make_store(host=300, disk=600, tmp=tmp_path)
    for name in "abc":
        put(store, name)
    lease = store.lookup(keys(*"ab"), lease_ttl_s=30).lease_id
    assert lease is not None
    for i in range(10):
        put(store, i)
    assert store.tier_of(key("a")) == HOST and store.tier_of(key("b")) == HOST
    assert order(store) == keys(9)
    store.release(lease)
    store.check_integrity()
    assert order(store) == keys(9, "b", "a")  # released tail first: the parent is most recent
    store.close()


def test_store_full_of_pinned_blocks_refuses_new_blocks() -> None:
    store = make_store(host=200)
    put(store, "a")
    put(store, "b")
    store.lookup(keys("a", "b"), lease_ttl_s=5)
    with pytest.raises(StoreFull):
        put(store, "c")
    store.check_integrity()


def test_leases_expire_and_release_is_refused_after() -> None:
    clock = FakeClock()
    store = make_store(host=400, clock=clock)
    put(store, "a")
    put(store, "b")
    result = store.lookup(keys("a", "b", "zz", "a"), lease_ttl_s=10)
    assert (result.num_hits, result.tiers) == (2, ["host", "host"])
    assert result.lease_id is not None
    assert store.stats().pinned_blocks == 2
    clock.advance(9.9)
    store.sweep()
    assert store.stats().leases == 1
    clock.advance(0.2)
    store.sweep()
    store.check_integrity()
    assert (store.stats().leases, store.stats().pinned_blocks) == (0, 0)
    with pytest.raises(UnknownLease):
        store.release(result.lease_id)
    assert store.lookup([key("zz")], lease_ttl_s=10).lease_id is None  # no hits, no lease


def test_burst_of_leases_leaves_nothing_pinned() -> None:
    clock = FakeClock()
    store = make_store(host=10_000, clock=clock)
    for i in range(50):
        put(store, i)
    for n in range(200):
        store.lookup(keys(*range(n % 50)), lease_ttl_s=1 + n % 5)
        clock.advance(0.01)
    assert store.stats().pinned_blocks > 0
    clock.advance(6)
    put(store, "after")  # any operation expires leases lazily
    assert (store.stats().leases, store.stats().pinned_blocks) == (0, 0)


def test_puts_are_idempotent() -> None:
    store = make_store(host=400)
    assert put(store, "a")
    assert not put(store, "a")
    assert store.stats().tier("host").bytes == 100


def test_bad_inputs_store_nothing() -> None:
    store = make_store(host=400)
    with pytest.raises(InvalidRequest, match="32 bytes"):
        store.put(b"short", b"x")
    with pytest.raises(InvalidRequest, match="empty"):
        store.put(key(1), b"")
    with pytest.raises(InvalidRequest, match="checksum"):
        store.put(key(1), b"abc", checksum(b"abd"))
    with pytest.raises(BlockTooLarge):
        store.put(key(1), b"x" * 401)
    with pytest.raises(InvalidRequest):
        store.lookup([key(1)], lease_ttl_s=-1)
    with pytest.raises(UnknownLease):
        store.release("nope")
    store.check_integrity()
    assert len(store) == 0


def test_corrupt_disk_value_is_deleted_counted_and_a_miss(tmp_path: Path) -> None:
    store = make_store(host=100, disk=1000, tmp=tmp_path)
    put(store, "a")
    put(store, "b")  # demotes a to disk
    store.flush_to_disk()
    store.close()
    corrupt_lmdb_value(tmp_path / "lmdb", key("a"))
    store = make_store(host=100, disk=1000, tmp=tmp_path)
    assert key("a") in store  # the index comes from headers; payloads are verified on read
    assert read(store, "a") is None
    assert key("a") not in store
    assert store.stats().checksum_failures == 1
    assert read(store, "b") == payload("b")
    store.close()
    store = make_store(host=100, disk=1000, tmp=tmp_path)
    assert key("a") not in store  # deleted from disk too
    store.close()


def test_disk_tier_survives_restart_in_lru_order(tmp_path: Path) -> None:
    store = make_store(host=100, disk=1000, tmp=tmp_path)
    for i in "abcd":
        put(store, i)
    result = store.flush_to_disk(5)
    assert result.moved == 1 and result.durable
    store.close()
    store = make_store(host=100, disk=1000, tmp=tmp_path)
    store.check_integrity()
    assert store.eviction_order(DISK) == keys(*"abcd")
    assert [read(store, i) for i in "abcd"] == [payload(i) for i in "abcd"]
    store.close()


def test_device_tier_over_cpu_tensors(tmp_path: Path) -> None:
    store = make_store(device=200, host=200, disk=1000, tmp=tmp_path)
    for i in "abcde":
        put(store, i)
    assert [store.tier_of(key(i)) for i in "abcde"] == [DISK, Tier.HOST, Tier.HOST, Tier.DEVICE, Tier.DEVICE]
    assert read(store, "a") == payload("a")
    assert store.tier_of(key("a")) == Tier.DEVICE
    assert store.stats().tier("device").demotions == 4
    store.close()


def test_arena_host_tier_slots_and_reserved_puts(tmp_path: Path) -> None:
    store = make_store(host=400, disk=1000, tmp=tmp_path, shm=True)
    shm = store.shm_tier
    assert shm is not None
    put(store, "a")
    found = shm.slot(key("a"))
    assert found is not None and bytes(shm.arena.view[found[0] : found[0] + 100]) == payload("a")
    rid, (offset, spare) = store.reserve([100, 100])
    shm.arena.view[offset : offset + 100] = payload("b")
    assert store.put_reserved(key("b"), rid, offset, 100, checksum(payload("b")))
    store.check_integrity()
    assert shm.slot(key("b")) == (offset, 100, checksum(payload("b")))  # the reserved slot became the block: no copy
    with pytest.raises(InvalidRequest):  # put once only
        store.put_reserved(key("c"), rid, offset, 100, checksum(payload("c")))
    with pytest.raises(InvalidRequest):  # larger than its slot
        store.put_reserved(key("c"), rid, spare, 200, 0)
    store.end_reservation(rid)
    assert shm.slots.slot_size(spare) is None  # returned to the arena
    for i in range(6):
        put(store, i)
    assert shm.slot(key("a")) is None and store.tier_of(key("a")) == DISK  # demoted: slot freed
    store.close()
    assert not shm.dir.exists()


def test_garbage_in_an_arena_slot_is_a_counted_miss(tmp_path: Path) -> None:
    store = make_store(host=300, disk=1000, tmp=tmp_path, shm=True)
    shm = store.shm_tier
    assert shm is not None
    put(store, "a")
    found = shm.slot(key("a"))
    assert found is not None
    shm.arena.view[found[0] : found[0] + 100] = b"\xff" * 100  # another process scribbles on it
    assert read(store, "a") is None and key("a") not in store
    assert store.stats().checksum_failures == 1
    store.check_integrity()
    store.close()


def test_expired_reservations_return_their_slots(tmp_path: Path) -> None:
    clock = FakeClock()
    store = make_store(host=300, tmp=tmp_path, shm=True, clock=clock)
    shm = store.shm_tier
    assert shm is not None
    rid, (offset,) = store.reserve([100])
    with pytest.raises(StoreFull):  # at most half the tier reserved at once
        store.reserve([100])
    clock.advance(60)
    store.sweep()
    assert shm.slots.slot_size(offset) is None
    with pytest.raises(InvalidRequest):
        store.put_reserved(key("a"), rid, offset, 100, checksum(payload("a")))
    store.close()


def test_random_operations_keep_integrity(tmp_path: Path) -> None:
    clock = FakeClock()
    store = make_store(device=300, host=500, disk=1500, tmp=tmp_path, clock=clock)
    rng = random.Random(7)
    leases: list[str] = []
    for _ in range(400):
        op = rng.random()
        i = rng.randrange(40)
        if op < 0.45:
            put(store, i, size=rng.choice([50, 100, 150]), ephemeral=rng.random() < 0.1)
        elif op < 0.75:
            got = read(store, i)
            assert got is None or got == payload(i, len(got))
        elif op < 0.9:
            lease = store.lookup(keys(*range(i, i + 3)), lease_ttl_s=rng.choice([0, 1, 5])).lease_id
            if lease:
                leases.append(lease)
        elif leases:
            with contextlib.suppress(UnknownLease):
                store.release(leases.pop(rng.randrange(len(leases))))
        clock.advance(0.05)
        store.check_integrity()
    clock.advance(10)
    store.sweep()
    store.check_integrity()
    assert store.stats().pinned_blocks == 0
    store.close()


@pytest.mark.gpu
def test_device_tier_on_cuda(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kvstore.device_tier import DeviceArenaTier

    device = DeviceArenaTier(tmp_path / "device", 300, "cuda")
    store = BlockStore([(device, 300), (make_store(host=300).tiers[0].storage, 300)], clock=FakeClock())
    for i in "abcd":
        put(store, i)
    assert store.tier_of(key("d")) == Tier.DEVICE and store.tier_of(key("a")) == Tier.HOST
    assert read(store, "a") == payload("a")
    assert store.tier_of(key("a")) == Tier.DEVICE


def test_a_hash_already_stored_keeps_its_first_payload(tmp_path: Path) -> None:
    store = make_store(host=300, disk=1000, tmp=tmp_path, shm=True)
    shm = store.shm_tier
    assert shm is not None
    put(store, "a")
    assert not store.put(key("a"), payload("other"))  # blocks are immutable: ignored, not an error
    rid, (offset,) = store.reserve([100])
    shm.arena.view[offset : offset + 100] = payload("other")
    assert not store.put_reserved(key("a"), rid, offset, 100, checksum(payload("other")))
    assert shm.slots.slot_size(offset) is None  # the unused slot went back
    store.check_integrity()
    assert read(store, "a") == payload("a")
    store.close()


def test_threads_racing_eviction_promotion_and_leases_read_exact_bytes(tmp_path: Path) -> None:
    # Tiny shm host tier over a disk tier: every put demotes, every disk hit promotes, and leases
    # expire (real clock) while other threads read the same blocks.
    store = BlockStore(
        [(ArenaHostTier(tmp_path / "shm", 2000), 2000), (DiskTier(tmp_path / "lmdb", 20_000), 20_000)]
    )
    def work(t: int) -> None:
        rng = random.Random(t)
        for _ in range(300):
            i = rng.randrange(60)
            op = rng.random()
            if op < 0.4:
                store.put(key(i), payload(i, 200))
            elif op < 0.8:
                (block,) = store.get([key(i)])
                assert block is None or bytes(block.payload or b"") == payload(i, 200)
            else:
                store.lookup(keys(i, i + 1), lease_ttl_s=0.01)

    run_in_threads(work)
    time.sleep(0.02)
    store.sweep()
    store.check_integrity()
    assert store.stats().pinned_blocks == 0
    assert store.stats().tier("disk").promotions > 0 and store.stats().tier("host").demotions > 0
    for i in range(60):
        got = read(store, i)
        assert got is None or bytes(got) == payload(i, 200)
    store.close()


def test_a_truncated_disk_tier_is_quarantined_and_counted(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from kvstore.metrics import StoreCollector

    store = make_store(host=300, disk=1000, tmp=tmp_path)
    for i in range(5):
        put(store, i)
    store.close()
    data = tmp_path / "lmdb" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    disk = DiskTier(tmp_path / "lmdb", 1000)
    assert disk.quarantined is not None and (disk.quarantined / "data.mdb").exists()
    assert disk.keys() == set()
    store = BlockStore([(disk, 1000)])
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    assert b"kvserve_kvstore_disk_quarantined 1.0" in generate_latest(registry)
    store.close()


# -- removal of bad blocks, limits per caller ------------------------------------------------------


def test_remove_drops_blocks_from_every_tier_even_leased_and_a_put_stores_them_again(tmp_path: Path) -> None:
    store = make_store(host=200, disk=1000, tmp=tmp_path)
    sub = store.events.subscribe()
    for name in "abc":
        put(store, name)  # a goes down to disk
    assert [store.tier_of(key(n)) for n in "abc"] == [DISK, HOST, HOST]
    lease = store.lookup(keys("b"), lease_ttl_s=30).lease_id
    assert lease is not None
    sub.take(0)
    assert store.remove(keys("a", "b", "zz")) == 2
    store.check_integrity()
    assert [(ev.stored, ev.key, ev.tier) for ev in sub.take(0)] == [(False, key("a"), DISK), (False, key("b"), HOST)]
    assert store.lookup(keys("a")).num_hits == 0 and store.lookup(keys("b")).num_hits == 0
    assert [b is None for b in store.get(keys("a", "b", "c"))] == [True, True, False]
    assert store.stats().removed_blocks == 2 and store.stats().pinned_blocks == 0
    assert put(store, "b", size=120)  # a first write again: the reader's recomputed block
    store.release(lease)  # the lease held the removed block, never the new one
    store.check_integrity()
    assert read(store, "b") == payload("b", 120) and order(store) == keys("b")
    store.close()


def test_a_lease_longer_than_the_longest_allowed_gets_the_longest() -> None:
    clock = FakeClock()
    store = make_store(host=400, clock=clock, max_lease_ttl_s=10)
    put(store, "a")
    result = store.lookup(keys("a"), lease_ttl_s=600)
    assert result.lease_id is not None and result.lease_ttl_s == 10
    assert store.lookup(keys("a"), lease_ttl_s=4).lease_ttl_s == 4
    assert store.lookup(keys("a")).lease_ttl_s is None
    clock.advance(10.1)
    store.sweep()
    assert store.stats().leases == 0
    with pytest.raises(InvalidRequest, match="0 \\(no lease\\) or more"):
        store.lookup(keys("a"), lease_ttl_s=float("nan"))
    store.check_integrity()


def test_each_caller_pins_at_most_its_cap_and_gets_it_back_on_release_or_expiry() -> None:
    clock = FakeClock()
    store = make_store(host=1000, clock=clock, max_pinned_bytes_per_caller=300)
    for i in range(8):
        put(store, i)
    first = store.lookup(keys(0, 1), lease_ttl_s=30, caller="10.0.0.1").lease_id
    assert first is not None
    store.lookup(keys(2), lease_ttl_s=5, caller="10.0.0.1")
    with pytest.raises(StoreFull, match="10.0.0.1 holds leases on 300 bytes.*--max-pinned-bytes-per-caller"):
        store.lookup(keys(3), lease_ttl_s=30, caller="10.0.0.1")
    store.check_integrity()
    assert store.lookup(keys(4, 5, 6), lease_ttl_s=30, caller="10.0.0.2").lease_id  # another caller's own cap
    assert store.lookup(keys(3), caller="10.0.0.1").num_hits == 1  # no lease: never capped
    assert store.lookup(keys(*range(8)), lease_ttl_s=30).lease_id  # in-process: no cap
    store.release(first)
    assert store.lookup(keys(3, 4), lease_ttl_s=30, caller="10.0.0.1").lease_id
    clock.advance(6)  # the 5 s lease ends
    assert store.lookup(keys(7), lease_ttl_s=30, caller="10.0.0.1").lease_id
    store.check_integrity()
    # A lease that would pass the cap alone is refused too (a prompt larger than the cap looks up without one).
    with pytest.raises(StoreFull):
        store.lookup(keys(*range(4)), lease_ttl_s=30, caller="10.0.0.3")


def test_max_block_bytes_bounds_blocks_below_the_largest_tier(tmp_path: Path) -> None:
    store = make_store(host=1000, shm=True, tmp=tmp_path, max_block_bytes=150)
    assert store.max_block_bytes == 150
    with pytest.raises(BlockTooLarge, match="block of 151 bytes exceeds the store's --max-block-bytes \\(150 bytes\\)"):
        store.put(key(1), b"x" * 151)
    with pytest.raises(BlockTooLarge, match="--max-block-bytes"):
        store.reserve([151])
    assert put(store, 1, size=150)
    assert make_store(host=100, max_block_bytes=150).max_block_bytes == 100  # never above the largest tier
    store.close()


def test_a_puts_lease_pins_blocks_new_or_stored_before_and_past_the_cap_is_none() -> None:
    """A put's lease (kvstore/server.py takes it after the put): every block named that is stored, the first write's
    included; extending a live lease renews it; past the caller's cap or on an ended lease, no lease and no error."""
    clock = FakeClock()
    store = make_store(host=1000, clock=clock, max_pinned_bytes_per_caller=300)
    for i in range(4):
        put(store, i)
    assert store.lease_stored(keys(0, 1, "missing"), None, caller="c") == (None, None)
    lease, ttl = store.lease_stored(keys(0, 1, "missing"), 30, caller="c")
    assert lease is not None and ttl == 30 and store.stats().pinned_blocks == 2
    clock.advance(20)
    assert store.lease_stored(keys(2), 30, caller="other", lease_id=lease) == (None, None)  # not theirs to extend
    assert store.lease_stored(keys(2), 30, caller="c", lease_id=lease) == (lease, 30)  # renewed: 30 s from now
    assert store.lease_stored(keys(3), 30, caller="c", lease_id=lease) == (None, None)  # 400 bytes > the cap of 300
    assert store.lease_stored(keys(3), 30, caller="c") == (None, None)
    store.check_integrity()
    assert store.pinned_bytes_by_caller() == {"c": 300}
    clock.advance(20)  # past the first TTL, within the renewed one
    store.sweep()
    assert (store.stats().leases, store.stats().pinned_blocks) == (1, 3)
    clock.advance(11)
    store.sweep()
    assert (store.stats().leases, store.stats().pinned_blocks) == (0, 0)
    assert store.lease_stored(keys(3), 30, caller="c", lease_id=lease) == (None, None)  # ended
    store.check_integrity()
