"""Property-based: random field values sent to every RPC of every service, found from the services'
descriptors (so a new RPC is covered without a change here), against one real stack.

Whatever the values, each call ends OK or with one of the precise statuses a caller can act on (never
INTERNAL, UNKNOWN or UNAVAILABLE, never a dropped connection), the three processes stay alive and
healthy, and what was stored before is still stored, byte for byte, and still gives the same tokens.
Derandomized, so CI sees the same cases every run; KVSERVE_PROPERTY_EXAMPLES=N explores more.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client import Client
from kvserve.stack.stack import Service, start_service, stop_service
from kvstore import KVStoreClient
from protos.block_hash import BlockHash
from protos.kvserve.v1 import decode_pb2, kvstore_pb2, prefill_pb2
from tests.stack_fixtures import ProcessStack, stack_fixture, tokens

pytestmark = pytest.mark.slow

ARCH = "llama"
EXAMPLES = int(os.environ.get("KVSERVE_PROPERTY_EXAMPLES", "30"))
# Long enough for a random prompt that happens to be valid to produce some tokens; a call past it
# is cancelled by us (DEADLINE_EXCEEDED), which the server must take in its stride.
CALL_DEADLINE_S = 2.0
ACCEPTED = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
}

# Values where bugs live: bounds, zero, one, and signs, beside arbitrary ones.
_UINT32 = st.one_of(st.sampled_from([0, 1, 2, 15, 16, 17, 2**31 - 1, 2**32 - 1]), st.integers(0, 2**32 - 1))
_INT32 = st.one_of(st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31)]), st.integers(-(2**31), 2**31 - 1))
_UINT64 = st.one_of(st.sampled_from([0, 1, 2**32, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
_INT64 = st.one_of(st.sampled_from([0, -1, 2**63 - 1, -(2**63)]), st.integers(-(2**63), 2**63 - 1))
_FLOAT = st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 1e-30, 1e30]),
                   st.floats(allow_nan=True, allow_infinity=True, width=32))
_BYTES = st.one_of(st.binary(max_size=40), st.binary(min_size=32, max_size=32))
_TEXT = st.text(max_size=48)

_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FieldDescriptor.TYPE_UINT32: _UINT32, FieldDescriptor.TYPE_FIXED32: _UINT32,
    FieldDescriptor.TYPE_INT32: _INT32, FieldDescriptor.TYPE_SINT32: _INT32, FieldDescriptor.TYPE_SFIXED32: _INT32,
    FieldDescriptor.TYPE_UINT64: _UINT64, FieldDescriptor.TYPE_FIXED64: _UINT64,
    FieldDescriptor.TYPE_INT64: _INT64, FieldDescriptor.TYPE_SINT64: _INT64, FieldDescriptor.TYPE_SFIXED64: _INT64,
    FieldDescriptor.TYPE_FLOAT: _FLOAT, FieldDescriptor.TYPE_DOUBLE: _FLOAT,
    FieldDescriptor.TYPE_BOOL: st.booleans(), FieldDescriptor.TYPE_STRING: _TEXT, FieldDescriptor.TYPE_BYTES: _BYTES,
}


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return messages(field.message_type, depth + 1)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-5, 100))
    return _SCALARS[field.type]


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of `descriptor` with random values in random subsets of fields (at most one per oneof)."""
    cls = GetMessageClass(descriptor)
    if depth > 3:
        return st.just(cls())

    @st.composite
    def build(draw: Callable[..., Any]) -> Message:
        msg = cls()
        for oneof in descriptor.oneofs:
            choice = draw(st.sampled_from([None, *oneof.fields]))
            if choice is not None:
                _set(msg, choice, draw(_value(choice, depth)))
        for field in descriptor.fields:
            if field.containing_oneof is not None or not draw(st.booleans()):
                continue
            if field.is_repeated:
                _extend(msg, field, draw(st.lists(_value(field, depth), max_size=5)))
            else:
                _set(msg, field, draw(_value(field, depth)))
        return msg

    return build()


def _set(msg: Message, field: FieldDescriptor, value: Any) -> None:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        getattr(msg, field.name).CopyFrom(value)
    else:
        setattr(msg, field.name, value)


def _extend(msg: Message, field: FieldDescriptor, values: list[Any]) -> None:
    target = getattr(msg, field.name)
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        for v in values:
            target.add().CopyFrom(v)
    else:
        target.extend(values)


SERVICES: dict[str, ServiceDescriptor] = {
    "store": kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"],
    "prefill": prefill_pb2.DESCRIPTOR.services_by_name["Prefill"],
    "decode": decode_pb2.DESCRIPTOR.services_by_name["Decode"],
    "decode-replica": decode_pb2.DESCRIPTOR.services_by_name["DecodeReplica"],
    "router": decode_pb2.DESCRIPTOR.services_by_name["Decode"],
}
# DecodeReplica.Events takes no fields and never ends: its undecodable-bytes case below covers it.
METHODS = [(name, m) for name, svc in SERVICES.items() for m in svc.methods
           if m.full_name != "kvserve.v1.DecodeReplica.Events"]
VOCAB = 256  # the tiny models' byte-level vocabulary


def with_valid_prompt(descriptor: Descriptor) -> st.SearchStrategy[Message]:
    """Requests that pass the prompt checks, so that the sampling and cache options are what is random."""

    @st.composite
    def build(draw: Callable[..., Any]) -> Message:
        msg = draw(messages(descriptor))
        msg.ClearField("prompt")
        msg.prompt.token_ids.ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)))
        return msg

    return build()


def request_strategy(method: MethodDescriptor) -> st.SearchStrategy[list[Message]]:
    one = messages(method.input_type)
    if "prompt" in method.input_type.fields_by_name:
        one = st.one_of(one, with_valid_prompt(method.input_type))
    return st.lists(one, min_size=1, max_size=3 if method.client_streaming else 1)


def _call(channel: grpc.Channel, method: MethodDescriptor, requests: list[Message]) -> grpc.StatusCode:
    """Sends `requests` (one, or a stream of them) to `method` and reads every answer."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    reply = GetMessageClass(method.output_type).FromString
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}[
        (method.client_streaming, method.server_streaming)]
    call = kind(path, request_serializer=lambda m: m.SerializeToString(), response_deserializer=reply)
    try:
        answer = call(iter(requests) if method.client_streaming else requests[0], timeout=CALL_DEADLINE_S)
        if method.server_streaming:
            for _ in answer:
                pass
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[attr-defined, no-any-return]
    return grpc.StatusCode.OK


stack = stack_fixture(ProcessStack, "properties", [ARCH])


@pytest.fixture(scope="module")
def services(stack: ProcessStack) -> Iterator[dict[str, Service]]:
    """Each service of SERVICES by name: the stack's, and a router in front of its decode."""
    router = start_service("router", "kvserve.router", ["--listen", "127.0.0.1:0", "--decode", stack.decode[ARCH].addr,
                                                "--insecure"])  # as the stack: random values, not credentials
    yield {"store": stack.store, "prefill": stack.prefill[ARCH], "decode": stack.decode[ARCH],
           "decode-replica": stack.decode[ARCH], "router": router}
    stop_service(router)


@pytest.fixture(scope="module")
def before(stack: ProcessStack) -> dict[str, Any]:
    """What must be unchanged afterwards: a warm prompt's tokens, and a block's bytes."""
    ids = tokens(48 + 5, seed=77)
    with Client(stack.decode[ARCH].addr, timeout_s=60) as c:
        c.generate(token_ids=ids, max_tokens=8, ignore_eos=True)
        warm = c.generate(token_ids=ids, max_tokens=8, ignore_eos=True)
    key, payload = BlockHash(b"\x07" * 32), bytes(range(256)) * 64
    with KVStoreClient(stack.store.addr) as store:
        store.put([(key, payload)])
    return {"ids": ids, "warm": warm, "key": key, "payload": payload}


@pytest.mark.parametrize(("service", "method"), METHODS, ids=[f"{s}.{m.name}" for s, m in METHODS])
def test_random_requests_get_precise_statuses(
    stack: ProcessStack, services: dict[str, Service], before: dict[str, Any], service: str, method: MethodDescriptor
) -> None:
    requests = request_strategy(method)
    with grpc.insecure_channel(services[service].addr) as channel:

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(requests)
        def check(reqs: list[Message]) -> None:
            code = _call(channel, method, reqs)
            assert code in ACCEPTED, f"{method.full_name} answered {code.name} to {reqs}"

        check()
    _assert_healthy_and_unchanged(stack, services, before)


def test_undecodable_bytes_to_every_rpc(stack: ProcessStack, services: dict[str, Service],
                                        before: dict[str, Any]) -> None:
    events = decode_pb2.DESCRIPTOR.services_by_name["DecodeReplica"].methods_by_name["Events"]
    for service, method in [*METHODS, ("decode-replica", events)]:
        with grpc.insecure_channel(services[service].addr) as channel:
            # On the wire every kind of call is a stream of messages: one call shape sends to all of them.
            path = f"/{method.containing_service.full_name}/{method.name}"
            raw = channel.stream_stream(path, request_serializer=bytes, response_deserializer=bytes)
            with pytest.raises(grpc.RpcError) as err:
                list(raw(iter([b"\xff\xff\xff"]), timeout=CALL_DEADLINE_S))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method.full_name, err.value)
    _assert_healthy_and_unchanged(stack, services, before)


def _assert_healthy_and_unchanged(stack: ProcessStack, services: dict[str, Service], before: dict[str, Any]) -> None:
    for service in SERVICES:
        with grpc.insecure_channel(services[service].addr) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING, service
    assert all(p.process.poll() is None for p in services.values())
    with KVStoreClient(stack.store.addr) as store:
        assert store.get([before["key"]]) == [before["payload"]]
    with Client(stack.decode[ARCH].addr, timeout_s=60) as c:
        again = c.generate(token_ids=before["ids"], max_tokens=8, ignore_eos=True)
    assert again.token_ids == before["warm"].token_ids
    assert again.usage.cached_tokens == before["warm"].usage.cached_tokens > 0
