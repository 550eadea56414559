"""A stdlib HTTP server to ask: what `kvserve health URL` and the HTTP front's probes are checked against."""

from __future__ import annotations

import contextlib
import http.server
import ssl
import threading
from collections.abc import Iterator


class _Answers(http.server.BaseHTTPRequestHandler):
    """GET PATH answers ANSWERS[PATH] (status, body): /health 200; /down 503, as the HTTP front answers while its
    upstream does not serve; /moved a redirect to /health; any other path 404."""

    ANSWERS: dict[str, tuple[int, str]] = {
        "/health": (200, '{"status": "SERVING"}'),
        "/down": (503, '{"status": "NOT_SERVING",\n "upstream": "router:50050: UNAVAILABLE"}'),
        "/moved": (302, ""),
    }

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        status, body = self.ANSWERS.get(self.path, (404, "no such page"))
        data = body.encode()
        self.send_response(status)
        if status == 302:
            self.send_header("Location", "/health")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a refused handshake is what the tests ask for; its traceback would land in their stderr


@contextlib.contextmanager
def http_server(tls: ssl.SSLContext | None = None) -> Iterator[int]:
    """A stdlib HTTP server on a free loopback port (HTTPS with `tls`), serving until the block ends."""
    server = _QuietServer(("127.0.0.1", 0), _Answers)
    if tls is not None:  # the handshake in the request's thread: a bad client stalls no other
        server.socket = tls.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
