"""The prefill service in process over an in-memory store: hits, misses, bad blocks, a store that
is down, request options, and the status of every kind of bad input."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from kvserve.engine.hashing import prefix_hashes
from kvserve.engine.sampling import SamplingParams
from kvserve.handoff.requests import PromptInput, RequestOptions
from kvserve.rpc.server import Server
from prefill_service.metrics import PrefillMetrics
from prefill_service.server import SERVICE_NAME, PrefillServicer
from prefill_service.service import PrefillJob, PrefillService
from protos.kvserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from tests.stack_fixtures import BLOCK_SIZE, FakeStore, engine, oracle, tokens

ARCH = "llama"


@pytest.fixture()
def store() -> FakeStore:
    return FakeStore()


def _service(store: FakeStore) -> PrefillService:
    service = PrefillService(engine(ARCH), store, PrefillMetrics(Server("127.0.0.1:0").registry))  # type: ignore[arg-type]
    service.start()
    return service


@pytest.fixture()
def service(store: FakeStore) -> Iterator[PrefillService]:
    s = _service(store)
    yield s
    s.stop()


@pytest.fixture()
def replica(store: FakeStore) -> Iterator[PrefillService]:
    """A second prefill over the same store, with a KV pool of its own: what it reuses comes from the store."""
    s = _service(store)
    yield s
    s.stop()


def job(ids: list[int], num_stored_blocks: int | None = None, **options: object) -> PrefillJob:
    return PrefillJob("req", PromptInput(token_ids=tuple(ids)), RequestOptions(SamplingParams(), **options),  # type: ignore[arg-type]
                      num_stored_blocks=num_stored_blocks)


def metric(service: PrefillService, name: str, **labels: str) -> float:
    return service.metrics.registry.get_sample_value(name, labels) or 0.0


def test_cold_then_warm_prefill(service: PrefillService, replica: PrefillService, store: FakeStore) -> None:
    ids = tokens(5 * BLOCK_SIZE + 7, seed=1)
    cold = service.prefill(job(ids))
    root = service.engine.namespace().root()
    assert list(cold.block_hashes) == prefix_hashes(ids, BLOCK_SIZE, root)
    assert (cold.num_cached_tokens, cold.num_computed_tokens) == (0, len(ids))
    assert store.persistent_keys() == set(cold.block_hashes)
    assert cold.tail_key in store.ephemeral and len(cold.tail_key) == 32
    assert cold.lease_id and store.leases[cold.lease_id] == [*cold.block_hashes, cold.tail_key]  # its puts' lease
    assert cold.first_token_id == oracle(ARCH, ids, 1)[0][0]

    store.calls.clear()
    warm = replica.prefill(job(ids))  # from the store
    assert (warm.num_cached_tokens, warm.num_computed_tokens) == (5 * BLOCK_SIZE, 7)
    assert warm.first_token_id == cold.first_token_id
    assert warm.tail_key != cold.tail_key  # request-scoped
    assert "get" in store.calls
    assert metric(replica, "kvserve_prefill_cached_tokens_total") == 5 * BLOCK_SIZE

    store.calls.clear()
    again = service.prefill(job(ids))  # from its own KV pool: the store is not asked for blocks
    assert (again.num_cached_tokens, again.first_token_id) == (5 * BLOCK_SIZE, cold.first_token_id)
    assert "get" not in store.calls
    assert metric(service, "kvserve_prefill_engine_pool_hit_tokens_total") == 5 * BLOCK_SIZE
    assert metric(service, "kvserve_prefill_requests_total", outcome="ok") == 2


def test_a_prompt_of_whole_blocks_computes_its_last_block(service: PrefillService, replica: PrefillService) -> None:
    ids = tokens(4 * BLOCK_SIZE, seed=2)
    service.prefill(job(ids))
    assert (service.prefill(job(ids)).num_cached_tokens, replica.prefill(job(ids)).num_cached_tokens) == (
        3 * BLOCK_SIZE, 3 * BLOCK_SIZE)
    warm = replica.prefill(job(ids))
    assert (warm.num_cached_tokens, warm.num_computed_tokens) == (3 * BLOCK_SIZE, BLOCK_SIZE)
    assert warm.tail_key is None


def test_partial_hit_reuses_the_shared_blocks(service: PrefillService, replica: PrefillService) -> None:
    shared = tokens(3 * BLOCK_SIZE, seed=3)
    service.prefill(job(shared + tokens(20, seed=4)))
    other, third = shared + tokens(25, seed=5), shared + tokens(30, seed=6)
    for h, ids in ((replica.prefill(job(other)), other), (service.prefill(job(third)), third)):  # store, pool
        assert (h.num_cached_tokens, h.num_computed_tokens) == (3 * BLOCK_SIZE, len(ids) - 3 * BLOCK_SIZE)
        assert h.first_token_id == oracle(ARCH, ids, 1)[0][0]


def test_a_corrupt_block_ends_the_hit_run(service: PrefillService, replica: PrefillService, store: FakeStore) -> None:
    ids = tokens(4 * BLOCK_SIZE + 3, seed=6)
    cold = service.prefill(job(ids))
    store.corrupt(cold.block_hashes[2])
    h = replica.prefill(job(ids))
    assert (h.num_cached_tokens, h.num_computed_tokens) == (2 * BLOCK_SIZE, 2 * BLOCK_SIZE + 3)
    assert h.first_token_id == cold.first_token_id
    assert store.checksum_failures == 1  # the store's client finds it and reports a miss


def test_store_down_recomputes_and_counts_it(service: PrefillService, replica: PrefillService, store: FakeStore
                                             ) -> None:
    ids = tokens(3 * BLOCK_SIZE + 1, seed=7)
    service.prefill(job(ids))
    store.down = True
    store.calls.clear()
    h = replica.prefill(job(ids))
    assert (h.num_cached_tokens, h.num_computed_tokens) == (0, len(ids))
    assert h.lease_id == "" and h.first_token_id == oracle(ARCH, ids, 1)[0][0]
    assert store.calls == ["lookup"]  # the first failure ends the store's part in the request
    assert metric(replica, "kvserve_prefill_store_failures_total", op="lookup") == 1
    assert metric(replica, "kvserve_prefill_requests_total", outcome="ok") == 1


def test_prefix_cache_off_uses_request_scoped_ephemeral_keys(service: PrefillService, store: FakeStore) -> None:
    ids = tokens(2 * BLOCK_SIZE + 5, seed=8)
    service.prefill(job(ids))
    store.calls.clear()
    h = service.prefill(job(ids, prefix_cache=False))
    assert (h.num_cached_tokens, h.num_computed_tokens) == (0, len(ids))
    assert not set(h.block_hashes) & set(prefix_hashes(ids, BLOCK_SIZE, service.engine.namespace().root()))
    assert set(h.block_hashes) <= store.ephemeral
    assert store.calls[0] == "put"  # no lookup


def test_cache_salt_separates_tenants(service: PrefillService) -> None:
    ids = tokens(3 * BLOCK_SIZE + 2, seed=9)
    a = service.prefill(job(ids, cache_salt="a"))
    b = service.prefill(job(ids, cache_salt="b"))
    assert b.num_cached_tokens == 0 and not set(a.block_hashes) & set(b.block_hashes)
    assert service.prefill(job(ids, cache_salt="a")).num_cached_tokens == 3 * BLOCK_SIZE


def test_the_callers_lookup_is_taken_as_prefills_own(service: PrefillService, replica: PrefillService,
                                                     store: FakeStore) -> None:
    """Told what the caller's lookup found (decode's), prefill looks nothing up, and its puts lease for decode
    only the blocks past that count (and the tail): the caller's own lease pins those."""
    ids = tokens(4 * BLOCK_SIZE + 3, seed=10)
    service.prefill(job(ids[: 2 * BLOCK_SIZE + 1]))  # the store holds the first two blocks
    store.calls.clear()
    h = replica.prefill(job(ids, num_stored_blocks=2))
    assert store.calls[0] == "get" and "lookup" not in store.calls  # its puts hand back the lease
    assert (h.num_cached_tokens, h.first_token_id) == (2 * BLOCK_SIZE, oracle(ARCH, ids, 1)[0][0])
    assert store.leases[h.lease_id] == [*h.block_hashes[2:], h.tail_key]
    store.calls.clear()
    tail_only = replica.prefill(job(ids[: 2 * BLOCK_SIZE + 5], num_stored_blocks=2))
    assert store.leases[tail_only.lease_id] == [tail_only.tail_key]  # no new full block: only its tail
    assert "lookup" not in store.calls


def test_a_wrong_count_from_the_caller_costs_recomputation_only(service: PrefillService, replica: PrefillService,
                                                                store: FakeStore) -> None:
    ids = tokens(3 * BLOCK_SIZE + 3, seed=11)
    first = oracle(ARCH, ids, 1)[0][0]
    h = replica.prefill(job(ids, num_stored_blocks=2**32 - 1))  # cut to the prompt; the store has none of them
    assert (h.num_cached_tokens, h.num_computed_tokens, h.first_token_id) == (0, len(ids), first)
    assert store.persistent_keys() == set(h.block_hashes)  # computed, and stored
    h = service.prefill(job(ids, num_stored_blocks=0))  # the store has them all: computed again, not read
    assert (h.num_cached_tokens, h.first_token_id) == (0, first)


# --- the gRPC surface --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stub() -> Iterator[prefill_pb2_grpc.PrefillStub]:
    server = Server("127.0.0.1:0")
    service = PrefillService(engine(ARCH), FakeStore(), PrefillMetrics(server.registry))  # type: ignore[arg-type]
    server.add(prefill_pb2_grpc.add_PrefillServicer_to_server, PrefillServicer(service), SERVICE_NAME)
    service.start()
    port = server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield prefill_pb2_grpc.PrefillStub(channel)
    server.stop(0)
    service.stop()


def request(prompt: common_pb2.Prompt | None = None, **sampling: object) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id="r", prompt=prompt if prompt is not None else common_pb2.Prompt(text="hello"),
        sampling=common_pb2.SamplingParams(**sampling),  # type: ignore[arg-type]
    )


def chat(*roles: str) -> common_pb2.Prompt:
    msgs = [common_pb2.ChatMessage(role=r, content="hi") for r in roles]
    return common_pb2.Prompt(messages=common_pb2.ChatMessages(messages=msgs))


def test_a_count_of_stored_blocks_past_the_prompt_is_cut(stub: prefill_pb2_grpc.PrefillStub) -> None:
    ids = tokens(2 * BLOCK_SIZE + 3, seed=12)
    req = request(common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=ids)))
    req.num_stored_blocks = 2**32 - 1
    r = stub.Prefill(req, timeout=30)
    assert (r.num_cached_tokens, r.first_token_id) == (0, oracle(ARCH, ids, 1)[0][0])


def test_text_and_chat_prompts(stub: prefill_pb2_grpc.PrefillStub) -> None:
    r = stub.Prefill(request(common_pb2.Prompt(text="hello")), timeout=30)
    assert list(r.prompt_token_ids) == [256, *b"hello"]  # llama's bos, then one token per byte
    r = stub.Prefill(request(chat("system", "user")), timeout=30)
    assert r.block_size == BLOCK_SIZE and len(r.prompt_token_ids) > 20
    assert r.timings.total_s >= r.timings.compute_s > 0


@pytest.mark.parametrize(
    ("req", "code", "words"),
    [
        (request(common_pb2.Prompt()), grpc.StatusCode.INVALID_ARGUMENT, "no prompt"),
        (request(common_pb2.Prompt(text="")), grpc.StatusCode.INVALID_ARGUMENT, "text is empty"),
        (request(common_pb2.Prompt(token_ids=common_pb2.TokenIds())), grpc.StatusCode.INVALID_ARGUMENT, "no token ids"),
        (request(chat()), grpc.StatusCode.INVALID_ARGUMENT, "no chat messages"),
        (request(chat("user", "wizard")), grpc.StatusCode.INVALID_ARGUMENT, "'wizard'"),
        (request(common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=[1, 99999]))),
         grpc.StatusCode.INVALID_ARGUMENT, "99999"),
        (request(temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (request(temperature=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (request(top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (request(stop=["ok", ""]), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
        (request(max_tokens=4091), grpc.StatusCode.OUT_OF_RANGE,
         "prompt (6 tokens) + max_tokens (4091) = 4097 exceeds the model's 4096 positions: ask for at most 4090"),
        (request(common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=[1] * 4096))),
         grpc.StatusCode.OUT_OF_RANGE, "4096 tokens"),
    ],
)
def test_bad_input_gets_a_precise_status(
    stub: prefill_pb2_grpc.PrefillStub, req: prefill_pb2.PrefillRequest, code: grpc.StatusCode, words: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.Prefill(req, timeout=30)
    assert info.value.code() == code  # type: ignore[attr-defined]
    assert words in info.value.details()  # type: ignore[attr-defined]
