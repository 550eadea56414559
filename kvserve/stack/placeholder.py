"""What answers on a service's port while `kvserve up` starts it again, so that a caller hears why rather than
"connection refused": a gRPC service's placeholder answers every call, health included, with UNAVAILABLE ("decode
restarting (killed: out of memory); retry in a few seconds", trailer `retry-after-ms`); the HTTP API's answers every
request with 503, OpenAI's error object and Retry-After. Each speaks the service's own TLS. It binds with
SO_REUSEPORT, as the process that replaces it does (rpc.server.SHARE_PORT_ENV): both listen until `up` closes the
placeholder, as soon as the new process says it listens (it serves from then on)."""

from __future__ import annotations

import json
import math
import socket
import ssl
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc

from kvserve.rpc.errors import Unavailable
from kvserve.rpc.server import refusing
from kvserve.rpc.tls import TLSConfig, TLSError, server_credentials
from kvserve.stack.stack import ServiceSpec, flag_value

RETRY_AFTER_S = 1.0  # the hint; a restart takes seconds (the tiny model) to minutes (a large one)
FRONT_DOORS = ("decode",)  # asks callers for no certificate (rpc.tls); the other gRPC services take only the CA's
MAX_BODY = 1 << 20  # of a request the HTTP placeholder reads before it answers (unread bytes would reset the answer)
MAX_HTTP_CONNECTIONS = 64  # answered at once by the HTTP placeholder (a thread each); more are closed unanswered


class Restarting(Unavailable):
    retry_after_s = RETRY_AFTER_S  # read by rpc.server's mapping: the retry-after-ms trailer


def restarting(name: str, why: str) -> str:
    return f"{name} restarting ({why}); retry in a few seconds"


class Placeholder:
    """Holds the port of service `spec` while it is down, answering every call with `message` (which may change)."""

    def __init__(self, spec: ServiceSpec, message: str) -> None:
        self.spec = spec
        self.message = message
        self.closed = False
        self._lock = threading.Lock()
        self._grpc: grpc.Server | None = None
        self._http: _HTTPServer | None = None

    @classmethod
    def open(cls, spec: ServiceSpec, message: str) -> Placeholder | None:
        """Serving on the service's port; None where it cannot (another process holds the port, `up` says so as it
        starts the service again; its TLS files cannot be read, the service will say which)."""
        placeholder = cls(spec, message)
        cert, key, ca = (flag_value(spec.args, f) for f in ("--tls-cert", "--tls-key", "--tls-ca"))
        tls = None if cert is None or key is None else (cert, key, ca)
        try:
            if spec.health_url is None:
                placeholder._serve_grpc(tls)
            else:
                placeholder._serve_http(tls)
        except (OSError, RuntimeError, TLSError, ValueError):
            placeholder.close()
            return None
        return placeholder

    def _serve_grpc(self, tls: tuple[str, str, str | None] | None) -> None:
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"up-{self.spec.name}"),
                                 handlers=[_Refuse(self)], options=[("grpc.so_reuseport", 1)])
        listen = flag_value(self.spec.args, "--listen") or ""
        if tls is None:
            port = self._grpc.add_insecure_port(listen)
        else:
            credentials = server_credentials(TLSConfig.load(*tls), require_client_cert=self.spec.name not in FRONT_DOORS)
            port = self._grpc.add_secure_port(listen, credentials)
        if port == 0:
            raise OSError(f"cannot listen on {listen}")
        self._grpc.start()

    def _serve_http(self, tls: tuple[str, str, str | None] | None) -> None:
        host, _, port = (flag_value(self.spec.args, "--listen") or "").rpartition(":")
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("HTTPServer", (_HTTPServer,), {"address_family": family})
        self._http = server_class((host or "0.0.0.0", int(port)), _Answer, placeholder=self)
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(tls[0], tls[1])
            # The handshake happens on each request's own thread (as it first reads), not on the one that accepts.
            self._http.socket = context.wrap_socket(self._http.socket, server_side=True, do_handshake_on_connect=False)
        threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.05},
                         name=f"up-{self.spec.name}", daemon=True).start()

    def close(self) -> None:
        """Stops answering and frees the port (at once: its calls are answered as they come); any thread may."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self._grpc is not None:
                self._grpc.stop(None)
            if self._http is not None:
                self._http.shutdown()
                self._http.answer_queued()
                self._http.server_close()


class _Refuse(grpc.GenericRpcHandler):
    def __init__(self, placeholder: Placeholder) -> None:
        self._placeholder = placeholder

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        return refusing(Restarting(self._placeholder.message))


class _HTTPServer(ThreadingHTTPServer):
    allow_reuse_port = True
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *,
                 placeholder: Placeholder) -> None:
        self.placeholder = placeholder
        self._slots = threading.BoundedSemaphore(MAX_HTTP_CONNECTIONS)
        super().__init__(address, handler)

    def process_request(self, request: socket.socket, client_address: tuple[str, int]) -> None:  # type: ignore[override]
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: socket.socket, client_address: tuple[str, int]) -> None:  # type: ignore[override]
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def answer_queued(self) -> None:
        """Answers the connections the kernel has queued for this listener, which closing it would reset (the new
        process's listener, beside it, takes the next ones)."""
        self.socket.setblocking(False)
        while True:
            try:
                request, address = self.get_request()
            except OSError:
                return
            self.process_request(request, address)


class _Answer(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"
    timeout = 5.0  # s, for a caller's request (and its TLS handshake)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(min(max(length, 0), MAX_BODY))
        body = json.dumps({"error": {"message": self.server.placeholder.message, "type": "service_unavailable_error",
                                     "param": None, "code": "restarting"}}).encode()
        self.send_response(503)
        for header, value in (("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                              ("Retry-After", str(math.ceil(RETRY_AFTER_S))), ("Connection", "close")):
            self.send_header(header, value)
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_PUT = do_DELETE = do_PATCH = do_GET  # noqa: N815

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's name
        pass  # `up` said why once
