"""End to end, two nodes sharing one Redis: each node runs its own store, prefill and decode as real
processes, and the stores share blocks through the remote tier under one record key. A prompt computed on
node A is cached on node B with the tokens Hugging Face generates; records moved between a prompt's blocks
in Redis are misses, never wrong tokens; and a Redis stopped mid-run fails no request."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from client import Client
from kvserve.engine.hashing import Namespace, prefix_hashes
from kvserve.engine.model import model_fingerprint
from kvstore import KVStoreClient
from kvstore.block_format import RECORD_VERSION
from kvstore.record_key import write_new
from kvstore.types import RemoteStats
from tests.polling import wait_until
from tests.redis_fixtures import RedisServer, needs_redis
from tests.stack_fixtures import BLOCK_SIZE, ProcessStack, assert_greedy_matches, model_dir, oracle, tokens

pytestmark = [pytest.mark.slow, needs_redis]

ARCH = "llama"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def shared_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The one Redis both nodes share, for the whole module."""
    with RedisServer.start(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def nodes(shared_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[ProcessStack, ProcessStack]]:
    # The URL through the environment, as a deployment with a password would pass it.
    record_key = write_new(tmp_path_factory.mktemp("record-key") / "record-key")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KVSERVE_KVSTORE_REMOTE_URL", shared_redis.url)
        env.setenv("KVSERVE_KVSTORE_RECORD_KEY_FILE", str(record_key))
        a = ProcessStack("remote-a", [ARCH], ["--remote-timeout-s", "2"])
        try:
            b = ProcessStack("remote-b", [ARCH], ["--remote-timeout-s", "2"])
        except BaseException:
            a.stop()
            raise
    yield a, b
    a.stop()
    b.stop()


def remote_stats(node: ProcessStack) -> RemoteStats:
    with KVStoreClient(node.store.addr) as store:
        stats = store.stats().remote
    assert stats is not None
    return stats


def generate(node: ProcessStack, ids: list[int]) -> tuple[tuple[int, ...], int]:
    """The oracle-checked answer of `node` to `ids`, and its cached tokens."""
    want, logits = oracle(ARCH, ids, MAX_TOKENS)
    with Client(node.decode[ARCH].addr, timeout_s=60) as client:
        got = client.generate(token_ids=ids, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert_greedy_matches(got.token_ids, want, logits)
    return got.token_ids, got.usage.cached_tokens


def redis_names(ids: list[int]) -> list[str]:
    """The Redis keys of the prompt's full blocks."""
    root = Namespace(model_fingerprint(model_dir(ARCH)), "float32", BLOCK_SIZE).root()
    return [f"kvserve:v{RECORD_VERSION}:{h.hex()}" for h in prefix_hashes(ids, BLOCK_SIZE, root)]


def wait_written(redis_server: RedisServer, ids: list[int], timeout_s: float = 30.0) -> None:
    """Until every full block of the prompt is in Redis (the stores write behind)."""
    names = redis_names(ids)
    client = redis_server.client()
    wait_until(lambda: client.exists(*names) == len(names), timeout_s,
               message="the store did not write the prompt's blocks to Redis")


def test_a_prompt_computed_on_one_node_is_cached_on_the_other(
        nodes: tuple[ProcessStack, ProcessStack], shared_redis: RedisServer) -> None:
    a, b = nodes
    ids = tokens(5 * BLOCK_SIZE + 3, seed=700)
    on_a, cached_a = generate(a, ids)
    assert cached_a == 0
    wait_written(shared_redis, ids)

    on_b, cached_b = generate(b, ids)
    assert cached_b == 5 * BLOCK_SIZE  # every full block; the last prompt token is always computed
    assert on_b == on_a
    stats = remote_stats(b)
    assert stats.hits >= 5 and stats.breaker == "closed" and stats.read_errors == 0
    assert stats.mac_failures == 0


def test_records_moved_between_a_prompts_blocks_in_redis_are_misses_not_wrong_tokens(
        nodes: tuple[ProcessStack, ProcessStack], shared_redis: RedisServer) -> None:
    a, b = nodes
    ids = tokens(5 * BLOCK_SIZE + 3, seed=730)
    on_a, _ = generate(a, ids)
    wait_written(shared_redis, ids)
    names = redis_names(ids)
    client = shared_redis.client()
    second, third = client.get(names[1]), client.get(names[2])
    client.set(names[1], third or b"", keepttl=True)  # valid records, each under the other's key
    client.set(names[2], second or b"", keepttl=True)
    before = remote_stats(b)

    on_b, cached_b = generate(b, ids)  # checked against Hugging Face's tokens
    assert on_b == on_a
    assert cached_b == BLOCK_SIZE  # block 0 from Redis; block 1 is the first miss, and everything after it
    after = remote_stats(b)
    assert after.hits - before.hits == 1
    assert after.mac_failures - before.mac_failures == 2  # one Lookup read both moved records
    assert after.checksum_failures == before.checksum_failures


def test_a_redis_stopped_mid_run_fails_no_request(
        nodes: tuple[ProcessStack, ProcessStack], shared_redis: RedisServer) -> None:
    a, b = nodes
    shared_redis.stop()
    try:
        for i, node in enumerate([a, b, a, b, b]):
            generate(node, tokens(3 * BLOCK_SIZE + 5, seed=710 + i))  # each checked against the oracle
        assert remote_stats(b).read_errors > 0 and remote_stats(b).breaker != "closed"
        assert remote_stats(a).write_errors > 0
    finally:
        shared_redis.restart()

    # Back (empty): once the breakers let a probe through, what A computes reaches B again.
    seeds = iter(range(720, 10_000))
    last = ["node A never wrote to Redis again"]

    def a_new_prompt_from_a_reaches_b() -> bool:
        ids = tokens(3 * BLOCK_SIZE + 5, seed=next(seeds))
        generate(a, ids)
        try:
            wait_written(shared_redis, ids, timeout_s=2.0)
        except AssertionError:
            last[0] = "node A never wrote to Redis again"
            return False
        last[0] = "node B never read from Redis again"
        return generate(b, ids)[1] == 3 * BLOCK_SIZE

    wait_until(a_new_prompt_from_a_reaches_b, timeout_s=60, interval_s=0, message=lambda: last[0])
