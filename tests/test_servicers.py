"""The three servicers alone, through grpc_testing: no server, no socket, milliseconds.

Each test checks one servicer's mapping only: protobuf request to domain call (request id default,
validation, deadline, cancellation), domain result to protobuf response, and an error raised by the
domain to the status code and message the caller gets. Errors map as the servers' one interceptor
maps them (`with_status_mapping`; grpc_testing runs no interceptor). The store's servicer runs over
a real BlockStore in memory; prefill's and decode's over fakes of their service's one method.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import grpc
import grpc_testing
import pytest

from decode_service.cancellation import Cancellation
from decode_service.server import DecodeServicer
from decode_service.service import DeploymentMismatch, GenerateJob, GenerateOutcome, Timings, Usage
from decode_service.stopping import TokenOutput
from kvserve.engine.model import ContextLengthError
from kvserve.engine.sampling import SamplingParams
from kvserve.handoff.requests import PrefillHandle, PrefillTimings, PromptInput, RequestOptions
from kvserve.rpc.errors import Cancelled, DeadlineExceeded, InvalidArgument, Unavailable
from kvserve.rpc.server import with_status_mapping
from kvstore.block_format import checksum
from kvstore.host_tier import MemoryHostTier
from kvstore.server import KVStoreServicer
from kvstore.store import BlockStore
from kvstore.wire import split_block
from prefill_service.server import PrefillServicer
from prefill_service.service import PrefillJob
from protos.block_hash import BlockHash
from protos.kvserve.v1 import common_pb2, decode_pb2, kvstore_pb2, prefill_pb2
from tests.kvstore_fixtures import FakeClock, key, payload
from tests.polling import wait_until

KVSTORE = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"]
PREFILL = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"]
DECODE = decode_pb2.DESCRIPTOR.services_by_name["Decode"]
INVALID, INTERNAL = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL
WAIT_S = 5.0


def serve(service: Any, servicer: object) -> grpc_testing.Server:
    """A grpc_testing server of `servicer`, each method behind the status mapping, as a server runs it."""
    methods = {m.name: with_status_mapping(getattr(servicer, m.name), streaming=m.server_streaming)
               for m in service.methods}
    return grpc_testing.server_from_dictionary({service: SimpleNamespace(**methods)}, grpc_testing.strict_real_time())


def own(metadata: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """Metadata a servicer set (grpc_testing adds a key of the runtime's)."""
    return [(k, v) for k, v in metadata if not k.startswith("grpc.")]


def unary(server: grpc_testing.Server, method: Any, request: Any, timeout: float | None = None,
          metadata: Sequence[tuple[str, str]] = ()) -> tuple[Any, list[tuple[str, str]], grpc.StatusCode, str]:
    """(response, the servicer's trailing metadata, code, details)."""
    response, trailing, code, details = server.invoke_unary_unary(method, tuple(metadata), request, timeout).termination()
    return response, own(trailing), code, details


def stream(server: grpc_testing.Server, method: Any, request: Any, timeout: float | None = None,
           metadata: Sequence[tuple[str, str]] = ()) -> tuple[list[Any], list[tuple[str, str]], grpc.StatusCode, str]:
    """(responses, the servicer's trailing metadata, code, details) of a server-streaming call."""
    rpc = server.invoke_unary_stream(method, tuple(metadata), request, timeout)
    trailing, code, details = rpc.termination()
    responses = []
    while True:  # after termination, take_response raises once the responses sent are drained
        try:
            responses.append(rpc.take_response())
        except ValueError:
            return responses, own(trailing), code, details


def client_stream(server: grpc_testing.Server, method: Any, requests: Sequence[Any]) -> tuple[Any, Any, grpc.StatusCode, str]:
    rpc = server.invoke_stream_unary(method, (), None)
    for request in requests:
        rpc.send_request(request)
    rpc.requests_closed()
    return rpc.termination()  # type: ignore[no-any-return]


def text_prompt(text: str = "Hello") -> common_pb2.Prompt:
    return common_pb2.Prompt(text=text)


# Requests that fail validation before any domain call, and the message that says why.
BAD_REQUESTS = [
    ({}, "the request has no prompt"),
    ({"prompt": common_pb2.Prompt(text="")}, "the prompt text is empty"),
    ({"prompt": common_pb2.Prompt(token_ids=common_pb2.TokenIds())}, "the prompt has no token ids"),
    ({"prompt": common_pb2.Prompt(messages=common_pb2.ChatMessages(
        messages=[common_pb2.ChatMessage(role="wizard", content="hi")]))}, "unknown chat role(s) ['wizard']"),
    ({"prompt": text_prompt(), "sampling": common_pb2.SamplingParams(temperature=-1)}, "temperature must be"),
    ({"prompt": text_prompt(), "sampling": common_pb2.SamplingParams(top_p=2)}, "top_p must be in [0, 1]"),
    ({"prompt": text_prompt(), "sampling": common_pb2.SamplingParams(stop=["x"] * 17)}, "at most 16 stop strings"),
    ({"prompt": text_prompt(), "sampling": common_pb2.SamplingParams(stop=[""])}, "stop strings must not be empty"),
]
BAD_REQUEST_IDS = ["no-prompt", "empty-text", "no-token-ids", "bad-role", "temperature", "top-p", "stops", "empty-stop"]

# Errors a service raises and the status its caller gets.
SERVICE_ERRORS = [
    (InvalidArgument("token id 999999 is outside the vocabulary"), INVALID, "token id 999999 is outside the vocabulary"),
    (ContextLengthError("the prompt has 5000 tokens, the model takes 4096"), grpc.StatusCode.OUT_OF_RANGE,
     "the prompt has 5000 tokens, the model takes 4096"),
    (Unavailable("the prefill service is down"), grpc.StatusCode.UNAVAILABLE, "the prefill service is down"),
    (DeadlineExceeded("the caller's deadline passed"), grpc.StatusCode.DEADLINE_EXCEEDED, "the caller's deadline passed"),
    (RuntimeError("a bug"), INTERNAL, "internal error: RuntimeError: a bug"),
]
SERVICE_ERROR_IDS = ["invalid", "context-length", "unavailable", "deadline", "bug"]

# A request with every field set, and the options it must become.
SAMPLING = common_pb2.SamplingParams(max_tokens=12, temperature=0.5, top_k=40, top_p=0.75, seed=7, stop=["\n\n"],
                                     ignore_eos=True)
CACHE = common_pb2.CacheOptions(prefix_cache=False, cache_salt="tenant-a")
OPTIONS = RequestOptions(SamplingParams(temperature=0.5, top_k=40, top_p=0.75, seed=7), max_tokens=12, stop=("\n\n",),
                         ignore_eos=True, prefix_cache=False, cache_salt="tenant-a")
MESSAGES = common_pb2.Prompt(messages=common_pb2.ChatMessages(messages=[
    common_pb2.ChatMessage(role="system", content="Be brief."), common_pb2.ChatMessage(role="user", content="Hi")]))


def _is_request_id(text: str) -> bool:
    return len(text) == 32 and uuid.UUID(hex=text).hex == text


# --- KVStore: a real BlockStore in memory ------------------------------------------------------


@pytest.fixture()
def store() -> BlockStore:
    return BlockStore([(MemoryHostTier(), 1000)], clock=FakeClock())


@pytest.fixture()
def kvstore(store: BlockStore) -> grpc_testing.Server:
    return serve(KVSTORE, KVStoreServicer(store))


def put_requests(blocks: Sequence[tuple[bytes, bytes]], chunk_bytes: int = 64, ephemeral: bool = False) -> list[Any]:
    return [kvstore_pb2.PutRequest(chunk=chunk, ephemeral=ephemeral)
            for k, p in blocks for chunk in split_block(BlockHash(k), p, checksum(p), chunk_bytes)]


def test_put_assembles_chunked_blocks_and_counts_new_and_existing(kvstore: grpc_testing.Server, store: BlockStore) -> None:
    blocks = [(key(1), payload(1, 150)), (key(2), payload(2, 100))]  # 3 chunks, then 2
    put = KVSTORE.methods_by_name["Put"]
    response, _, code, _ = client_stream(kvstore, put, put_requests(blocks))
    assert code == grpc.StatusCode.OK
    assert response == kvstore_pb2.PutResponse(num_new=2, num_existing=0)
    reads = list(store.get([BlockHash(k) for k, _ in blocks]))
    assert [bytes(r.payload) if r and r.payload is not None else None for r in reads] == [p for _, p in blocks]
    response, _, code, _ = client_stream(kvstore, put, put_requests(blocks[:1]))
    assert (code, response) == (grpc.StatusCode.OK, kvstore_pb2.PutResponse(num_new=0, num_existing=1))
    store.check_integrity()


@pytest.mark.parametrize(
    ("requests", "code", "details"),
    [
        ([], INVALID, "empty put: the stream carried no blocks"),
        ([kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(hash=key(1), total_size=3, checksum=checksum(b"abc") + 1,
                                                              data=b"abc"))],
         INVALID, "checksum mismatch for block"),
        (put_requests([(key(1), payload(1, 150))])[:2], INVALID, "stream ended inside block"),
        (put_requests([(key(1), payload(1, 2000))], chunk_bytes=4096), grpc.StatusCode.RESOURCE_EXHAUSTED,
         "exceeds the largest tier (1000 bytes)"),
        ([kvstore_pb2.PutRequest(staged=[kvstore_pb2.BlockChunk(hash=key(1), total_size=100, checksum=1, shm_offset=0)])], INVALID,
         "staged blocks (shm_offset) are put over the arena socket, not gRPC"),
    ],
    ids=["empty", "checksum", "cut-short", "too-large", "staged-over-grpc"],
)
def test_a_bad_put_gets_a_precise_status_and_stores_nothing(
    kvstore: grpc_testing.Server, store: BlockStore, requests: list[Any], code: grpc.StatusCode, details: str
) -> None:
    _, _, got_code, got_details = client_stream(kvstore, KVSTORE.methods_by_name["Put"], requests)
    assert (got_code, details in got_details) == (code, True), got_details
    assert store.stats().tiers[0].blocks == 0
    store.check_integrity()


def test_lookup_maps_hits_tiers_and_lease_and_release_ends_the_lease(kvstore: grpc_testing.Server, store: BlockStore) -> None:
    for i in (1, 2):
        store.put(BlockHash(key(i)), payload(i))
    request = kvstore_pb2.LookupRequest(hashes=[key(1), key(2), key(3), key(1)], lease_ttl_s=30)
    response, trailing, code, _ = unary(kvstore, KVSTORE.methods_by_name["Lookup"], request)
    assert code == grpc.StatusCode.OK and trailing == []
    assert (response.num_hits, list(response.tiers)) == (2, [kvstore_pb2.TIER_HOST, kvstore_pb2.TIER_HOST])
    assert response.lease_id and (store.stats().leases, store.stats().pinned_blocks) == (1, 2)

    release = KVSTORE.methods_by_name["Release"]
    _, _, code, _ = unary(kvstore, release, kvstore_pb2.ReleaseRequest(lease_id=response.lease_id))
    assert code == grpc.StatusCode.OK and (store.stats().leases, store.stats().pinned_blocks) == (0, 0)
    _, _, code, details = unary(kvstore, release, kvstore_pb2.ReleaseRequest(lease_id=response.lease_id))
    assert code == grpc.StatusCode.NOT_FOUND and "never taken, released or expired" in details
    store.check_integrity()


@pytest.mark.parametrize(
    ("request_", "details"),
    [
        (kvstore_pb2.LookupRequest(hashes=[b"short"]), "32 bytes"),
        (kvstore_pb2.LookupRequest(hashes=[key(1)], lease_ttl_s=-1), "lease_ttl_s must be 0 (no lease) or more"),
    ],
    ids=["hash-length", "lease-ttl"],
)
def test_a_bad_lookup_is_invalid_argument(kvstore: grpc_testing.Server, request_: Any, details: str) -> None:
    _, _, code, got = unary(kvstore, KVSTORE.methods_by_name["Lookup"], request_)
    assert code == INVALID and details in got, got


def test_get_streams_hits_in_chunks_and_misses_as_not_found(kvstore: grpc_testing.Server, store: BlockStore) -> None:
    store.put(BlockHash(key(1)), payload(1, 300))
    responses, _, code, _ = stream(kvstore, KVSTORE.methods_by_name["Get"],
                                   kvstore_pb2.GetRequest(hashes=[key(2), key(1)]))
    assert code == grpc.StatusCode.OK
    assert [(r.chunk.hash, r.found) for r in responses] == [(key(2), False), (key(1), True)]
    hit = responses[1]
    assert (hit.tier, hit.chunk.total_size, hit.chunk.checksum) == (kvstore_pb2.TIER_HOST, 300, checksum(payload(1, 300)))
    assert hit.chunk.data == payload(1, 300)


def test_a_bad_hash_in_get_ends_the_stream_with_invalid_argument(kvstore: grpc_testing.Server) -> None:
    responses, _, code, details = stream(kvstore, KVSTORE.methods_by_name["Get"],
                                         kvstore_pb2.GetRequest(hashes=[key(1), b"bad"]))
    assert (responses, code) == ([], INVALID) and "32 bytes" in details


def test_stats_and_info_describe_the_store(kvstore: grpc_testing.Server, store: BlockStore) -> None:
    store.put(BlockHash(key(1)), payload(1, 100))
    stats, _, code, _ = unary(kvstore, KVSTORE.methods_by_name["Stats"], kvstore_pb2.StatsRequest())
    assert code == grpc.StatusCode.OK
    assert [(t.tier, t.blocks, t.bytes, t.capacity_bytes) for t in stats.tiers] == [(kvstore_pb2.TIER_HOST, 1, 100, 1000)]
    info, _, code, _ = unary(kvstore, KVSTORE.methods_by_name["Info"], kvstore_pb2.InfoRequest())
    assert code == grpc.StatusCode.OK
    assert (info.arena_socket, info.max_message_bytes) == ("", 4 * 1024 * 1024)


# --- Prefill: a fake service ----------------------------------------------------------------------

HANDLE = PrefillHandle(
    request_id="req-1", prompt_token_ids=(1, 2, 3), block_size=2, block_hashes=(BlockHash(key(1)),),
    tail_key=BlockHash(key(2)), num_cached_tokens=2, num_computed_tokens=1, first_token_id=42,
    timings=PrefillTimings(0.5, 0.25, 1.0, 0.125, 2.0), lease_id="lease-9", model_fingerprint="fp",
)


@dataclass
class FakePrefill:
    """PrefillService's one method: records each job (and whether it was cancelled during the call)."""

    error: Exception | None = None
    block: bool = False  # wait until the caller cancels
    jobs: list[PrefillJob] = field(default_factory=list)
    cancelled_seen: list[bool] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)

    def prefill(self, job: PrefillJob) -> PrefillHandle:
        self.jobs.append(job)
        self.started.set()
        if self.block:
            wait_until(job.cancelled, WAIT_S, interval_s=0.01, message="the caller never cancelled")
        self.cancelled_seen.append(job.cancelled())
        if self.error is not None:
            raise self.error
        return HANDLE

    def prefill_stream(self, job: PrefillJob) -> Iterator[PrefillHandle]:
        yield replace(HANDLE, block_hashes=(), tail_key=None, lease_id="", kv_pending=True)
        yield self.prefill(job)


def prefill_server(fake: FakePrefill) -> grpc_testing.Server:
    return serve(PREFILL, PrefillServicer(fake))  # type: ignore[arg-type]


PREFILL_METHOD = PREFILL.methods_by_name["Prefill"]


def test_prefill_maps_the_request_to_a_job_and_the_handle_to_the_response() -> None:
    fake = FakePrefill()
    request = prefill_pb2.PrefillRequest(request_id="req-1", prompt=MESSAGES, sampling=SAMPLING, cache=CACHE)
    before = time.monotonic()
    response, trailing, code, _ = unary(prefill_server(fake), PREFILL_METHOD, request, timeout=30.0,
                                        metadata=[("x-trace-id", "abc")])
    assert (code, trailing) == (grpc.StatusCode.OK, [])
    [job] = fake.jobs
    assert (job.request_id, job.options) == ("req-1", OPTIONS)
    assert job.prompt == PromptInput(messages=(("system", "Be brief."), ("user", "Hi")))
    assert job.deadline is not None and before + 29 < job.deadline <= time.monotonic() + 30
    assert fake.cancelled_seen == [False]
    assert response == prefill_pb2.PrefillResponse(
        request_id="req-1", prompt_token_ids=[1, 2, 3], block_size=2, block_hashes=[key(1)], tail_key=key(2),
        num_cached_tokens=2, num_computed_tokens=1, first_token_id=42,
        timings=prefill_pb2.PrefillTimings(lookup_s=0.5, fetch_s=0.25, compute_s=1.0, put_s=0.125, total_s=2.0),
        lease_id="lease-9", model_fingerprint="fp",
    )


def test_prefill_stream_sends_the_first_token_then_the_handle() -> None:
    fake = FakePrefill()
    request = prefill_pb2.PrefillRequest(request_id="req-1", prompt=text_prompt())
    responses, _, code, _ = stream(prefill_server(fake), PREFILL.methods_by_name["PrefillStream"], request)
    assert code == grpc.StatusCode.OK and [r.kv_pending for r in responses] == [True, False]
    assert responses[0].first_token_id == 42 and not responses[0].block_hashes and not responses[0].lease_id
    assert responses[1].block_hashes == [key(1)] and responses[1].lease_id == "lease-9"


def test_prefill_stream_error_after_the_first_token_ends_the_stream_with_its_status() -> None:
    fake = FakePrefill(error=Unavailable("the store went away"))
    request = prefill_pb2.PrefillRequest(prompt=text_prompt())
    responses, _, code, details = stream(prefill_server(fake), PREFILL.methods_by_name["PrefillStream"], request)
    assert [r.kv_pending for r in responses] == [True] and code == grpc.StatusCode.UNAVAILABLE
    assert details == "the store went away"


def test_prefill_defaults_the_request_id_options_and_deadline() -> None:
    fake = FakePrefill()
    server = prefill_server(fake)
    for _ in range(2):
        _, _, code, _ = unary(server, PREFILL_METHOD, prefill_pb2.PrefillRequest(prompt=text_prompt()))
        assert code == grpc.StatusCode.OK
    assert all(_is_request_id(job.request_id) for job in fake.jobs)
    assert fake.jobs[0].request_id != fake.jobs[1].request_id
    assert [(j.prompt, j.options, j.deadline) for j in fake.jobs] == [
        (PromptInput(text="Hello"), RequestOptions(SamplingParams()), None)] * 2


@pytest.mark.parametrize(("fields", "details"), BAD_REQUESTS, ids=BAD_REQUEST_IDS)
def test_prefill_refuses_a_bad_request_before_calling_the_service(fields: dict[str, Any], details: str) -> None:
    fake = FakePrefill()
    _, _, code, got = unary(prefill_server(fake), PREFILL_METHOD, prefill_pb2.PrefillRequest(**fields))
    assert (code, fake.jobs) == (INVALID, []) and details in got, got


@pytest.mark.parametrize(("error", "code", "details"), SERVICE_ERRORS, ids=SERVICE_ERROR_IDS)
def test_prefill_maps_service_errors_to_status(error: Exception, code: grpc.StatusCode, details: str) -> None:
    _, trailing, got_code, got = unary(prefill_server(FakePrefill(error=error)), PREFILL_METHOD,
                                       prefill_pb2.PrefillRequest(prompt=text_prompt()))
    assert (got_code, got, trailing) == (code, details, [])


def test_prefill_job_sees_the_caller_cancel() -> None:
    fake = FakePrefill(block=True, error=Cancelled("the caller cancelled the request while computing"))
    rpc = prefill_server(fake).invoke_unary_unary(PREFILL_METHOD, (), prefill_pb2.PrefillRequest(prompt=text_prompt()),
                                                  None)
    assert fake.started.wait(WAIT_S)
    rpc.cancel()
    wait_until(lambda: fake.cancelled_seen, WAIT_S, interval_s=0.01, message="the prefill job never ended")
    assert fake.cancelled_seen == [True]


# --- Decode: a fake service -----------------------------------------------------------------------

OUTCOME = GenerateOutcome(
    finish_reason="stop", text="ab", token_ids=(5, 6), prompt_token_ids=(1, 2, 3),
    usage=Usage(prompt_tokens=3, cached_tokens=2, completion_tokens=2),
    timings=Timings(ttft_s=0.5, prefill_s=0.25, decode_s=1.0, total_s=1.5, prefill_path="local"),
)


@dataclass
class FakeDecode:
    """DecodeService's methods: `generate` yields `items`, raising `error` after them; with `block`, waits
    after the first item until the caller cancels. `refused` keeps what it is told."""

    items: Sequence[TokenOutput | GenerateOutcome] = (TokenOutput(5, "a"), TokenOutput(6, "b", "stop"), OUTCOME)
    error: Exception | None = None
    block: bool = False
    jobs: list[GenerateJob] = field(default_factory=list)
    cancels: list[Cancellation] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cancelled_at_end: list[bool] = field(default_factory=list)  # after the last item was taken
    refusals: list[BaseException] = field(default_factory=list)

    def refused(self, error: BaseException) -> None:
        self.refusals.append(error)

    def generate(self, job: GenerateJob, cancel: Cancellation) -> Iterator[TokenOutput | GenerateOutcome]:
        self.jobs.append(job)
        self.cancels.append(cancel)
        cancel.on_cancel(self.cancelled.set)
        for i, item in enumerate(self.items):
            yield item
            if self.block and i == 0:
                self.cancelled.wait(WAIT_S)
                return
        self.cancelled_at_end.append(cancel.cancelled)
        if self.error is not None:
            raise self.error


def decode_server(fake: FakeDecode) -> grpc_testing.Server:
    return serve(DECODE, DecodeServicer(fake))  # type: ignore[arg-type]


GENERATE = DECODE.methods_by_name["Generate"]


def test_generate_maps_the_request_to_a_job_and_streams_tokens_then_the_result() -> None:
    fake = FakeDecode()
    request = decode_pb2.GenerateRequest(request_id="req-2", prompt=MESSAGES, sampling=SAMPLING, cache=CACHE)
    before = time.perf_counter()
    responses, trailing, code, _ = stream(decode_server(fake), GENERATE, request, timeout=30.0,
                                          metadata=[("x-trace-id", "abc")])
    assert (code, trailing) == (grpc.StatusCode.OK, [])
    [job] = fake.jobs
    assert (job.request_id, job.options) == ("req-2", OPTIONS)
    assert job.prompt == PromptInput(messages=(("system", "Be brief."), ("user", "Hi")))
    assert before <= job.arrival <= time.perf_counter()
    assert job.time_left_s is not None and 29 < job.time_left_s <= 30
    assert responses == [
        decode_pb2.GenerateResponse(token=decode_pb2.TokenChunk(token_id=5, text="a")),
        decode_pb2.GenerateResponse(token=decode_pb2.TokenChunk(token_id=6, text="b")),
        decode_pb2.GenerateResponse(result=decode_pb2.GenerateResult(
            finish_reason="stop", text="ab", token_ids=[5, 6], prompt_token_ids=[1, 2, 3],
            usage=common_pb2.Usage(prompt_tokens=3, cached_tokens=2, completion_tokens=2),
            timings=common_pb2.Timings(ttft_s=0.5, prefill_s=0.25, decode_s=1.0, total_s=1.5, prefill_path="local"),
        )),
    ]
    assert fake.cancelled_at_end == [False]


def test_generate_defaults_the_request_id_options_and_time_left() -> None:
    fake = FakeDecode()
    server = decode_server(fake)
    for _ in range(2):
        assert stream(server, GENERATE, decode_pb2.GenerateRequest(prompt=text_prompt()))[2] == grpc.StatusCode.OK
    assert all(_is_request_id(job.request_id) for job in fake.jobs)
    assert fake.jobs[0].request_id != fake.jobs[1].request_id
    assert [(j.prompt, j.options, j.time_left_s) for j in fake.jobs] == [
        (PromptInput(text="Hello"), RequestOptions(SamplingParams()), None)] * 2


@pytest.mark.parametrize(("fields", "details"), BAD_REQUESTS, ids=BAD_REQUEST_IDS)
def test_generate_refuses_a_bad_request_before_calling_the_service(fields: dict[str, Any], details: str) -> None:
    fake = FakeDecode()
    responses, _, code, got = stream(decode_server(fake), GENERATE, decode_pb2.GenerateRequest(**fields))
    assert (code, responses, fake.jobs) == (INVALID, [], []) and details in got, got
    assert [str(e) for e in fake.refusals] == [got]  # counted as refused


@pytest.mark.parametrize(
    ("error", "code", "details"),
    [*SERVICE_ERRORS, (DeploymentMismatch("prefill serves another model"), grpc.StatusCode.FAILED_PRECONDITION,
                       "prefill serves another model")],
    ids=[*SERVICE_ERROR_IDS, "deployment-mismatch"],
)
def test_generate_maps_service_errors_to_status_before_any_token(error: Exception, code: grpc.StatusCode,
                                                                 details: str) -> None:
    responses, trailing, got_code, got = stream(decode_server(FakeDecode(items=(), error=error)), GENERATE,
                                                decode_pb2.GenerateRequest(prompt=text_prompt()))
    assert (responses, got_code, got, trailing) == ([], code, details, [])


def test_an_error_mid_stream_ends_it_with_the_mapped_status_after_the_tokens_sent() -> None:
    fake = FakeDecode(items=(TokenOutput(5, "a"),), error=Unavailable("the KV store is down"))
    responses, _, code, details = stream(decode_server(fake), GENERATE, decode_pb2.GenerateRequest(prompt=text_prompt()))
    assert responses == [decode_pb2.GenerateResponse(token=decode_pb2.TokenChunk(token_id=5, text="a"))]
    assert (code, details) == (grpc.StatusCode.UNAVAILABLE, "the KV store is down")


def test_generate_cancels_the_job_when_the_caller_cancels() -> None:
    fake = FakeDecode(block=True)
    rpc = decode_server(fake).invoke_unary_stream(GENERATE, (), decode_pb2.GenerateRequest(prompt=text_prompt()), None)
    assert rpc.take_response() == decode_pb2.GenerateResponse(token=decode_pb2.TokenChunk(token_id=5, text="a"))
    rpc.cancel()
    assert fake.cancelled.wait(WAIT_S) and fake.cancels[0].cancelled
