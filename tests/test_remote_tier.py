"""The remote tier through a real redis-server (one server, a 3-master cluster, TLS): what one store
writes behind another finds on a local miss, and a Redis that is down, slow or returns garbage is only
ever a miss."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve.cli import commands as cli
from kvserve.rpc.cli import parse_args
from kvstore import KVStoreClient
from kvstore.__main__ import parser, remote_config
from kvstore.block_format import RECORD_VERSION, pack_record
from kvstore.block_format import checksum as block_checksum
from kvstore.config import RemoteConfig
from kvstore.remote_tier import Breaker, RemoteTier
from kvstore.store import BlockStore
from kvstore.types import Tier
from tests.kvstore_fixtures import FakeClock, key, make_store, payload, running_server
from tests.processes import free_ports
from tests.redis_fixtures import RedisServer, needs_redis, redis_cluster

RELAXED_S = 5.0  # a timeout no healthy call on a noisy machine reaches


@pytest.fixture
def stores() -> Iterator[Callable[..., BlockStore]]:
    """Makes stores over a remote tier (`url`, RemoteConfig's other fields) with a fake clock; closes them."""
    made: list[BlockStore] = []

    def make(url: str, clock: FakeClock | None = None, *, host: int = 10_000, **remote: Any) -> BlockStore:
        clock = clock or FakeClock()
        remote = {"timeout_s": RELAXED_S, **remote}
        store = make_store(host=host, clock=clock, remote=RemoteTier(RemoteConfig(url, **remote), clock=clock))
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def remote(store: BlockStore) -> RemoteTier:
    assert store.remote is not None
    return store.remote


def put_and_write(store: BlockStore, ids: range, ephemeral: bool = False) -> list[bytes]:
    keys = [key(i) for i in ids]
    for i, k in zip(ids, keys, strict=True):
        assert store.put(k, payload(i), ephemeral=ephemeral)
    assert remote(store).flush(10)
    return keys


@needs_redis
def test_a_block_stored_in_one_store_is_found_by_another_and_promoted(
        redis_server: RedisServer, stores: Callable[..., BlockStore]) -> None:
    a, b = stores(redis_server.url), stores(redis_server.url)
    keys = put_and_write(a, range(3))
    assert remote(a).stats().written_blocks == 3

    result = b.lookup([*keys, key(99)], lease_ttl_s=5)
    assert result.num_hits == 3 and result.lease_id is not None
    assert [b.tier_of(k) for k in keys] == [Tier.HOST] * 3  # promoted into its local tier
    reads = list(b.get(keys))
    assert [r.payload if r else None for r in reads] == [payload(i) for i in range(3)]
    stats = b.stats()
    assert stats.remote is not None and (stats.remote.hits, stats.remote.misses) == (3, 1)
    assert stats.remote.read_bytes > 0 and stats.remote.breaker == "closed"
    # Lookup: 3 blocks from the remote and 1 found nowhere, all misses here; Get: 3 hits here.
    assert (stats.tier("host").hits, stats.tier("host").misses) == (3, 4)
    b.check_integrity()

    # Get alone fetches too, and a block from the remote is not written back.
    c = stores(redis_server.url)
    assert [r.payload if r else None for r in c.get([keys[1], key(98)])] == [payload(1), None]
    assert remote(c).flush(10) and remote(c).stats().written_blocks == 0

    client = redis_server.client()
    names = sorted(n.decode() for n in client.keys("*"))
    assert names == sorted(f"kvserve:v{RECORD_VERSION}:{k.hex()}" for k in keys)
    assert 0 < client.pttl(names[0]) <= 86_400_000


@needs_redis
def test_ttl_and_prefix_are_what_the_flags_say(redis_server: RedisServer, stores: Callable[..., BlockStore]) -> None:
    a = stores(redis_server.url, ttl_s=30, key_prefix="team-a")
    other = stores(redis_server.url)  # another prefix: another namespace of keys
    (k,) = put_and_write(a, range(1))
    name = f"team-a:v{RECORD_VERSION}:{k.hex()}"
    assert 0 < redis_server.client().pttl(name) <= 30_000
    assert other.lookup([k]).num_hits == 0


@needs_redis
def test_ephemeral_blocks_are_not_written(redis_server: RedisServer, stores: Callable[..., BlockStore]) -> None:
    a = stores(redis_server.url)
    put_and_write(a, range(2), ephemeral=True)
    assert redis_server.client().dbsize() == 0
    assert remote(a).stats().written_blocks == 0


@needs_redis
def test_a_corrupted_value_is_a_miss_counted_and_written_over(
        redis_server: RedisServer, stores: Callable[..., BlockStore]) -> None:
    a, b = stores(redis_server.url), stores(redis_server.url)
    (k,) = put_and_write(a, range(1))
    client = redis_server.client()
    name = remote(a).key(k)
    value = bytearray(client.get(name) or b"")
    value[-1] ^= 0xFF
    client.set(name, bytes(value))

    assert b.lookup([k]).num_hits == 0
    assert k not in b
    assert remote(b).stats().checksum_failures == 1 and remote(b).stats().hits == 0
    # The store that misses computes the block and puts it: its write replaces the bad value.
    put_and_write(b, range(1))
    assert client.get(name) == pack_record(k, payload(0), block_checksum(payload(0)), None)


@needs_redis
def test_a_redis_stopped_mid_run_is_misses_then_hits_again_once_restarted(
        redis_server: RedisServer, stores: Callable[..., BlockStore]) -> None:
    clock = FakeClock()
    a, b = stores(redis_server.url, clock), stores(redis_server.url, clock)
    keys = put_and_write(a, range(2))
    assert b.lookup(keys[:1]).num_hits == 1

    redis_server.stop()
    for i in range(10, 14):  # puts and lookups go on, as misses
        a.put(key(i), payload(i))
        assert b.lookup([keys[1], key(i)]).num_hits == 0
    assert b.stats().remote.breaker == "open"  # type: ignore[union-attr]
    assert remote(b).stats().read_errors == 3  # then the breaker stopped the calls
    assert remote(b).stats().misses == 4

    redis_server.restart()  # empty: nothing was saved
    clock.advance(1.5)  # past the first cool-down: the next call of each store is a probe
    (k,) = put_and_write(a, range(20, 21))
    assert b.lookup([k]).num_hits == 1
    assert remote(b).stats().breaker == "closed" and remote(a).stats().breaker == "closed"
    a.check_integrity()
    b.check_integrity()


@needs_redis
def test_a_slow_redis_times_out_as_misses(redis_server: RedisServer, stores: Callable[..., BlockStore]) -> None:
    clock = FakeClock()
    a, b = stores(redis_server.url, clock), stores(redis_server.url, clock, timeout_s=0.1)
    keys = put_and_write(a, range(4))
    redis_server.pause(1500)  # far longer than 3 calls of 0.1 s
    for k in keys:
        assert b.lookup([k]).num_hits == 0
        assert list(b.get([k])) == [None]
    stats = remote(b).stats()
    assert stats.read_errors == 3 and stats.breaker == "open"
    assert stats.misses == 8 and stats.hits == 0
    redis_server.client().ping()  # answered once the pause is over (CLIENT UNPAUSE would wait as long)
    clock.advance(1.5)
    assert b.lookup(keys).num_hits == 4


@pytest.mark.slow
@needs_redis
def test_a_cluster_of_three_masters_shares_blocks_across_its_slots(
        tmp_path: Path, stores: Callable[..., BlockStore]) -> None:
    with redis_cluster(tmp_path) as cluster:
        a, b = stores(cluster.url, cluster=True), stores(cluster.url, cluster=True)
        keys = put_and_write(a, range(12))
        assert remote(a).stats().written_blocks == 12
        assert b.lookup(keys).num_hits == 12
        assert [r.payload if r else None for r in b.get(keys)] == [payload(i) for i in range(12)]
        held = [node.client().dbsize() for node in cluster.nodes]
        assert sum(held) == 12 and sum(n > 0 for n in held) >= 2


@needs_redis
def test_rediss_with_client_certificates(tmp_path: Path, stores: Callable[..., BlockStore]) -> None:
    with RedisServer.start(tmp_path, tls=True) as server:
        certs = server.certs
        tls = {"tls_ca": str(certs / "ca.pem"), "tls_cert": str(certs / "client.pem"),
               "tls_key": str(certs / "client-key.pem")}
        a, b = stores(server.url, **tls), stores(server.url, **tls)
        keys = put_and_write(a, range(2))
        assert b.lookup(keys).num_hits == 2
        assert remote(b).stats().read_errors == 0


@needs_redis
def test_stats_metrics_and_the_cli_show_the_remote(tmp_path: Path, redis_server: RedisServer,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    config = RemoteConfig(redis_server.url, timeout_s=RELAXED_S)
    with running_server(tmp_path / "a", shm=False, remote=config) as a, \
            running_server(tmp_path / "b", shm=False, remote=config) as b:
        with KVStoreClient(a.address) as client:
            client.put([(key(i), payload(i)) for i in range(3)])
        assert a.store.remote is not None and a.store.remote.flush(10)
        with KVStoreClient(b.address) as client:
            assert client.lookup([key(i) for i in range(4)]).num_hits == 3
            stats = client.stats().remote
        assert stats is not None and (stats.hits, stats.misses, stats.breaker) == (3, 1, "closed")
        assert stats.url == redis_server.url and stats.read_latency.calls == 1

        def metric(name: str, **labels: str) -> float | None:
            return b.registry.get_sample_value(name, labels)

        assert metric("kvserve_kvstore_remote_hits_total") == 3
        assert metric("kvserve_kvstore_remote_breaker", state="closed") == 1
        assert metric("kvserve_kvstore_remote_breaker", state="open") == 0
        assert metric("kvserve_kvstore_remote_latency_seconds_count", op="read") == 1
        assert metric("kvserve_kvstore_remote_errors_total", op="read") == 0
        assert a.registry.get_sample_value("kvserve_kvstore_remote_written_blocks_total") == 3

        assert cli.main(["stats", "--kvstore", b.address, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)["kvstore"]["remote"]
        assert (report["hits"], report["misses"], report["breaker"]) == (3, 1, "closed")
        assert cli.main(["stats", "--kvstore", b.address]) == 0
        assert f"remote {redis_server.url}: breaker closed, hits 3, misses 1" in capsys.readouterr().out


def test_an_unreachable_remote_at_start_is_logged_without_its_password(
        caplog: pytest.LogCaptureFixture, stores: Callable[..., BlockStore]) -> None:
    (port,) = free_ports(1)  # nothing listens there
    with caplog.at_level(logging.INFO, logger="kvstore.remote_tier"):
        store = stores(f"redis://admin:hunter2@127.0.0.1:{port}/0", timeout_s=0.5)
    assert f"redis://admin:***@127.0.0.1:{port}/0" in caplog.text and "unreachable" in caplog.text
    assert "hunter2" not in caplog.text
    assert remote(store).stats().breaker == "open"
    assert store.put(key(1), payload(1)) and store.lookup([key(1), key(2)]).num_hits == 1
    assert remote(store).stats().read_errors == 0  # the breaker skips the calls


def test_a_full_write_queue_drops_its_oldest_blocks(stores: Callable[..., BlockStore]) -> None:
    (port,) = free_ports(1)
    store = stores(f"redis://127.0.0.1:{port}/0", timeout_s=0.5, queue_bytes=250)  # room for 2 blocks of 100
    for i in range(5):
        store.put(key(i), payload(i))
    stats = remote(store).stats()
    assert (stats.queued_blocks, stats.queued_bytes, stats.dropped_writes) == (2, 200, 3)


def test_the_breaker_opens_after_three_failures_and_lets_one_probe_through() -> None:
    clock = FakeClock()
    breaker = Breaker(clock)
    assert [breaker.failure() for _ in range(3)] == [False, False, True]
    assert breaker.state == "open" and not breaker.allow()
    clock.advance(1.0)
    assert breaker.allow() and breaker.state == "half_open" and not breaker.allow()  # one probe
    assert not breaker.failure() and breaker.state == "open"  # it failed: 2 s now
    clock.advance(1.5)
    assert not breaker.allow()
    clock.advance(0.5)
    assert breaker.allow()
    assert breaker.success() and breaker.state == "closed" and breaker.allow()
    for _ in range(12):  # probes that keep failing: the cool-down doubles up to 30 s
        breaker.failure()
        clock.advance(breaker.cooldown_s)
        breaker.allow()
    assert breaker.cooldown_s == 30.0


def test_the_flags_and_their_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_KVSTORE_REMOTE_URL", "rediss://redis.internal:6380/0")
    monkeypatch.setenv("KVSERVE_KVSTORE_REMOTE_CLUSTER", "true")
    config = remote_config(parse_args(parser(), ["--remote-ttl-s", "60", "--remote-tls-ca", "ca.pem"], "kvstore"))
    assert config == RemoteConfig("rediss://redis.internal:6380/0", cluster=True, ttl_s=60.0, tls_ca="ca.pem")
    monkeypatch.delenv("KVSERVE_KVSTORE_REMOTE_URL")
    with pytest.raises(ValueError, match="need --remote-url"):
        remote_config(parse_args(parser(), [], "kvstore"))
    with pytest.raises(ValueError, match="rediss://"):
        RemoteConfig("redis://h:1/0", tls_ca="ca.pem")
    with pytest.raises(ValueError, match="--remote-url must be"):
        RemoteConfig("http://h:1/0")
