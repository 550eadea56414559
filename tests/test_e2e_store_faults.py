"""The prefill and decode servers (in process) over a real KV store process, with the store doing
its worst between prefill and decode: concurrent requests racing to put the same new prefix,
other requests evicting the blocks of one in flight (tiny tiers), the store SIGKILLed and
restarted, a block corrupted in LMDB on disk, a block poisoned in the store. Every answer must still
equal Hugging Face's."""

from __future__ import annotations

import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lmdb
import pytest
import torch

from client import Client
from client.client import Result
from kvserve.engine.hashing import Namespace, prefix_hashes
from kvserve.handoff.codec import decode_block, encode_block
from kvserve.handoff.requests import PrefillHandle
from kvserve.stack.stack import Service, start_service
from kvstore import KVStoreClient
from kvstore.block_format import HEADER_BYTES, checksum, pack_record, unpack_header
from prefill_service.client import PrefillCall, PrefillClient
from tests.polling import wait_until
from tests.stack_fixtures import (
    BLOCK_SIZE,
    LocalStack,
    assert_greedy_matches,
    greedy,
    oracle,
    tokens,
    workdir,
)

pytestmark = pytest.mark.slow

ARCH = "llama"
NEW_TOKENS = 12


class StoreProcess:
    """A kvstore process that can be killed and restarted on the same port and disk path."""

    def __init__(self, name: str, *args: str) -> None:
        self.dir = workdir() / name
        self.args = ["--disk-path", str(self.dir / "lmdb"), "--log-level", "WARNING", "--insecure", *args]
        self.service = self._start(0)

    def _start(self, port: int) -> Service:
        return start_service("kvstore", "kvstore", ["--listen", f"127.0.0.1:{port}", *self.args],
                             self.dir.with_suffix(".log"))

    @property
    def addr(self) -> str:
        return self.service.addr

    def kill(self) -> None:
        self.service.process.kill()
        self.service.process.wait()

    def stop(self) -> None:
        """SIGTERM: the memory tiers are flushed to disk."""
        self.service.process.send_signal(signal.SIGTERM)
        self.service.process.wait(30)

    def start_again(self, wipe: bool = False) -> None:
        """Same port; with `wipe`, an empty disk (a store replaced, not just restarted)."""
        if wipe:
            shutil.rmtree(self.dir / "lmdb")
        self.service = self._start(self.service.port)

    def edit_on_disk(self, key: bytes, edit: Callable[[bytearray], None]) -> None:
        """Rewrites one LMDB record (header + payload) while the store is stopped."""
        env = lmdb.open(str(self.dir / "lmdb"), map_size=1 << 30)
        try:
            with env.begin(write=True) as txn:
                record = bytearray(txn.get(key))
                edit(record)
                txn.put(key, bytes(record))
        finally:
            env.close()


class CallThen:
    """A Prefill call in flight whose handle (the prompt's KV stored) comes back only after `action` has run."""

    def __init__(self, call: PrefillCall, action: Callable[[], None]) -> None:
        self._call = call
        self._action = action
        self.addr = call.addr
        self.on_done = call.on_done

    def cancel(self) -> None:
        self._call.cancel()

    def first(self) -> PrefillHandle:
        return self._call.first()

    def result(self) -> PrefillHandle:
        handle = self._call.result()
        self._action()
        return handle


class PrefillThen:
    """The PrefillClient that decode is given, with an action run once after prefill's next answer,
    before decode has it (so before decode fetches the prompt's KV from the store)."""

    def __init__(self, client: PrefillClient) -> None:
        self._client = client
        self.addr = client.addr
        self.action: Callable[[], None] | None = None

    def start(self, *args: Any, **kwargs: Any) -> PrefillCall | CallThen:
        call = self._client.start(*args, **kwargs)
        action, self.action = self.action, None
        return call if action is None else CallThen(call, action)

    def close(self) -> None:
        self._client.close()


class Rig:
    def __init__(self, name: str, *store_args: str) -> None:
        self.store = StoreProcess(name, *store_args)
        self.kv = KVStoreClient(self.store.addr, timeout_s=2.0)
        self.prefill: PrefillThen | None = None
        self.stack = LocalStack(ARCH, store=self.kv, wrap_prefill_client=self._wrap)
        self.client = Client(self.stack.addr, timeout_s=60)

    def _wrap(self, client: PrefillClient) -> PrefillThen:
        self.prefill = PrefillThen(client)
        return self.prefill

    @contextmanager
    def between_prefill_and_decode(self, action: Callable[[], None]) -> Iterator[None]:
        """Runs `action` once, after prefill has answered the next request and before decode fetches
        that request's KV; fails if no request got that far."""
        assert self.prefill is not None
        ran: list[bool] = []

        def once() -> None:
            action()
            ran.append(True)

        self.prefill.action = once
        try:
            yield
        finally:
            self.prefill.action = None
        assert ran, "no request reached decode"

    def recomputed(self) -> float:
        return self.stack.decode_metric("kvserve_decode_recomputed_tokens_total")

    def close(self) -> None:
        self.client.close()
        self.stack.close()
        self.kv.close()
        self.store.stop()


def check(ids: list[int], r: Result) -> None:
    assert_greedy_matches(r.token_ids, *oracle(ARCH, ids, NEW_TOKENS))


# A llama block is 24.6 KB: the host tier holds 2 blocks, the disk 5.
@pytest.fixture(scope="module")
def tiny() -> Iterator[Rig]:
    rig = Rig("faults-tiny", "--host-capacity", "64KiB", "--disk-capacity", "128KiB")
    yield rig
    rig.close()


def test_concurrent_requests_for_the_same_new_prefix(tiny: Rig) -> None:
    ids = tokens(4 * BLOCK_SIZE + 3, seed=600)
    results: list[Result | None] = [None] * 4

    def run(i: int) -> None:
        results[i] = greedy(tiny.client, ids, NEW_TOKENS)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    first = results[0]
    assert first is not None
    check(ids, first)
    assert all(r is not None and r.token_ids == first.token_ids for r in results)


def test_blocks_leased_to_a_request_survive_a_flood(tiny: Rig) -> None:
    ids = tokens(4 * BLOCK_SIZE + 3, seed=601)

    def flood() -> None:  # 20 blocks of others' work through a store that holds 7
        with KVStoreClient(tiny.store.addr) as other:
            for i in range(5):
                other.put([(bytes([i, j]) * 16, bytes(24_000)) for j in range(4)])

    def evictions() -> int:
        return sum(t.evictions for t in tiny.kv.stats().tiers)

    before, evicted = tiny.recomputed(), evictions()
    with tiny.between_prefill_and_decode(flood):
        r = greedy(tiny.client, ids, NEW_TOKENS)
    check(ids, r)
    assert evictions() - evicted >= 10, "the flood did not evict"
    assert tiny.recomputed() - before <= 3  # the 4 leased blocks were kept; at most the tail is gone


def test_a_prompt_larger_than_the_store(tiny: Rig) -> None:
    ids = tokens(12 * BLOCK_SIZE + 5, seed=602)  # 12 blocks, the store holds 7
    for _ in range(2):
        check(ids, greedy(tiny.client, ids, NEW_TOKENS))


@pytest.fixture(scope="module")
def disk() -> Iterator[Rig]:
    rig = Rig("faults-disk", "--host-capacity", "0", "--disk-capacity", "64MiB")
    yield rig
    rig.close()


@pytest.mark.parametrize("wipe", [False, True], ids=["restarted", "replaced"])
def test_store_restarted_between_prefill_and_decode(disk: Rig, wipe: bool) -> None:
    """The handle names blocks that the new store may no longer have (all of them, when its disk
    was wiped): decode recomputes what it misses."""
    ids = tokens(3 * BLOCK_SIZE + 5, seed=603 + wipe)

    def restart() -> None:
        disk.store.kill()
        disk.store.start_again(wipe=wipe)

    before = disk.recomputed()
    with disk.between_prefill_and_decode(restart):
        r = greedy(disk.client, ids, NEW_TOKENS)
    check(ids, r)
    assert r.usage.cached_tokens == 0
    if wipe:
        assert disk.recomputed() - before == len(ids)
    again = greedy(disk.client, ids, NEW_TOKENS)  # decode stored the prompt's blocks again
    assert again.token_ids == r.token_ids and again.usage.cached_tokens == 3 * BLOCK_SIZE


@pytest.mark.parametrize("seen_by", ["store", "engine"])
def test_a_block_corrupted_on_disk(disk: Rig, seen_by: str) -> None:
    """`store`: the store's checksum catches it, drops the block and reports a miss. `engine`: the
    store's record is consistent but the KV block inside is not; the engine's codec catches it."""
    ids = tokens(4 * BLOCK_SIZE + 3, seed=604 + (seen_by == "engine"))
    want = greedy(disk.client, ids, NEW_TOKENS)
    check(ids, want)
    key = prefix_hashes(ids, BLOCK_SIZE, disk.stack.decode.engine.namespace().root())[1]

    def flip_last_byte(record: bytearray) -> None:
        record[-1] ^= 0xFF
        if seen_by == "engine":
            h = unpack_header(memoryview(record), key, None)
            body = bytes(record[HEADER_BYTES:])
            record[:] = pack_record(key, body, checksum(body), None, ephemeral=h.ephemeral, seq=h.seq)

    disk.store.stop()
    disk.store.edit_on_disk(key, flip_last_byte)
    disk.store.start_again()
    for _ in range(2):
        r = greedy(disk.client, ids, NEW_TOKENS)
        assert r.token_ids == want.token_ids
        assert r.usage.cached_tokens >= BLOCK_SIZE  # the block before the bad one is still used


def test_a_graceful_restart_is_warm_and_gives_the_same_tokens(tiny: Rig) -> None:
    ids = tokens(2 * BLOCK_SIZE + 3, seed=606)  # its 2 blocks sit in the host tier until SIGTERM
    first = greedy(tiny.client, ids, NEW_TOKENS)
    check(ids, first)
    tiny.store.stop()
    tiny.store.start_again()
    def hits_again() -> bool:
        again = greedy(tiny.client, ids, NEW_TOKENS)
        assert again.token_ids == first.token_ids
        return again.usage.cached_tokens == 2 * BLOCK_SIZE

    # the services' store channels reconnect with backoff
    wait_until(hits_again, timeout_s=15, interval_s=0.2, message="no hits after the store restarted")


@pytest.fixture(scope="module")
def roomy() -> Iterator[Rig]:
    rig = Rig("faults-roomy", "--host-capacity", "8MiB", "--disk-capacity", "64MiB")
    yield rig
    rig.close()


@pytest.mark.parametrize("poison", ["nan", "other-namespace"])
def test_a_poisoned_block_is_removed_and_replaced_by_the_recomputed_one(roomy: Rig, poison: str) -> None:
    """A well-formed block under the right hash whose values are NaN, or whose header names another
    namespace, put by an internal caller before any request: the engine that loads it rejects it and
    has the store remove it; what it computes instead is stored, and the next request hits it."""
    ids = tokens(4 * BLOCK_SIZE + 3, seed=607 + (poison == "nan"))
    engine = roomy.stack.prefill.engine
    namespace = engine.namespace()
    key = prefix_hashes(ids, BLOCK_SIZE, namespace.root())[0]
    _, layers, _, _, heads, dim = engine.kv_cache.kv.shape
    shape = (layers, 2, BLOCK_SIZE, heads, dim)
    if poison == "nan":
        bad = encode_block(torch.full(shape, float("nan"), dtype=engine.kv_cache.kv.dtype), namespace)
    else:
        other = Namespace(namespace.model_fingerprint, namespace.kv_dtype, BLOCK_SIZE, cache_salt="someone-else")
        bad = encode_block(torch.randn(shape).to(engine.kv_cache.kv.dtype), other)
    removed = roomy.kv.stats().removed_blocks
    assert roomy.kv.put([(key, bad)]) == 1
    kind = "nonfinite" if poison == "nan" else "namespace"
    rejected = roomy.stack.prefill_metric("kvserve_prefill_bad_blocks_total", kind=kind)

    first = greedy(roomy.client, ids, NEW_TOKENS)
    check(ids, first)
    assert roomy.stack.prefill_metric("kvserve_prefill_bad_blocks_total", kind=kind) == rejected + 1
    assert roomy.kv.stats().removed_blocks == removed + 1
    [stored] = roomy.kv.get([key])
    assert stored is not None and stored != bad  # the recomputed block took its place
    good = decode_block(stored, namespace, num_layers=layers, num_kv_heads=heads, head_dim=dim,
                        dtype=engine.kv_cache.kv.dtype, num_tokens=BLOCK_SIZE)
    assert bool(torch.isfinite(good).all())

    again = greedy(roomy.client, ids, NEW_TOKENS)
    assert again.token_ids == first.token_ids and again.usage.cached_tokens == 4 * BLOCK_SIZE
    assert roomy.kv.stats().removed_blocks == removed + 1
