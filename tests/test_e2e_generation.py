"""End to end, three processes per model on loopback: greedy output equals Hugging Face `generate`
for llama, qwen2 and gpt2 in every cache state (cold, fully warm, partial hit, spilled to disk);
multi-turn chats hit on the previous reply; users share a system prompt unless salted apart."""

from __future__ import annotations

import pytest

from client import Client
from client.client import Result
from kvstore import KVStoreClient
from tests.stack_fixtures import (
    ARCHS,
    BLOCK_SIZE,
    ProcessStack,
    assert_greedy_matches,
    greedy,
    oracle,
    stack_fixture,
    tokens,
)

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
# A few prompts' blocks fit in RAM; the filler below pushes older ones down to the disk tier.
HOST_CAPACITY = "384KiB"


# Every cache state through the hand-off: decode at --local-prefill-tokens 0 asks prefill for every prompt
# (tests/test_local_prefill.py covers decode computing prompts itself).
stack = stack_fixture(ProcessStack, "generation", ARCHS, ["--host-capacity", HOST_CAPACITY],
                      ["--local-prefill-tokens", "0"])


def check(arch: str, ids: list[int], r: Result) -> None:
    want, logits = oracle(arch, ids, NEW_TOKENS)
    assert_greedy_matches(r.token_ids, want, logits)
    assert r.finish_reason == "length" and len(r.token_ids) == NEW_TOKENS


def disk_hits(store: KVStoreClient) -> int:
    return sum(t.hits for t in store.stats().tiers if t.tier == "disk")


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_in_every_cache_state(stack: ProcessStack, arch: str) -> None:
    seed = 1000 * (ARCHS.index(arch) + 1)
    a = tokens(5 * BLOCK_SIZE + 7, seed=seed)
    with Client(stack.decode[arch].addr, timeout_s=60) as c, KVStoreClient(stack.store.addr) as store:
        cold = greedy(c, a, NEW_TOKENS)
        assert cold.usage.cached_tokens == 0
        check(arch, a, cold)

        warm = greedy(c, a, NEW_TOKENS)
        assert warm.usage.cached_tokens == 5 * BLOCK_SIZE
        check(arch, a, warm)

        b = a[: 3 * BLOCK_SIZE] + tokens(20, seed=seed + 1)
        partial = greedy(c, b, NEW_TOKENS)
        assert partial.usage.cached_tokens == 3 * BLOCK_SIZE
        check(arch, b, partial)

        for i in range(2):  # more than the host tier holds: a's blocks move to disk
            greedy(c, tokens(20 * BLOCK_SIZE, seed=seed + 10 + i), n=1)
        before = disk_hits(store)
        spilled = greedy(c, a, NEW_TOKENS)
        assert spilled.usage.cached_tokens == 5 * BLOCK_SIZE
        assert disk_hits(store) > before, "the spilled request did not read the disk tier"
        check(arch, a, spilled)


def test_multi_turn_hits_on_the_previous_reply(stack: ProcessStack) -> None:
    with Client(stack.decode["llama"].addr, timeout_s=60) as c:
        turn1 = tokens(3 * BLOCK_SIZE + 11, seed=1)
        r1 = c.generate(token_ids=turn1, max_tokens=50, ignore_eos=True)
        turn2 = [*turn1, *r1.token_ids, *tokens(17, seed=2)]
        r2 = c.generate(token_ids=turn2, max_tokens=NEW_TOKENS, ignore_eos=True)
        assert r2.usage.cached_tokens >= len(turn1) + len(r1.token_ids) - 2 * BLOCK_SIZE
        check("llama", turn2, r2)
        turn3 = [*turn2, *r2.token_ids, *tokens(5, seed=3)]
        r3 = c.generate(token_ids=turn3, max_tokens=NEW_TOKENS, ignore_eos=True)
        assert r3.usage.cached_tokens >= len(turn2) + len(r2.token_ids) - 2 * BLOCK_SIZE


SYSTEM = (
    "You are the support assistant of a company that builds tiered key-value caches for language "
    "model serving. Answer briefly, cite the design document where you can, and never invent numbers."
)


def test_users_share_a_system_prompt_unless_salted_apart(stack: ProcessStack) -> None:
    def ask(c: Client, question: str, salt: str | None = None) -> Result:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        return c.chat(messages, max_tokens=8, cache_salt=salt)

    system_tokens = len(SYSTEM.encode())  # one token per byte in the tiny tokenizers
    with Client(stack.decode["qwen2"].addr, timeout_s=60) as c:
        first = ask(c, "How do leases work?")
        assert first.usage.cached_tokens == 0
        other = ask(c, "What happens when the store is down?")
        assert other.usage.cached_tokens >= system_tokens - BLOCK_SIZE
        assert ask(c, "And with another tenant?", salt="tenant-b").usage.cached_tokens == 0
        assert ask(c, "Same tenant again?", salt="tenant-b").usage.cached_tokens >= system_tokens - BLOCK_SIZE
