"""The OpenAI-compatible HTTP API: Starlette routes bridged to kvserve's gRPC front door with grpc.aio.

Each request becomes one `Decode/Generate` call to the front door (decode, or the router), with the caller's
`Authorization` header as its metadata: the front door checks the token, so HTTP and gRPC share tokens,
tenants and cache namespaces, and the same request gives the same tokens on both. The first answer is awaited
before the HTTP response starts, so a refusal (bad field, bad token, busy) is a status code with OpenAI's
error object, also for `"stream": true`; an error after the stream has started is sent as an `error` event.
A client that disconnects cancels the call, which frees its sequence in decode.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvserve.http.body import loads
from kvserve.http.schema import BadRequest, ChatCompletionRequest, CompletionRequest, parse
from kvserve.rpc.metrics import LATENCY_BUCKETS
from protos.kvserve.v1 import decode_pb2, decode_pb2_grpc
from protos.retry import RETRY_AFTER, retry_after_s

log = logging.getLogger(__name__)

CLIENT_GONE = 499  # nginx's status for a client that closed the connection: logged, never sent
BUSY_RETRY_S = 0.25  # the hint of a request refused because the front is at --max-connections
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # kvserve's finish reasons, OpenAI's words
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

# A gRPC status as an HTTP status and OpenAI's error type. RESOURCE_EXHAUSTED with a retry hint is a busy
# server (429); without one the request can never fit (413).
STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


class ApiError(Exception):
    """An answer with OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after is not None:  # both: the OpenAI SDKs read retry-after-ms first
            headers = {RETRY_AFTER: str(max(1, round(self.retry_after * 1000))),
                       "retry-after": str(max(1, math.ceil(self.retry_after)))}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_grpc(exc: grpc.aio.AioRpcError) -> ApiError:
    code = exc.code()
    status, type_ = STATUS.get(code, (500, "server_error"))
    hint = retry_after_s(exc)
    message = exc.details() or code.name
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and hint is None:
        status, type_ = 413, "invalid_request_error"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        message = (f"the answer was not complete by the request's deadline ({message}): kvserve http's --timeout-s, "
                   "or the client's own timeout (X-Stainless-Timeout) when shorter")
    return ApiError(status, message, type_, code=code.name.lower(), retry_after=hint)


def usage(u: Any) -> dict[str, Any]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


@dataclass(frozen=True, slots=True)
class Shape:
    """How one endpoint's answers look: a whole completion, and its stream's chunks."""

    object: str
    chunk_object: str
    id_prefix: str
    schema: type[ChatCompletionRequest] | type[CompletionRequest]

    def choice(self, text: str, finish: str | None, chunk: bool) -> dict[str, Any]:
        if self.schema is CompletionRequest:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if chunk:
            return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}


CHAT = Shape("chat.completion", "chat.completion.chunk", "chatcmpl-", ChatCompletionRequest)
COMPLETION = Shape("text_completion", "text_completion", "cmpl-", CompletionRequest)


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("kvserve_http_requests", "HTTP API requests by endpoint and status code",
                                ["endpoint", "status"], registry=registry)
        self.active = Gauge("kvserve_http_active_requests", "requests being answered", registry=registry)
        self.ttft = Histogram("kvserve_http_ttft_seconds", "from a request's arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.latency = Histogram("kvserve_http_request_seconds", "from a request's arrival to its last byte",
                                 buckets=LATENCY_BUCKETS, registry=registry)


class Front:
    """The routes, over one grpc.aio channel to `upstream`. `credentials`: TLS towards it (None: plaintext).
    At most `max_requests` generations at once; one more is answered 429 at once."""

    def __init__(self, upstream: str, model_name: str, *, credentials: grpc.ChannelCredentials | None = None,
                 timeout_s: float = 600.0, client_timeout_s: float = 10.0, max_body_bytes: int = 4 << 20,
                 max_requests: int = 1024,
                 channel_options: list[tuple[str, Any]] | None = None) -> None:
        self.upstream, self.model_name, self.credentials = upstream, model_name, credentials
        self.timeout_s, self.max_body_bytes, self.max_requests = timeout_s, max_body_bytes, max_requests
        self.client_timeout_s = client_timeout_s
        self.channel_options = channel_options or []
        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.created = int(time.time())
        self.active = 0
        self.arrived = 0  # generation requests, refused ones included (kvserve.host.collector.collect_when_quiet)
        self._channel: grpc.aio.Channel | None = None

    @asynccontextmanager
    async def lifespan(self, on_ready: Callable[[], None]) -> AsyncIterator[None]:
        opts = self.channel_options
        self._channel = (grpc.aio.insecure_channel(self.upstream, options=opts) if self.credentials is None else
                         grpc.aio.secure_channel(self.upstream, self.credentials, options=opts))
        self.decode = decode_pb2_grpc.DecodeStub(self._channel)
        self.health_stub = health_pb2_grpc.HealthStub(self._channel)
        on_ready()
        try:
            yield
        finally:
            await self._channel.close()

    def app(self, on_ready: Callable[[], None] = lambda: None) -> Starlette:
        async def api_error(_request: Request, exc: Exception) -> Response:
            assert isinstance(exc, ApiError)
            return exc.response()

        async def http_error(_request: Request, exc: Exception) -> Response:
            assert isinstance(exc, HTTPException)
            return ApiError(exc.status_code, exc.detail, code=str(exc.status_code)).response()

        async def server_error(_request: Request, exc: Exception) -> Response:  # logged by Starlette
            return ApiError(500, f"internal error: {type(exc).__name__}", "server_error", code="internal").response()

        return Starlette(
            routes=[Route("/v1/chat/completions", self.chat, methods=["POST"]),
                    Route("/v1/completions", self.completions, methods=["POST"]),
                    Route("/v1/models", self.models, methods=["GET"]),
                    Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                    Route("/health", self.health, methods=["GET"])],
            exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: server_error},
            lifespan=lambda _app: self.lifespan(on_ready))

    # --- routes

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, COMPLETION)

    async def models(self, _request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        if request.path_params["model"] != self.model_name:
            raise self._no_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def health(self, _request: Request) -> Response:
        """200 while the front door answers health SERVING, or refuses the check as busy (it answers only a few at
        once: busy is not down); 503 otherwise."""
        try:
            reply = await self.health_stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            why = "the gRPC front door is not serving (starting or draining)"
        except grpc.aio.AioRpcError as exc:
            serving = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            why = f"the gRPC front door at {self.upstream} does not answer: {exc.code().name}"
        if serving:
            return JSONResponse({"status": "ok"})
        return ApiError(503, why, "service_unavailable_error", code="upstream_unavailable").response()

    # --- generation

    async def _generate(self, request: Request, shape: Shape) -> Response:
        """One generation: the body read (within `client_timeout_s`) and checked, then at most `max_requests` at
        once from there to the last byte of the answer."""
        t0 = time.perf_counter()
        self.arrived += 1
        endpoint = request.url.path
        status, counted, streaming = 500, False, False

        def release() -> None:
            self.active -= 1
            self.metrics.active.dec()

        try:
            body = await self._body(request, shape)
            if self.active >= self.max_requests:
                raise ApiError(429, f"this HTTP front is answering its limit of {self.max_requests} requests at "
                               "once (--max-connections): retry shortly", "rate_limit_error", code="busy",
                               retry_after=BUSY_RETRY_S)
            self.active += 1
            self.metrics.active.inc()
            counted = True
            response = await self._answer(request, body, shape, t0, release)
            streaming = isinstance(response, EventSourceResponse)  # its events release it when they end
            status = response.status_code
            return response
        except ApiError as exc:
            status = exc.status
            raise
        finally:
            if counted and not streaming:
                release()
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()

    async def _body(self, request: Request, shape: Shape) -> Any:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            raise self._too_large()
        data = bytearray()
        try:
            async with asyncio.timeout(self.client_timeout_s):  # a client trickling its body holds nothing long
                async for chunk in request.stream():
                    data += chunk
                    if len(data) > self.max_body_bytes:
                        raise self._too_large()
        except TimeoutError:
            raise ApiError(408, f"the body did not arrive within {self.client_timeout_s:g} s (--client-timeout-s)",
                           code="request_timeout") from None
        try:
            body = parse(shape.schema, loads(bytes(data)))
        except BadRequest as exc:
            raise ApiError(400, str(exc), param=exc.param, code=exc.code) from None
        if body.model != self.model_name:
            raise self._no_model(body.model)
        return body

    async def _answer(self, request: Request, body: Any, shape: Shape, t0: float,
                      release: Callable[[], None]) -> Response:
        request_id = request.headers.get("x-request-id", "")
        if not _REQUEST_ID.fullmatch(request_id):
            request_id = uuid.uuid4().hex
        try:
            message = body.generate_request(request_id)
        except BadRequest as exc:
            raise ApiError(400, str(exc), param=exc.param, code=exc.code) from None
        call = self.decode.Generate(message, metadata=self._metadata(request), timeout=self._timeout(request))
        # A client that goes away cancels the call: this watch until the answer starts, then, for a stream,
        # sse-starlette's own.
        watch = asyncio.create_task(_cancel_on_disconnect(request, call))
        streaming = False
        try:
            item = await self._next(call, watch)
            if item is None:
                return Response(status_code=CLIENT_GONE)
            self.metrics.ttft.observe(time.perf_counter() - t0)
            headers = {"x-request-id": request_id}
            answer = Answer(shape, f"{shape.id_prefix}{request_id}", int(time.time()), self.model_name)
            if body.stream:
                streaming = True
                events = self._events(call, item, answer, body.include_usage(), t0, release)
                return EventSourceResponse(events, headers=headers, ping=15)
            while not item.HasField("result"):
                item = await self._next(call, watch)
                if item is None:
                    return Response(status_code=CLIENT_GONE)
            self.metrics.latency.observe(time.perf_counter() - t0)
            return JSONResponse(answer.whole(item.result), headers=headers)
        finally:
            watch.cancel()
            if not streaming:
                call.cancel()

    async def _next(self, call: Any, watch: asyncio.Task[None]) -> decode_pb2.GenerateResponse | None:
        """The call's next message; None once the client has gone (`watch` cancelled the call)."""
        try:
            return await self._read(call)
        except asyncio.CancelledError:  # grpc.aio's answer to a read of a cancelled call
            if watch.done():
                return None
            raise

    async def _read(self, call: Any) -> decode_pb2.GenerateResponse:
        try:
            item = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc) from None
        if item is grpc.aio.EOF:
            raise ApiError(502, "the gRPC front door ended the stream without a result", "server_error",
                           code="bad_gateway")
        return item  # type: ignore[no-any-return]

    async def _events(self, call: Any, item: decode_pb2.GenerateResponse, answer: Answer, include_usage: bool,
                      t0: float, release: Callable[[], None]) -> AsyncIterator[dict[str, str]]:
        """The stream's events: OpenAI's chunks, then [DONE]. The caller's disconnect cancels this generator
        (sse-starlette), and with it the call."""
        try:
            if answer.shape is CHAT:
                yield answer.event({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}, include_usage)
            while True:
                if item.HasField("result"):
                    r = item.result
                    yield answer.event(answer.shape.choice("", FINISH.get(r.finish_reason, r.finish_reason), True),
                                       include_usage)
                    if include_usage:
                        yield answer.event(None, True, usage(r.usage))
                    yield {"data": "[DONE]"}
                    self.metrics.latency.observe(time.perf_counter() - t0)
                    return
                if item.token.text:
                    yield answer.event(answer.shape.choice(item.token.text, None, True), include_usage)
                item = await self._read(call)
        except ApiError as exc:
            log.info("stream %s ended by an error: %s", answer.id, exc)
            yield {"data": json.dumps(exc.body())}
        finally:
            call.cancel()
            release()

    # --- helpers

    def _metadata(self, request: Request) -> tuple[tuple[str, str], ...]:
        auth = request.headers.get("authorization")
        if auth is None:
            return ()
        if not auth.isascii() or not auth.isprintable() or len(auth) > 4096:
            raise ApiError(401, "the Authorization header is not `Bearer <token>` with a token as `kvserve token` "
                                "prints it", "authentication_error", code="invalid_api_key")
        return (("authorization", auth),)

    def _timeout(self, request: Request) -> float:
        """--timeout-s, or less when the client says it waits less (the OpenAI SDKs send X-Stainless-Timeout)."""
        with contextlib.suppress(ValueError):
            asked = float(request.headers.get("x-stainless-timeout", "inf"))
            if 0 < asked < self.timeout_s:
                return asked
        return self.timeout_s

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvserve"}

    def _no_model(self, name: str) -> ApiError:
        return ApiError(404, f"the model {name!r} does not exist here: this server serves {self.model_name!r} "
                             "(GET /v1/models)", param="model", code="model_not_found")

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the body is larger than {self.max_body_bytes} bytes (--max-body-bytes)",
                        code="request_too_large")


@dataclass(frozen=True, slots=True)
class Answer:
    """One request's answer: its id, time and model on every chunk."""

    shape: Shape
    id: str
    created: int
    model: str

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, r: decode_pb2.GenerateResult) -> dict[str, Any]:
        choice = self.shape.choice(r.text, FINISH.get(r.finish_reason, r.finish_reason), False)
        return {**self._head(self.shape.object), "choices": [choice], "usage": usage(r.usage)}

    def event(self, choice: dict[str, Any] | None, include_usage: bool,
              usage_: dict[str, Any] | None = None) -> dict[str, str]:
        chunk = {**self._head(self.shape.chunk_object), "choices": [] if choice is None else [choice]}
        if include_usage:  # as OpenAI: null on every chunk but the last, which has no choices
            chunk["usage"] = usage_
        return {"data": json.dumps(chunk)}


async def _cancel_on_disconnect(request: Request, call: Any) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            call.cancel()
            return
