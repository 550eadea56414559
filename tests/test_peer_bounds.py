"""What a service reads from another is bounded and checked before it is used: a store's answers in
prefill and decode (`KVStoreClient`), prefill's hand-off in decode (`handle_from_proto`). The router's
bounds on its replicas are in tests/test_router_bounds.py."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from kvserve.engine.sampling import SamplingParams
from kvserve.handoff.requests import MalformedHandle, PromptInput, RequestOptions, handle_from_proto
from kvserve.rpc.errors import Unavailable
from kvstore import KVStoreClient
from kvstore.errors import BlockTooLarge
from prefill_service.client import PrefillClient
from protos.block_hash import BlockHash
from protos.kvserve.v1 import kvstore_pb2 as pb
from protos.kvserve.v1 import kvstore_pb2_grpc as pb_grpc
from protos.kvserve.v1 import prefill_pb2, prefill_pb2_grpc

KEY = BlockHash(b"k" * 32)


class LyingStore(pb_grpc.KVStoreServicer):
    """Answers every Get with a block that claims `claimed` bytes, then sends 1 MiB chunks of it until
    the caller goes away; `sent` counts the bytes it got out."""

    def __init__(self, claimed: int) -> None:
        self.claimed = claimed
        self.sent = 0

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[pb.GetResponse]:  # noqa: N802
        piece = bytes(1 << 20)
        for i in range(1024):
            if not context.is_active():
                return
            yield pb.GetResponse(found=True, chunk=pb.BlockChunk(hash=request.hashes[0], total_size=self.claimed,
                                                                 offset=i * len(piece), data=piece))
            self.sent += len(piece)


@pytest.fixture
def lying_store() -> Iterator[tuple[str, LyingStore]]:
    servicer = LyingStore(claimed=1 << 40)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_KVStoreServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0).wait()


def test_a_store_claiming_a_huge_block_is_refused_before_its_bytes_are_buffered(
        lying_store: tuple[str, LyingStore]) -> None:
    """Before, the client took any size a store claimed (1 << 62) and buffered chunks until it came: a
    store, or anything on its address, could grow prefill and decode without bound."""
    addr, servicer = lying_store
    tracemalloc.start()
    try:
        with KVStoreClient(addr, use_shm=False) as store, pytest.raises(BlockTooLarge):
            store.get([KEY])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20  # a chunk or two in flight, never the claimed terabyte
    # The client hangs up at the first chunk; the store goes on sending into gRPC's flow-control window until
    # the cancellation reaches it, a few chunks more on a loaded machine (5 MiB was seen): never the gigabyte.
    assert servicer.sent <= 16 << 20


def _response(**fields: object) -> prefill_pb2.PrefillResponse:
    base: dict[str, object] = {"prompt_token_ids": list(range(40)), "block_size": 16,
                               "block_hashes": [b"h" * 32, b"i" * 32], "tail_key": b"t" * 32,
                               "num_cached_tokens": 32}
    return prefill_pb2.PrefillResponse(**{**base, **fields})  # type: ignore[arg-type]


def test_a_well_formed_hand_off_is_taken() -> None:
    handle = handle_from_proto(_response())
    assert len(handle.block_hashes) == 2 and handle.tail_key == b"t" * 32


@pytest.mark.parametrize("fields, problem", [
    ({"prompt_token_ids": []}, "no prompt token ids"),
    ({"block_size": 0}, "block size 0"),
    ({"block_hashes": [b"h" * 32] * 3}, "3 block hashes for 40 tokens"),
    ({"block_hashes": [b"h" * 32, b"x" * (64 << 10)]}, "a block hash that is not 32 bytes"),
    ({"tail_key": b"t" * 31}, "a tail key that is not 32 bytes"),
    ({"num_cached_tokens": 41}, "41 cached tokens of 40"),
])
def test_a_malformed_hand_off_is_refused_with_what_does_not_add_up(fields: dict[str, object], problem: str) -> None:
    with pytest.raises(MalformedHandle, match=problem):
        handle_from_proto(_response(**fields))


class MalformedPrefill(prefill_pb2_grpc.PrefillServicer):
    def PrefillStream(self, request: prefill_pb2.PrefillRequest,  # noqa: N802 - gRPC method name
                      context: grpc.ServicerContext) -> Iterator[prefill_pb2.PrefillResponse]:
        yield _response(block_size=0)


def test_a_malformed_hand_off_makes_prefill_count_as_unavailable() -> None:
    """Decode then computes the prompt itself (decode_service/service.py), as when prefill is down."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    prefill_pb2_grpc.add_PrefillServicer_to_server(MalformedPrefill(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        client = PrefillClient(f"127.0.0.1:{port}", timeout_s=5.0)
        call = client.start("r1", PromptInput(text="hello"), RequestOptions(SamplingParams()))
        with pytest.raises(Unavailable, match="answered a malformed hand-off: the prefill answer has block size 0"):
            call.first()
    finally:
        server.stop(0).wait()
