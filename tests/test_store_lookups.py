"""One store lookup per request: decode's, whose answer prefill takes as its own (PrefillRequest.num_stored_blocks)
instead of looking the prefix up again. Counted at the store's client that decode and prefill share, over a real
store in this process; every lease ends with its request, however it ends."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import grpc
import pytest

from client import Client
from client.client import Result, build_request
from kvserve.handoff.requests import MalformedHandle, handle_from_proto
from kvstore import KVStoreClient, LookupResult
from kvstore.server import StoreServer
from prefill_service.client import PrefillClient
from protos.block_hash import BlockHash
from protos.kvserve.v1 import decode_pb2_grpc, prefill_pb2
from tests.kvstore_fixtures import running_server
from tests.model_faults import FaultyForward, never
from tests.polling import wait_until
from tests.stack_fixtures import BLOCK_SIZE, LocalStack, assert_greedy_matches, oracle, tokens

ARCH = "llama"


class CountingClient(KVStoreClient):
    """The store's client, counting its Lookups: each is one call the store answers."""

    def __init__(self, addr: str) -> None:
        super().__init__(addr, timeout_s=5.0, use_shm=False)
        self._lock = threading.Lock()
        self.lookups = 0

    def lookup(self, hashes: Sequence[BlockHash], lease_ttl_s: float | None = None) -> LookupResult:
        with self._lock:
            self.lookups += 1
        return super().lookup(hashes, lease_ttl_s)

    def counted(self) -> int:
        """Lookups since the last call."""
        with self._lock:
            n, self.lookups = self.lookups, 0
        return n

    def leases(self) -> int:
        return self.stats().leases


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreServer]:
    with running_server(tmp_path_factory.mktemp("store"), shm=False, host_capacity=64 << 20) as s:
        yield s


@pytest.fixture()
def store(server: StoreServer) -> Iterator[CountingClient]:
    client = CountingClient(server.address)
    yield client
    client.close()


def greedy(stack: LocalStack, ids: list[int], n: int = 4) -> Result:
    with Client(stack.addr, timeout_s=60) as c:
        r = c.generate(token_ids=ids, max_tokens=n, ignore_eos=True)
    assert_greedy_matches(r.token_ids, *oracle(ARCH, ids, n))
    return r


@pytest.mark.parametrize("local_prefill_tokens", [0, BLOCK_SIZE])
def test_one_lookup_per_request_through_decode_prefill_and_store(store: CountingClient, local_prefill_tokens: int
                                                                 ) -> None:
    """Cold: decode's lookup alone; prefill's puts hand back the lease on the blocks it stored for decode. Warm:
    decode's lookup alone, its hits leased until decode has loaded them; none where decode computes the prompt on
    what its own pool holds. While the store's Put handed back no lease: 2, 1, 2 (prefill leased what it stored with
    a Lookup after its put); before prefill took decode's answer: 2, 2, 2 at --local-prefill-tokens 0 (prefill's
    lookup, then its lease on every block), 3, 0, 3 at the threshold (decode's lookup as well)."""
    stack = LocalStack(ARCH, store=store, local_prefill_tokens=local_prefill_tokens)
    try:
        ids = tokens(3 * BLOCK_SIZE + 5 + local_prefill_tokens, seed=700 + local_prefill_tokens)
        cold = greedy(stack, ids)
        assert (cold.timings.prefill_path, store.counted(), store.leases()) == ("disaggregated", 1, 0)

        warm = greedy(stack, ids)  # at the threshold, computed here: decode's pool holds the blocks
        assert warm.usage.cached_tokens == len(ids) // BLOCK_SIZE * BLOCK_SIZE
        assert (store.counted(), store.leases()) == (0 if local_prefill_tokens else 1, 0)

        bigger = ids + tokens(2 * BLOCK_SIZE, seed=710)  # a next turn: two blocks more, through prefill
        turn = greedy(stack, bigger)
        assert (turn.timings.prefill_path, turn.usage.cached_tokens) == ("disaggregated", warm.usage.cached_tokens)
        assert (store.counted(), store.leases()) == (1, 0)
    finally:
        stack.close()


def test_a_prefill_fallback_computes_on_decodes_lookup(store: CountingClient) -> None:
    """Prefill unavailable: decode computes the prompt on what its one lookup found, and lets go of its lease."""
    seed = LocalStack(ARCH, store=store)
    ids = tokens(3 * BLOCK_SIZE + 5, seed=720)
    try:
        greedy(seed, ids)
    finally:
        seed.close()
    store.counted()
    stack = LocalStack(ARCH, store=store, wrap_prefill_client=lambda _: PrefillClient("127.0.0.1:1", timeout_s=5))
    try:
        r = greedy(stack, ids)
        assert (r.timings.prefill_path, r.usage.cached_tokens) == ("local", 3 * BLOCK_SIZE)
        assert (store.counted(), store.leases()) == (1, 0)
    finally:
        stack.close()


def test_a_request_cancelled_during_prefill_lets_go_of_its_lease(store: CountingClient) -> None:
    gate, held = threading.Event(), threading.Event()

    def hold(positions: object) -> bool:  # prefill's forwards wait at the gate until it opens
        held.set()
        gate.wait(30)
        return False

    fault = FaultyForward(never)
    stack = LocalStack(ARCH, store=store, wrap_prefill_model=fault.around)
    ids = tokens(3 * BLOCK_SIZE + 5, seed=730)
    try:
        greedy(stack, ids[: 3 * BLOCK_SIZE + 1])  # the store holds the first three blocks
        fault.fails = hold
        with grpc.insecure_channel(stack.addr) as channel:
            call = decode_pb2_grpc.DecodeStub(channel).Generate(build_request(token_ids=ids, max_tokens=4))
            wait_until(held.is_set, interval_s=0.02, message="prefill never started computing")
            assert store.leases() == 1  # decode's, on the three blocks its lookup found
            call.cancel()
            with pytest.raises(grpc.RpcError):
                list(call)
            wait_until(lambda: store.leases() == 0, interval_s=0.02, message="decode's lease outlived its request")
    finally:
        gate.set()
        stack.close()


def test_a_handle_with_a_lease_id_past_its_bound_is_malformed() -> None:
    """A lease id comes from another process, and decode sends it on to the store: a store's are 32 characters."""
    answer = prefill_pb2.PrefillResponse(request_id="r", prompt_token_ids=[1, 2], block_size=BLOCK_SIZE,
                                         lease_id="a" * 64)
    assert handle_from_proto(answer).lease_id == "a" * 64
    answer.lease_id = "a" * 65
    with pytest.raises(MalformedHandle, match="a lease id of 65 characters"):
        handle_from_proto(answer)
