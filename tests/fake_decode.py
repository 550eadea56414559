"""An in-process stand-in for the decode service, for client, CLI and router tests that need no model.

It streams `max_tokens` tokens ("x" each, `delay_s` apart), then the result, and then keeps its
handler open for `linger_s` (as the real service does while it finishes its bookkeeping). Each
call's end is recorded in `outcomes`: "ok" when the handler ran to its end, "cancelled" when the
client cancelled the call first.

Given a `FakeReplica`, it also serves what a router asks of a replica (DecodeReplica and health), with
the events, load and prompt hashes the test chooses: an honest replica, or one that lies.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.kvserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kvstore_pb2

DECODE_SERVICE = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    def __init__(self, delay_s: float = 0.0, linger_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.linger_s = linger_s
        self.requests: list[decode_pb2.GenerateRequest] = []
        self.outcomes: list[str] = []
        self.done = threading.Condition()

    def _record(self, outcome: str) -> None:
        with self.done:
            self.outcomes.append(outcome)
            self.done.notify_all()

    def wait_outcomes(self, n: int, timeout_s: float = 10.0) -> list[str]:
        with self.done:
            self.done.wait_for(lambda: len(self.outcomes) >= n, timeout_s)
            return list(self.outcomes)

    def Generate(  # noqa: N802 - gRPC method name
        self, request: decode_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[decode_pb2.GenerateResponse]:
        self.requests.append(request)
        cancelled = threading.Event()
        context.add_callback(cancelled.set)
        n = request.sampling.max_tokens or 4
        try:
            for _ in range(n):
                if cancelled.wait(self.delay_s):
                    self._record("cancelled")
                    return
                yield decode_pb2.GenerateResponse(token=decode_pb2.TokenChunk(token_id=120, text="x"))
            yield decode_pb2.GenerateResponse(result=decode_pb2.GenerateResult(
                finish_reason="length", text="x" * n, token_ids=[120] * n, prompt_token_ids=[1, 2],
                usage=common_pb2.Usage(prompt_tokens=2, cached_tokens=0, completion_tokens=n),
            ))
            time.sleep(self.linger_s)
        except GeneratorExit:
            self._record("cancelled")
            raise
        self._record("cancelled" if cancelled.is_set() else "ok")


class FakeReplica(decode_pb2_grpc.DecodeReplicaServicer):
    """DecodeReplica as the test says: each Events stream sends what `events(n)` gives (n counts the streams
    from 0) and then stays open until cancelled; Load answers `load`, PrefixHashes `prefix`. `sent_bytes`
    counts the bytes of the events sent."""

    def __init__(self, events: Callable[[int], Iterable[kvstore_pb2.Event]] = lambda n: (),
                 load: decode_pb2.LoadResponse | None = None,
                 prefix: decode_pb2.PrefixHashesResponse | None = None) -> None:
        self.events = events
        self.load = load or decode_pb2.LoadResponse()
        self.prefix = prefix or decode_pb2.PrefixHashesResponse()
        self.refuse: grpc.StatusCode | None = None  # PrefixHashes' status instead of `prefix`
        self.streams = 0
        self.sent_bytes = 0
        self.prefix_metadata: list[dict[str, str]] = []  # the metadata of each PrefixHashes call
        self._lock = threading.Lock()

    def Events(  # noqa: N802 - gRPC method name
        self, request: kvstore_pb2.EventsRequest, context: grpc.ServicerContext
    ) -> Iterator[kvstore_pb2.Event]:
        ended = threading.Event()
        context.add_callback(ended.set)
        with self._lock:
            n, self.streams = self.streams, self.streams + 1
        for event in self.events(n):
            size = event.ByteSize()
            yield event
            with self._lock:
                self.sent_bytes += size
        ended.wait()

    def Load(self, request: decode_pb2.LoadRequest, context: grpc.ServicerContext) -> decode_pb2.LoadResponse:  # noqa: N802
        return self.load

    def PrefixHashes(  # noqa: N802 - gRPC method name
        self, request: decode_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> decode_pb2.PrefixHashesResponse:
        self.prefix_metadata.append(dict(context.invocation_metadata()))
        if self.refuse is not None:
            context.abort(self.refuse, "refused")
        return self.prefix


class FakeServer:
    """`with FakeServer(...) as fake:` serves a FakeDecode on 127.0.0.1; `fake.addr`, `fake.servicer`;
    with `replica`, that FakeReplica and a health service saying the Decode service is serving."""

    def __init__(self, delay_s: float = 0.0, linger_s: float = 0.0, replica: FakeReplica | None = None) -> None:
        self.servicer = FakeDecode(delay_s, linger_s)
        self.replica = replica
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        decode_pb2_grpc.add_DecodeServicer_to_server(self.servicer, self.server)
        if replica is not None:
            decode_pb2_grpc.add_DecodeReplicaServicer_to_server(replica, self.server)
            health_servicer = health.HealthServicer()
            health_servicer.set(DECODE_SERVICE, health_pb2.HealthCheckResponse.SERVING)
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.addr = f"127.0.0.1:{self.port}"

    def __enter__(self) -> FakeServer:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0).wait()
