"""An in-process stand-in for the decode service, for client and CLI tests that need no model.

It streams `max_tokens` tokens ("x" each, `delay_s` apart), then the result, and then keeps its
handler open for `linger_s` (as the real service does while it finishes its bookkeeping). Each
call's end is recorded in `outcomes`: "ok" when the handler ran to its end, "cancelled" when the
client cancelled the call first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc

from protos.kvserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc


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


class FakeServer:
    """`with FakeServer(...) as fake:` serves a FakeDecode on 127.0.0.1; `fake.addr`, `fake.servicer`."""

    def __init__(self, delay_s: float = 0.0, linger_s: float = 0.0) -> None:
        self.servicer = FakeDecode(delay_s, linger_s)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        decode_pb2_grpc.add_DecodeServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.addr = f"127.0.0.1:{self.port}"

    def __enter__(self) -> FakeServer:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0).wait()
