"""End to end over a store whose top tier is a device arena (on a CPU here: the same slots, socket and
calls as on a GPU, which the `gpu` tests cover): prefill puts blocks into arena slots and decode copies
them out as tensors; greedy output equals Hugging Face `generate` cold, warm, on a partial hit and
after the blocks went down to the disk tier."""

from __future__ import annotations

import pytest

from client import Client
from kvstore import KVStoreClient
from tests.stack_fixtures import (
    BLOCK_SIZE,
    ProcessStack,
    assert_greedy_matches,
    oracle,
    stack_fixture,
    tokens,
)

pytestmark = pytest.mark.slow

ARCH = "llama"
NEW_TOKENS = 16


# about 20 blocks of the test model in each memory tier
# every prompt through the hand-off (decode at --local-prefill-tokens 0), so that blocks cross the arena
stack = stack_fixture(ProcessStack, "device-arena", [ARCH], ["--device", "cpu", "--device-capacity", "512KiB",
                                                             "--host-capacity", "512KiB"],
                      ["--local-prefill-tokens", "0"])


def test_greedy_matches_hf_through_the_device_arena_in_every_cache_state(stack: ProcessStack) -> None:
    a = tokens(5 * BLOCK_SIZE + 7, seed=77)
    want, logits = oracle(ARCH, a, NEW_TOKENS)
    with Client(stack.decode[ARCH].addr, timeout_s=60) as c, KVStoreClient(stack.store.addr) as store:
        assert store.tensor_device() is not None  # this process, like prefill and decode, opened the arena

        def run(ids: list[int], n: int = NEW_TOKENS) -> list[int]:
            return c.generate(token_ids=ids, max_tokens=n, ignore_eos=True).token_ids

        assert_greedy_matches(run(a), want, logits)
        device = store.stats().tier("device")
        assert device.blocks >= 5, "prefill's blocks did not land in the device arena"
        warm = c.generate(token_ids=a, max_tokens=NEW_TOKENS, ignore_eos=True)
        assert warm.usage.cached_tokens == 5 * BLOCK_SIZE
        assert_greedy_matches(warm.token_ids, want, logits)
        assert store.stats().tier("device").hits > device.hits

        b = a[: 3 * BLOCK_SIZE] + tokens(20, seed=78)
        partial = c.generate(token_ids=b, max_tokens=NEW_TOKENS, ignore_eos=True)
        assert partial.usage.cached_tokens == 3 * BLOCK_SIZE
        assert_greedy_matches(partial.token_ids, *oracle(ARCH, b, NEW_TOKENS))

        for i in range(3):  # more than the arena and the host tier hold: a's blocks go down to disk
            run(tokens(20 * BLOCK_SIZE, seed=80 + i), n=1)
        disk_hits = store.stats().tier("disk").hits
        spilled = c.generate(token_ids=a, max_tokens=NEW_TOKENS, ignore_eos=True)
        assert spilled.usage.cached_tokens == 5 * BLOCK_SIZE
        assert store.stats().tier("disk").hits > disk_hits
        assert_greedy_matches(spilled.token_ids, want, logits)
        assert store.stats().checksum_failures == 0
