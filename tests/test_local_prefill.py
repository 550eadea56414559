"""Decode computes a prompt itself when its uncached part is short (--local-prefill-tokens): which
path each request took (threshold on and off, prefill down), tokens equal to the oracle on both,
the same seeded tokens on both, the store's blocks used when this decode's pool lacks them, and the
pool's blocks announced to a router (DecodeReplica.Events, tier ENGINE)."""

from __future__ import annotations

import grpc

from client import Client
from kvserve.engine.hashing import prefix_hashes
from protos.kvserve.v1 import decode_pb2_grpc, kvstore_pb2
from tests.stack_fixtures import (
    BLOCK_SIZE,
    FakeStore,
    LocalStack,
    assert_greedy_matches,
    greedy,
    oracle,
    stack_fixture,
    tokens,
)

ARCH = "llama"
THRESHOLD = 2 * BLOCK_SIZE


stack = stack_fixture(LocalStack, ARCH, local_prefill_tokens=THRESHOLD)


def paths(stack: LocalStack) -> tuple[float, float]:
    return (stack.decode_metric("kvserve_decode_prefills_total", path="local"),
            stack.decode_metric("kvserve_decode_prefills_total", path="disaggregated"))


def test_a_chats_next_turn_is_computed_here_and_matches_the_oracle(stack: LocalStack) -> None:
    history = tokens(5 * BLOCK_SIZE + 3, seed=71)
    with Client(stack.addr, timeout_s=60) as c:
        before = paths(stack)
        first = greedy(c, history, 8)  # all of it uncached, more than the threshold: prefill computes it
        assert first.timings.prefill_path == "disaggregated"
        turn = [*history, *first.token_ids, *tokens(BLOCK_SIZE + 2, seed=72)]
        want, logits = oracle(ARCH, turn, 12)
        second = greedy(c, turn, 12)
        assert second.timings.prefill_path == "local"
        assert_greedy_matches(second.token_ids, want, logits)
        # the history's full blocks, from this decode's own pool (the reply's included)
        assert second.usage.cached_tokens == (len(history) + len(first.token_ids)) // BLOCK_SIZE * BLOCK_SIZE
        assert paths(stack) == (before[0] + 1, before[1] + 1)
        t = second.timings
        assert 0 < t.ttft_s <= t.total_s and t.prefill_s == t.ttft_s


def test_a_short_prompt_is_computed_here_even_when_cold(stack: LocalStack) -> None:
    ids = tokens(THRESHOLD, seed=73)
    want, logits = oracle(ARCH, ids, 10)
    with Client(stack.addr, timeout_s=60) as c:
        cold = greedy(c, ids, 10, prefix_cache=False)
        warm = greedy(c, ids, 10)
    assert cold.timings.prefill_path == warm.timings.prefill_path == "local"
    assert_greedy_matches(cold.token_ids, want, logits)
    assert warm.token_ids == cold.token_ids and cold.usage.cached_tokens == 0


def test_seeded_sampling_gives_the_same_tokens_on_either_path(stack: LocalStack) -> None:
    ids = tokens(THRESHOLD + 3 * BLOCK_SIZE, seed=74)
    with Client(stack.addr, timeout_s=60) as c:
        kw = dict(max_tokens=16, ignore_eos=True, temperature=1.0, seed=1234, prefix_cache=False)
        remote = c.generate(token_ids=ids, **kw)  # type: ignore[arg-type]
        local = c.generate(token_ids=ids[-THRESHOLD:], **kw)  # type: ignore[arg-type]
        local_again = c.generate(token_ids=ids[-THRESHOLD:], **kw)  # type: ignore[arg-type]
    assert remote.timings.prefill_path == "disaggregated" and local.timings.prefill_path == "local"
    assert local.token_ids == local_again.token_ids
    threshold_off = LocalStack(ARCH, local_prefill_tokens=0)
    try:
        with Client(threshold_off.addr, timeout_s=60) as c:
            remote_short = c.generate(token_ids=ids[-THRESHOLD:], **kw)  # type: ignore[arg-type]
            remote_again = c.generate(token_ids=ids, **kw)  # type: ignore[arg-type]
    finally:
        threshold_off.close()
    assert remote_short.timings.prefill_path == "disaggregated"
    assert remote_short.token_ids == local.token_ids  # the same seed, the same tokens, wherever the first was drawn
    assert remote_again.token_ids == remote.token_ids


def test_threshold_zero_sends_every_prompt_to_prefill() -> None:
    s = LocalStack(ARCH, local_prefill_tokens=0)
    try:
        ids = tokens(BLOCK_SIZE, seed=75)
        with Client(s.addr, timeout_s=60) as c:
            a, b = greedy(c, ids, 4), greedy(c, [*ids, 1, 2], 4)
        assert a.timings.prefill_path == b.timings.prefill_path == "disaggregated"
        assert s.decode_metric("kvserve_decode_prefills_total", path="local") == 0
    finally:
        s.close()


def test_a_decode_without_the_history_in_its_pool_loads_it_from_the_store() -> None:
    store = FakeStore()
    a = LocalStack(ARCH, store=store, local_prefill_tokens=THRESHOLD)
    b = LocalStack(ARCH, store=store, local_prefill_tokens=THRESHOLD)
    try:
        history = tokens(6 * BLOCK_SIZE, seed=76)
        with Client(a.addr, timeout_s=60) as c:
            first = greedy(c, history, 6)
        turn = [*history, *first.token_ids, *tokens(BLOCK_SIZE, seed=77)]
        want, logits = oracle(ARCH, turn, 10)
        with Client(b.addr, timeout_s=60) as c:
            second = greedy(c, turn, 10)
        assert second.timings.prefill_path == "local"
        assert_greedy_matches(second.token_ids, want, logits)
        assert second.usage.cached_tokens == (len(history) + len(first.token_ids)) // BLOCK_SIZE * BLOCK_SIZE
        assert b.prefill_metric("kvserve_prefill_requests_total", outcome="ok") == 0
    finally:
        a.close()
        b.close()


def test_with_prefill_down_decode_computes_every_prompt_itself() -> None:
    s = LocalStack(ARCH, local_prefill_tokens=0)
    try:
        s.prefill_server.stop(0)
        ids = tokens(4 * BLOCK_SIZE + 1, seed=78)
        want, logits = oracle(ARCH, ids, 8)
        with Client(s.addr, timeout_s=60) as c:
            r = greedy(c, ids, 8)
        assert r.timings.prefill_path == "local"
        assert_greedy_matches(r.token_ids, want, logits)
    finally:
        s.close()


def test_the_replica_announces_its_pool_blocks(stack: LocalStack) -> None:
    ids = tokens(3 * BLOCK_SIZE + 1, seed=79)
    with Client(stack.addr, timeout_s=60) as c:
        greedy(c, ids, 2)
    want = set(prefix_hashes(ids[: 3 * BLOCK_SIZE], BLOCK_SIZE, stack.decode.engine.namespace().root()))
    with grpc.insecure_channel(stack.addr) as channel:
        call = decode_pb2_grpc.DecodeReplicaStub(channel).Events(kvstore_pb2.EventsRequest(), timeout=10)
        snapshot = next(call)  # the pool's blocks now, before any change
        call.cancel()
    assert snapshot.tier == kvstore_pb2.TIER_ENGINE and snapshot.kind == kvstore_pb2.Event.KIND_STORED
    assert want <= set(snapshot.hashes)
