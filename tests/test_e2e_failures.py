"""End to end, the failure policy with real processes: the store SIGKILLed and restarted, prefill
killed (decode computes the prompt itself), bad input through the whole stack, and concurrent streams."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from client import Client
from client.client import InvalidArgumentError, OutOfRangeError
from kvserve.engine.hashing import Namespace, prefix_hashes
from kvserve.engine.model import model_fingerprint
from kvstore import KVStoreClient
from tests.polling import wait_until
from tests.stack_fixtures import (
    BLOCK_SIZE,
    ProcessStack,
    assert_greedy_matches,
    model_dir,
    oracle,
    stack_fixture,
    tokens,
)

pytestmark = pytest.mark.slow

ARCH = "llama"


stack = stack_fixture(ProcessStack, "failures", [ARCH])


@pytest.fixture(scope="module")
def client(stack: ProcessStack) -> Iterator[Client]:
    with Client(stack.decode[ARCH].addr, timeout_s=60) as c:
        yield c


def test_concurrent_streams_give_the_tokens_of_sequential_ones(client: Client) -> None:
    prompts = [tokens(20 + 9 * i, seed=300 + i) for i in range(4)]
    alone = [client.generate(token_ids=p, max_tokens=32, ignore_eos=True).token_ids for p in prompts]
    together: list[tuple[int, ...] | None] = [None] * len(prompts)

    def run(i: int) -> None:
        together[i] = client.generate(token_ids=prompts[i], max_tokens=32, ignore_eos=True).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert together == alone


def test_bad_input_gets_a_precise_status(client: Client) -> None:
    with pytest.raises(InvalidArgumentError, match="top_p"):
        client.generate("hi", top_p=2.0)
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        client.generate(token_ids=[5, 1 << 20])
    with pytest.raises(InvalidArgumentError, match="unknown chat role"):
        client.chat([{"role": "narrator", "content": "hi"}])
    with pytest.raises(OutOfRangeError, match=r"max_tokens \(9000\)"):
        client.generate("hi", max_tokens=9000)


@pytest.mark.parametrize("shm", [pytest.param(True, id="shm"), pytest.param(False, id="no-shm")])
def test_store_killed_then_restarted(stack: ProcessStack, shm: bool) -> None:
    if shm:
        check_store_restart(stack)
        return
    own = ProcessStack("failures-no-shm", [ARCH], ["--no-shm"])
    try:
        check_store_restart(own)
    finally:
        own.stop()


def check_store_restart(stack: ProcessStack) -> None:
    """Fresh prompts throughout: a prompt seen before would be reused from the services' own KV pools,
    whatever the store does."""
    def fresh(seed: int) -> tuple[list[int], int]:
        """A new prompt's answer checked against the oracle: (prompt, its cached tokens)."""
        ids = tokens(4 * BLOCK_SIZE + 5, seed=seed)
        want, logits = oracle(ARCH, ids, 16)
        got = client.generate(token_ids=ids, max_tokens=16, ignore_eos=True)
        assert_greedy_matches(got.token_ids, want, logits)
        return ids, got.usage.cached_tokens

    namespace = Namespace(model_fingerprint(model_dir(ARCH)), "float32", BLOCK_SIZE)
    with Client(stack.decode[ARCH].addr, timeout_s=60) as client:
        fresh(400)
        stack.kill_store()
        assert fresh(401)[1] == 0

        stack.restart_store()
        seeds = iter(range(402, 10_000))

        def a_new_prompt_is_stored() -> bool:
            ids, _ = fresh(next(seeds))
            with KVStoreClient(stack.store.addr) as store:  # the blocks prefill computed went to the store
                return store.lookup(prefix_hashes(ids, BLOCK_SIZE, namespace.root())).num_hits == 4

        # the services' store channels reconnect with backoff
        wait_until(a_new_prompt_is_stored, timeout_s=15, interval_s=0.5,
                   message="the store was not used again after it restarted")


def test_with_prefill_killed_decode_computes_the_prompt_itself(stack: ProcessStack, client: Client) -> None:
    stack.prefill[ARCH].process.kill()
    stack.prefill[ARCH].process.wait()
    ids = tokens(40 * BLOCK_SIZE + 3, seed=310)  # longer than --local-prefill-tokens: prefill's, were it up
    want, logits = oracle(ARCH, ids, 6)
    r = client.generate(token_ids=ids, max_tokens=6, ignore_eos=True)
    assert r.timings.prefill_path == "local"
    assert_greedy_matches(r.token_ids, want, logits)
