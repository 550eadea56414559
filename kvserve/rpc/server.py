"""A kvserve gRPC server: health, reflection, error mapping, metrics, graceful shutdown.

Servicers raise errors that `kvserve.rpc.errors.status_of` maps; one interceptor turns them into gRPC
status codes, so handlers carry no try/except of their own.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from kvserve.rpc.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, Unimplemented, status_of
from kvserve.rpc.tls import TLSConfig, describe, server_credentials
from protos.retry import RETRY_AFTER

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# Room for protobuf framing around a full 4 MiB chunk.
GRPC_MESSAGE_LIMIT = MAX_MESSAGE_BYTES + 64 * 1024

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT),
    ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT),
]
# The services' channels to each other: back within about a second of a restarted peer (gRPC's default
# backoff waits up to two minutes, and 8-13 s were seen after a store restart).
CLIENT_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000),
]


# Worker threads kept for health checks (and the calls a server exempts, e.g. decode's Load), for the streams
# open to every caller (health's Watch, reflection), and for refusing calls past the limit: those answer at once
# however many long calls (streams) hold the other workers.
RESERVED_WORKERS = 12
# The most that health checks and the exempt calls may hold at once (a probe takes a millisecond; more at once are a
# flood, or callers that never send their request), and so the open streams: the other reserved workers stay free
# to answer refusals, and neither takes a slot of the calls the service is for.
PROBE_LIMIT = 4
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
# Methods that every caller may call without a token (rpc.auth) and hold for as long as they like.
OPEN_STREAMS = ("/grpc.health.v1.Health/Watch", "/grpc.reflection.")
BUSY_RETRY_S = 0.25  # the retry hint of a call refused because every worker is taken
SHARE_PORT_ENV = "KVSERVE_SHARE_PORT"  # set by `kvserve up` (stack.stack) for a service it starts again


def _abort(context: grpc.ServicerContext, exc: BaseException) -> None:
    code = status_of(exc)
    retry_after = getattr(exc, "retry_after_s", None)
    if retry_after is not None:
        context.set_trailing_metadata(((RETRY_AFTER, str(max(1, round(retry_after * 1000)))),))
    if code == grpc.StatusCode.INTERNAL:
        log.exception("unhandled error in RPC")
        context.abort(code, f"internal error: {type(exc).__name__}: {exc}")
    else:
        context.abort(code, str(exc))


class Undecodable:
    """What a request deserializer gives for bytes that are not its message (see `tolerant`)."""

    def __init__(self, message_name: str, error: Exception) -> None:
        self.problem = f"the request is not a valid {message_name} message ({error}); send the message the .proto defines"


def tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`deserialize`, giving `Undecodable` instead of raising: gRPC would answer INTERNAL
    "Exception deserializing request!"; the handler answers INVALID_ARGUMENT instead."""
    message = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
    name = message.full_name if message is not None else "request"

    def decode(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:
            return Undecodable(name, exc)

    return decode


def _decoded(request: Any) -> Any:
    """The request, or for a request stream an iterator of it, raising InvalidArgument at bytes that
    did not decode."""
    if isinstance(request, Undecodable):
        raise InvalidArgument(request.problem)
    if isinstance(request, Iterator):
        return (_decoded(item) for item in request)
    return request


def with_status_mapping(fn: Callable[..., Any], *, streaming: bool) -> Callable[..., Any]:
    """`fn(request, context)` ending its RPC with the status `status_of` gives when it raises: what
    the interceptor does to every handler, public so that tests without a server (grpc_testing,
    which runs no interceptor) map errors the same way. `streaming`: fn yields responses."""
    if streaming:

        def wrapped_stream(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                yield from fn(_decoded(request), context)
            except Exception as exc:
                _abort(context, exc)

        return wrapped_stream

    def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(_decoded(request), context)
        except Exception as exc:
            _abort(context, exc)

    return wrapped


class CallLimit:
    """At most `limit` calls at once (a stream counts until it ends); one more is refused at once with
    RESOURCE_EXHAUSTED and a retry hint, instead of queueing without bound for a worker thread."""

    def __init__(self, limit: int, service: str, calls: str = "calls at once (--max-workers)") -> None:
        if limit < 1:
            raise ValueError(f"the call limit must be at least 1, got {limit}")
        self.limit = limit
        self.service = service
        self.calls = calls  # what the refusal says is at its limit
        self.active = 0
        self.arrived = 0  # calls that came since the start, taken or refused (`arrive`)
        self._lock = threading.Lock()

    def enter(self) -> Callable[[], None]:
        """Counts a call in; returns its release (idempotent). ResourceExhausted when `limit` are in."""
        with self._lock:
            if self.active >= self.limit:
                raise self._refusal()
            self.active += 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    self.active -= 1

        return release

    def arrive(self) -> ResourceExhausted | None:
        """Counts a call that arrives (ErrorInterceptor); returns its refusal while `limit` are in, else None.
        `enter`, once a worker runs the call, still decides for the calls this lets through."""
        with self._lock:
            self.arrived += 1
            return self._refusal() if self.active >= self.limit else None

    def _refusal(self) -> ResourceExhausted:
        return ResourceExhausted(f"the {self.service} service is serving its limit of {self.limit} {self.calls}: "
                                 "retry shortly", retry_after_s=BUSY_RETRY_S)

    def wrap(self, fn: Callable[..., Any], *, streaming: bool) -> Callable[..., Any]:
        """`fn` counted from its start to its end. A stream is released when its generator ends or the RPC
        does, whichever is first (a generator left unfinished by a cancelled RPC may be collected late)."""
        if streaming:

            def limited_stream(request: Any, context: grpc.ServicerContext) -> Any:
                release = self.enter()
                context.add_callback(release)
                try:
                    yield from fn(request, context)
                finally:
                    release()

            return limited_stream

        def limited(request: Any, context: grpc.ServicerContext) -> Any:
            release = self.enter()
            try:
                return fn(request, context)
            finally:
                release()

        return limited


# The most a call may take to send its request once it has begun, or the next message of a request stream once
# the one before came: a unary-request handler runs only once its request has arrived, so until then a worker
# waits for it, uncounted by any limit (a caller that opens calls and never sends one would hold every worker),
# and a stream-request handler waits for each message. Past it the call is cancelled.
REQUEST_WAIT_S = 10.0


class RequestWatch:
    """Cancels each call whose next request message has not arrived within `wait_s` of its start or of the message
    before (to within `every_s`): one thread for them all, which looks once every `every_s` over the calls
    waiting for a message, so a message costs it no wake-up, and a call one record however many it sends."""

    def __init__(self, wait_s: float = REQUEST_WAIT_S, every_s: float = 1.0) -> None:
        self.wait_s, self.every_s = wait_s, every_s
        self._calls: dict[int, list[Any]] = {}  # id -> [the time its next message is due by, or 0; its context]
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def each(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Generator[Any, None, None]:
        """The call's request messages, each within `wait_s`; DeadlineExceeded (the call already cancelled) at one
        that did not come in time."""
        call = [0.0, context]
        with self._lock:
            self._calls[id(call)] = call
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="request-watch", daemon=True)
                self._thread.start()
        try:
            while True:
                call[0] = time.monotonic() + self.wait_s
                try:
                    request = next(requests)
                except StopIteration:  # the stream's end, or (gRPC reports either) the call cancelled
                    if not context.is_active():
                        raise self._late() from None
                    return
                except grpc.RpcError:  # cancelled: by this watch, or by the caller
                    raise self._late() from None
                finally:
                    call[0] = 0.0
                yield request
        finally:
            with self._lock:
                del self._calls[id(call)]

    def first(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        """The call's one request (`each`), or InvalidArgument when the call ends without one."""
        messages = self.each(requests, context)
        try:
            for request in messages:
                return request
        finally:
            messages.close()
        raise InvalidArgument("the call ended without its request message")

    def close(self) -> None:
        self._closed.set()

    def _late(self) -> DeadlineExceeded:
        return DeadlineExceeded(f"no request message within {self.wait_s:g} s of the call's start or of the message "
                                "before (or the caller cancelled)")

    def _run(self) -> None:
        while not self._closed.wait(self.every_s):
            now = time.monotonic()
            with self._lock:
                late = [context for due, context in self._calls.values() if 0 < due <= now]
            for context in late:
                try:
                    context.cancel()
                except Exception:  # never the end of the watch
                    log.exception("cancelling a call whose request did not come")


def _watched(fn: Callable[..., Any], watch: RequestWatch, *, unary: bool, streaming: bool) -> Callable[..., Any]:
    """`fn(request, context)` as a stream-request handler whose request messages come through `watch`, each within
    its bound; for a unary-request method (`unary`) the one request read here, after whatever wraps this (the
    call limit, which so counts the call while it waits for its request)."""

    def requests_for(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        return watch.first(requests, context) if unary else watch.each(requests, context)

    if streaming:

        def watched_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            yield from fn(requests_for(requests, context), context)

        return watched_stream

    def watched(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        return fn(requests_for(requests, context), context)

    return watched


Check = Callable[[], BaseException | None]  # a call's refusal as it arrives, or None (Server.check_on_arrival)
Counted = Callable[[BaseException], None]  # told of each refusal answered


def refusing(exc: BaseException, counted: Counted | None = None) -> grpc.RpcMethodHandler:
    """A handler that answers with `exc`'s status and never reads the request, whatever the method's kind: the
    worker it takes is free again at once, instead of waiting on the completion-queue thread for a request it will
    not use, or that never comes (a stream-request handler gets an iterator it may leave unread; on the wire the
    call is the same). Refusals on arrival use it, and authentication's. `counted` hears of it only here, once no
    interceptor before this one (authentication) has answered the call instead."""

    def refuse(requests: Any, context: grpc.ServicerContext) -> None:
        if counted is not None:
            counted(exc)
        _abort(context, exc)

    return grpc.stream_unary_rpc_method_handler(refuse)


class ErrorInterceptor(grpc.ServerInterceptor):
    """Ends an RPC whose handler raised with the status `status_of` gives; counts each call against the limit
    `limit_of(method)` names, if any, from its start. Each request message must come within `watch`'s bound
    (RequestWatch): a unary-request call is handed its request here, counted while it waits for it.

    It runs on gRPC's completion-queue thread as each call arrives: a call past its limit, or one that a method's
    check (`add_check`) refuses, is answered there and then, before its request is read (`refusing`). That is
    the fast path, not the bound: calls that arrived but have not reached `CallLimit.enter` or their service's
    admission yet do not count here; the limit counts them as their handler starts, and admission once their
    request is read."""

    def __init__(self, limit_of: Callable[[str], CallLimit | None] = lambda _: None,
                 watch: RequestWatch | None = None) -> None:
        self.limit_of = limit_of
        self.watch = watch or RequestWatch()
        self._checks: dict[str, tuple[Check, Counted | None]] = {}

    def add_check(self, method: str, check: Check, counted: Counted | None = None) -> None:
        self._checks[method] = (check, counted)

    def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        limit = self.limit_of(method)
        if limit is not None and (busy := limit.arrive()) is not None:
            return refusing(busy)
        if method in self._checks:
            check, counted = self._checks[method]
            if (refusal := check()) is not None:
                return refusing(refusal, counted)
        if handler.request_deserializer is not None:
            handler = handler._replace(request_deserializer=tolerant(handler.request_deserializer))
        for kind in ("unary_unary", "stream_unary", "unary_stream", "stream_stream"):
            fn = getattr(handler, kind)
            if fn:
                streaming = kind.endswith("_stream")
                unary = kind.startswith("unary")  # its request read here: every message within the watch's bound
                fn = _watched(fn, self.watch, unary=unary, streaming=streaming)
                if unary:
                    handler = handler._replace(request_streaming=True, **{kind: None})
                    kind = "stream_stream" if streaming else "stream_unary"
                if limit is not None:
                    fn = limit.wrap(fn, streaming=streaming)
                return handler._replace(**{kind: with_status_mapping(fn, streaming=streaming)})
        return handler


def listen_host(listen: str) -> str:
    """The host of a HOST:PORT listen address ("" for all interfaces), without IPv6 brackets."""
    host = listen.rpartition(":")[0].strip("[]")
    return "" if host in ("0.0.0.0", "::", "*") else host


def start_metrics_server(port: int, host: str, registry: CollectorRegistry, tls: TLSConfig | None) -> Any:
    """Prometheus's page on `host` (the gRPC server's: a service on loopback keeps its metrics there). Under
    TLS it is HTTPS with the service's certificate, and a scraper must present a certificate from the CA, as
    the internal gRPC servers ask: the page names block counts, tenants' load and timings, and a scraper
    (Prometheus's tls_config, `kvserve stats`) can present one."""
    https: dict[str, Any] = {}
    if tls is not None:
        cert, key, ca = tls.paths
        if cert is None or key is None or ca is None:
            raise OSError("metrics under TLS need the service's certificate, key and CA as files")
        https = {"certfile": cert, "keyfile": key, "client_cafile": ca, "client_auth_required": True}
    server, _ = start_http_server(port, addr=host or "0.0.0.0", registry=registry, **https)
    return server


class CheckOnly(health_pb2_grpc.HealthServicer):
    """Health's Check, as `servicer` answers it, and no Watch: a few callers holding Watch streams would take
    every worker of a health-only server."""

    def __init__(self, servicer: health.HealthServicer) -> None:
        self.servicer = servicer

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 - gRPC method name
        return self.servicer.Check(request, context)

    def Watch(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 - gRPC method name
        raise Unimplemented("this address answers Check only; Watch on the service's port")


class Server:
    """A gRPC server with health, reflection, error mapping and optional Prometheus metrics.

    `add(register_fn, servicer, service_name)` registers a business servicer; `start()` binds
    and returns the bound port (listen on port 0 in tests). With `tls` it serves TLS, and with the
    CA in it and `require_client_cert` (internal services) only to callers with a certificate from
    that CA.

    At most `max_workers` calls run at once; one more is refused at once (CallLimit). Health checks and the
    `exempt` methods (full names, "/package.Service/Method") count against a limit of their own instead,
    PROBE_LIMIT (here and on the `health_listen` server), and so do the OPEN_STREAMS: RESERVED_WORKERS threads
    beyond `max_workers` serve them and the refusals, so a server busy with long streams still answers its
    health check at once, and callers without a token cannot take the service's slots. A call that does not
    send its request within `request_wait_s` of its start (a request stream, each message within that of the
    one before) is cancelled (RequestWatch).
    """

    def __init__(
        self,
        listen: str,
        *,
        max_workers: int = 32,
        metrics_port: int | None = None,
        registry: CollectorRegistry | None = None,
        interceptors: Iterable[grpc.ServerInterceptor] = (),
        tls: TLSConfig | None = None,
        require_client_cert: bool = True,
        exempt: Iterable[str] = (),
        name: str = "",
        health_listen: str | None = None,
        request_wait_s: float = REQUEST_WAIT_S,
    ) -> None:
        self.listen = listen
        self.tls = tls
        self.require_client_cert = require_client_cert
        self.metrics_port = metrics_port
        self.registry = registry or CollectorRegistry()
        self.limit = CallLimit(max_workers, name or "this")
        self._exempt = frozenset({HEALTH_CHECK, *exempt})
        self._probes = self._probe_limit(name)
        self._open_streams = CallLimit(PROBE_LIMIT, name or "this", "health watches and reflection streams at once")
        self._watch = RequestWatch(request_wait_s)
        self._errors = ErrorInterceptor(self._limit_of, self._watch)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers + RESERVED_WORKERS),
            # `interceptors` come first (authentication), then errors map to statuses. Authentication asks this one for
            # the handler before it decides, so the checks here run first: a refusal's side effects wait for its
            # handler to run (`refusing`).
            interceptors=[*interceptors, self._errors],
            # No SO_REUSEPORT: a second server on a taken port must fail, not share it; but beside the placeholder
            # that holds the port while `kvserve up` starts this service again (stack.placeholder), it shares it.
            options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", int(os.environ.get(SHARE_PORT_ENV) == "1"))],
        )
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        # Health alone, on a gRPC server of its own: its own completion-queue thread, never behind the
        # events of the main server's streams (a probe there waited up to 2 s under 600 streams, 0.2 s here).
        self.health_listen = health_listen
        self._health_server: grpc.Server | None = None
        if health_listen is not None:
            health_limit = self._probe_limit(name)
            self._health_server = grpc.server(futures.ThreadPoolExecutor(max_workers=RESERVED_WORKERS),
                                              interceptors=[ErrorInterceptor(lambda _: health_limit, self._watch)],
                                              options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(CheckOnly(self._health), self._health_server)
        self._service_names: list[str] = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        self._reflected = list(self._service_names)
        self.port = 0
        self.bound_metrics_port: int | None = None
        self._metrics_server: Any = None

    @staticmethod
    def _probe_limit(name: str) -> CallLimit:
        return CallLimit(PROBE_LIMIT, name or "this", "probes at once (health checks, a router's load polls)")

    def _limit_of(self, method: str) -> CallLimit:
        if method in self._exempt:
            return self._probes
        return self._open_streams if method.startswith(OPEN_STREAMS) else self.limit

    def add(self, register: Callable[[Any, grpc.Server], None], servicer: Any, service_name: str, *,
            internal: bool = False) -> None:
        """Registers a servicer; an `internal` one (answering only other services) is left out of reflection,
        which lists the public API."""
        register(servicer, self._server)
        self._service_names.append(service_name)
        if not internal:
            self._reflected.append(service_name)

    def check_on_arrival(self, method: str, check: Check, counted: Counted | None = None) -> None:
        """`check()` runs as each call of `method` (its full name) arrives, before a worker reads the request; the
        error it returns, if any, is the call's answer, and `counted(error)` is told once it is answered. It must
        be quick and change nothing (it runs on the thread that takes every call's events, and also for calls
        that authentication then refuses): an admission bound, `kvserve.rpc.admission.Admission.refusal`."""
        self._errors.add_check(method, check, counted)

    def start(self) -> int:
        """Binds and serves; OSError with the address when a port is taken or invalid."""
        if self.metrics_port is not None:
            try:
                self._metrics_server = start_metrics_server(self.metrics_port, listen_host(self.listen),
                                                               self.registry, self.tls)
            except OSError as exc:
                raise OSError(f"cannot serve metrics on port {self.metrics_port}: {exc.strerror or exc}") from None
            self.bound_metrics_port = self._metrics_server.server_port
        reflection.enable_server_reflection(self._reflected, self._server)
        credentials = None if self.tls is None else server_credentials(self.tls,
                                                                      require_client_cert=self.require_client_cert)
        try:
            if credentials is None:
                self.port = self._server.add_insecure_port(self.listen)
            else:
                self.port = self._server.add_secure_port(self.listen, credentials)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            if self._metrics_server is not None:
                self._metrics_server.shutdown()
            raise OSError(f"cannot listen on {self.listen}: the address is taken or not valid")
        if self._health_server is not None:
            try:  # as secure as the main port: a probe presents what a caller there would
                bound = (self._health_server.add_insecure_port(self.health_listen or "") if self.tls is None else
                         self._health_server.add_secure_port(self.health_listen or "", credentials))
            except RuntimeError:
                bound = 0
            if bound == 0:
                if self._metrics_server is not None:
                    self._metrics_server.shutdown()
                raise OSError(f"cannot serve health on {self.health_listen}: the address is taken or not valid")
            self._health_server.start()
        self._server.start()
        for name in ["", *self._service_names]:
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        metrics = "" if self.bound_metrics_port is None else (
            f" (metrics on port {self.bound_metrics_port}, " + ("HTTP)" if self.tls is None else
                                                              "HTTPS, for callers with a certificate from the CA)"))
        health_at = "" if self.health_listen is None else f" (health checks also on {self.health_listen})"
        log.info("listening on port %d%s%s; %s", self.port, metrics, health_at,
                 describe(self.tls, require_client_cert=self.require_client_cert))
        return self.port

    def drain(self) -> None:
        """Health turns NOT_SERVING, so that balancers stop sending new requests."""
        self._health.enter_graceful_shutdown()

    def stop(self, grace_s: float = 5.0) -> None:
        self.drain()
        self._server.stop(grace_s).wait()
        if self._health_server is not None:
            self._health_server.stop(0).wait()
        self._watch.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()

    def wait(self) -> None:
        self._server.wait_for_termination()


def run_until_signal(
    server: Server,
    on_stop: Iterable[Callable[[], None]] = (),
    grace_s: float = 5.0,
    before_stop: Iterable[Callable[[], None]] = (),
    main_loop: Callable[[], None] | None = None,
    exit_within_s: float | None = None,
) -> None:
    """Blocks until SIGTERM or SIGINT, then drains and stops the server.

    Health turns NOT_SERVING first; `before_stop` callbacks then end in-flight work with their own
    status (while the server can still send it); then the server stops within `grace_s` and the
    `on_stop` callbacks release what is left. With `main_loop` (an engine's step loop, which must
    run on the main thread), the main thread runs it meanwhile and a `before_stop` callback ends it;
    should it end by itself, the service shuts down as on a signal.

    With `exit_within_s` (a service's own process), the stop is bounded: a process still there that many
    seconds after the stop began, whatever holds it (a callback, a thread the interpreter joins at exit),
    writes every thread's stack to stderr and exits with code 1. faulthandler's timer is a C thread: it fires
    during the interpreter's own shutdown too, and without the GIL.
    """
    # Plain flags, no Event: a handler runs on the main thread between two of its bytecodes, also inside
    # an earlier handler, so one that took a lock (Event.set does) could wait forever on its own thread
    # when a second signal came while the first held it (SIGTERM from two sources at once).
    stop_signal = 0
    loop_ended = False

    def handle(signum: int, _frame: Any) -> None:
        nonlocal stop_signal
        if not stop_signal:
            stop_signal = signum
            log.info("signal %d: stopping", signum)

    def wait_and_stop() -> None:
        while not stop_signal and not loop_ended:
            time.sleep(0.05)
        if exit_within_s is not None:
            faulthandler.dump_traceback_later(exit_within_s, exit=True)
        server.drain()
        for fn in before_stop:
            fn()
        server.stop(grace_s)
        for fn in on_stop:
            fn()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    if main_loop is None:
        wait_and_stop()
        return
    waiter = threading.Thread(target=wait_and_stop, name="shutdown")
    waiter.start()
    try:
        main_loop()
    finally:
        if not stop_signal:
            log.error("the main loop ended before a stop signal: shutting down")
        loop_ended = True
        waiter.join()
