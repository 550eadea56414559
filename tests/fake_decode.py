"""An in-process stand-in for the decode service, for client, CLI and router tests that need no model.

It streams `max_tokens` tokens ("x" each, `delay_s` apart), then the result, and then keeps its
handler open for `linger_s` (as the real service does while it finishes its bookkeeping). Each
call's end is recorded in `outcomes`: "ok" when the handler ran to its end, "cancelled" when the
client cancelled the call first, "refused" and "died" as the test asked (below).

Given `tokens=positional`, token i is a function of the prompt, the seed and i, as a seeded sampler's
would be; it continues after a request's `resume_token_ids` as decode does (streams only the rest, counts
them all in its result). `refuse` answers Generate with that status at once (with `retry_after_ms`,
the `retry-after-ms` trailer), as a busy replica; `die_after` ends each stream with UNAVAILABLE after
that many tokens, as a replica whose process died.

Given a `FakeReplica`, it also serves what a router asks of a replica (DecodeReplica and health), with
the events, load and prompt hashes the test chooses: an honest replica, or one that lies.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.kvserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kvstore_pb2

DECODE_SERVICE = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


def constant(request: decode_pb2.GenerateRequest, i: int) -> int:
    return ord("x")


def positional(request: decode_pb2.GenerateRequest, i: int) -> int:
    """Token i of the answer to `request`: a letter (its id is its code point) fixed by the prompt and the seed."""
    key = zlib.crc32(request.prompt.SerializeToString() + request.sampling.seed.to_bytes(8, "little"))
    return ord("a") + (key + 7 * i) % 26


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    def __init__(self, delay_s: float = 0.0, linger_s: float = 0.0,
                 tokens: Callable[[decode_pb2.GenerateRequest, int], int] = constant) -> None:
        self.delay_s = delay_s
        self.linger_s = linger_s
        self.tokens = tokens
        self.refuse: grpc.StatusCode | None = None
        self.retry_after_ms: int | None = None
        self.die_after: int | None = None
        self.requests: list[decode_pb2.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []  # each Generate's invocation metadata
        self.time_left: list[float | None] = []  # what was left of each Generate's deadline as it began, in s
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
        self.metadata.append(dict(context.invocation_metadata()))
        self.time_left.append(context.time_remaining())
        if self.refuse is not None:
            self._record("refused")
            if self.retry_after_ms is not None:
                context.set_trailing_metadata((("retry-after-ms", str(self.retry_after_ms)),))
            context.abort(self.refuse, "busy: 80 sequences waiting, the most this replica admits")
        cancelled = threading.Event()
        context.add_callback(cancelled.set)
        n = request.sampling.max_tokens or 4
        ids = list(request.resume_token_ids)
        try:
            while len(ids) < n:
                if cancelled.wait(self.delay_s):
                    self._record("cancelled")
                    return
                if self.die_after is not None and len(ids) - len(request.resume_token_ids) == self.die_after:
                    self._record("died")
                    context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
                ids.append(self.tokens(request, len(ids)))
                yield decode_pb2.GenerateResponse(token=decode_pb2.TokenChunk(token_id=ids[-1], text=chr(ids[-1])))
            yield decode_pb2.GenerateResponse(result=decode_pb2.GenerateResult(
                finish_reason="length", text="".join(map(chr, ids)), token_ids=ids, prompt_token_ids=[1, 2],
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


class FakeHealth(health.HealthServicer):
    """Standard health, which a test can hang (`hung.set()`: a check gets no answer until its caller gives up),
    as a replica whose workers are all taken, or whose process is stopped, or made to refuse checks as busy
    (`refusing.set()`: RESOURCE_EXHAUSTED, as a replica whose probe slots are taken). `checks` counts the checks."""

    def __init__(self) -> None:
        super().__init__()
        self.hung = threading.Event()
        self.refusing = threading.Event()
        self.checks = 0

    def Check(  # noqa: N802 - gRPC method name
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        self.checks += 1
        if self.refusing.is_set():
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the decode service is serving its limit of 4 probes "
                          "at once: retry shortly")
        while self.hung.is_set() and context.is_active():
            time.sleep(0.01)
        return super().Check(request, context)


class FakeServer:
    """`with FakeServer(...) as fake:` serves a FakeDecode on 127.0.0.1; `fake.addr`, `fake.servicer`;
    with `replica`, that FakeReplica and a FakeHealth, `fake.health`, saying the Decode service is serving."""

    def __init__(self, delay_s: float = 0.0, linger_s: float = 0.0, replica: FakeReplica | None = None,
                 tokens: Callable[[decode_pb2.GenerateRequest, int], int] = constant) -> None:
        self.servicer = FakeDecode(delay_s, linger_s, tokens)
        self.replica = replica
        self.health = FakeHealth()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        decode_pb2_grpc.add_DecodeServicer_to_server(self.servicer, self.server)
        if replica is not None:
            decode_pb2_grpc.add_DecodeReplicaServicer_to_server(replica, self.server)
            self.health.set(DECODE_SERVICE, health_pb2.HealthCheckResponse.SERVING)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.addr = f"127.0.0.1:{self.port}"

    def __enter__(self) -> FakeServer:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0).wait()
