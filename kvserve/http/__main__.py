"""`python -m http_api` / `kvserve http`: the OpenAI-compatible HTTP API in front of a gRPC front door."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import gc
import os
import resource
import socket
import sys
from collections.abc import Sequence
from typing import Any

import grpc
import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvserve.host.collector import collect_when_quiet
from kvserve.host.process import exit_with_parent
from kvserve.http.app import Front
from kvserve.rpc.cli import (
    STOP_MARGIN_S,
    configure_logging,
    env_epilog,
    parse_args,
    parse_size,
    positive_int,
    tls_from_args,
)
from kvserve.rpc.server import CLIENT_CHANNEL_OPTIONS, SHARE_PORT_ENV, listen_host, start_metrics_server

GRACE_S = 5  # on SIGTERM, streams in flight get this long to finish


class DeadlineProtocol(H11Protocol):
    """uvicorn's HTTP/1.1, with a deadline on a request's line and headers: `timeout_s` (--client-timeout-s)
    from the connection, or from the end of the previous response, to the whole head. uvicorn has none, and its
    keep-alive timer restarts at every byte, so connections that send nothing, or a byte at a time, would
    stay open for ever; past the deadline such a connection is closed. (A body has its own deadline, in
    the app: 408.)"""

    timeout_s = 10.0
    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE and self._head_deadline is not None:  # the head is in
            self._head_deadline.cancel()
            self._head_deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """On SIGTERM: an idle connection is dropped at once. uvicorn closes it, and a TLS close then waits
        for the client's reply, which an idle pooled client never reads: the stop waited out GRACE_S."""
        if self.cycle is None or self.cycle.response_complete:
            self.transport.abort()
        else:
            super().shutdown()

    def _arm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        self._head_deadline = self.loop.call_later(self.timeout_s, self._expire)

    def _expire(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvserve http", epilog=env_epilog("http"),
        description="Serves OpenAI's HTTP API (POST /v1/chat/completions and /v1/completions, streaming or not; "
                    "GET /v1/models, /health) in front of kvserve's gRPC front door: decode, or the "
                    "router when there are several nodes. Each caller's `Authorization: Bearer <token>` goes to "
                    "the front door, which checks it as it checks gRPC callers.")
    p.add_argument("--listen", default="127.0.0.1:8000",
                   help="HOST:PORT to serve on; port 0 picks one and prints LISTENING <port> (default %(default)s)")
    p.add_argument("--upstream", default="127.0.0.1:50051",
                   help="the gRPC front door: decode, or the router (default %(default)s)")
    p.add_argument("--model-name", required=True,
                   help="the model's name: what clients send as `model`, and what GET /v1/models lists")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="most seconds one request may take (the gRPC call's deadline; a client's "
                        "X-Stainless-Timeout shortens it); past it, 504 (default %(default)s)")
    p.add_argument("--max-body-bytes", type=parse_size, default=4 << 20, metavar="BYTES",
                   help="largest request body; a larger one is 413 (default 4MiB)")
    p.add_argument("--client-timeout-s", type=float, default=10.0, metavar="S",
                   help="most seconds a client may take to send a request's head, and then its body; a connection "
                        "past the first is closed, a request past the second is 408 (default %(default)s)")
    p.add_argument("--max-connections", type=positive_int, default=1024, metavar="N",
                   help="most generations answered at once; one more is 429 at once, with a retry hint "
                        "(default %(default)s)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics (kvserve_http_*) on this port, as every service does: HTTPS for "
                        "callers with a certificate from the CA under TLS (default: none)")
    p.add_argument("--log-level", default="INFO")
    tls = p.add_argument_group("TLS", "HTTPS, required unless --insecure; `kvserve credentials DIR` makes the files")
    tls.add_argument("--tls-cert", default=None, metavar="PEM", help="the certificate this server serves HTTPS with")
    tls.add_argument("--tls-key", default=None, metavar="PEM", help="its private key")
    tls.add_argument("--tls-ca", default=None, metavar="PEM",
                     help="the CA the front door's gRPC certificate is checked against")
    tls.add_argument("--insecure", action="store_true",
                     help="plain HTTP, and plaintext gRPC to the front door: bearer tokens cross the network in "
                          "the clear. Only for a port nobody else can reach; logged as a warning")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    exit_with_parent()
    args = parse_args(parser(), argv, "http")
    configure_logging("http", args.log_level)
    tls = tls_from_args(args, "http")
    for flag in ("timeout_s", "client_timeout_s"):
        if getattr(args, flag) <= 0:
            print(f"http: --{flag.replace('_', '-')} must be more than 0, not {getattr(args, flag)}", file=sys.stderr)
            return 2
    host, _, port = args.listen.rpartition(":")
    try:
        sock = socket.create_server((listen_host(args.listen) or "0.0.0.0", int(port)),  # beside `up`'s placeholder:
                                    reuse_port=os.environ.get(SHARE_PORT_ENV) == "1")  # kvserve/stack/placeholder.py
    except (OSError, ValueError) as exc:
        print(f"http: cannot listen on {args.listen}: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 2
    credentials = None if tls is None else grpc.ssl_channel_credentials(root_certificates=tls.ca)  # presents none
    front = Front(args.upstream, args.model_name, credentials=credentials, timeout_s=args.timeout_s,
                  client_timeout_s=args.client_timeout_s, max_body_bytes=args.max_body_bytes,
                  max_requests=args.max_connections,
                  channel_options=CLIENT_CHANNEL_OPTIONS)
    bound = sock.getsockname()[1]
    metrics = None
    if args.metrics_port is not None:
        try:
            metrics = start_metrics_server(args.metrics_port, listen_host(args.listen), front.registry, tls)
        except OSError as exc:
            print(f"http: cannot serve metrics on port {args.metrics_port}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    scheme = "http" if tls is None else "https"

    def ready() -> None:
        print(f"LISTENING {bound}", flush=True)
        at = "" if metrics is None else f" (metrics on port {metrics.server_port})"
        print(f"serving OpenAI's API on {scheme}://{host or '0.0.0.0'}:{bound}/v1 for model {args.model_name!r}, "
              f"in front of {args.upstream}{at}", file=sys.stderr, flush=True)

    cert, key, _ = tls.paths if tls is not None else (None, None, None)
    # No limit_concurrency: uvicorn would answer 503 to every caller once that many connections were open,
    # idle ones included. Generations are bounded by --max-connections (429), idle connections by the head
    # deadline, and open files by the hard limit, which the soft one is raised to.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    protocol = type("DeadlineProtocol", (DeadlineProtocol,), {"timeout_s": args.client_timeout_s})
    config = uvicorn.Config(front.app(ready), http=protocol, log_config=None, access_log=False,
                            ssl_certfile=cert, ssl_keyfile=key, timeout_graceful_shutdown=GRACE_S,
                            server_header=False)
    gc.freeze()  # as every service: no collection scans what start-up made, and full ones wait (rpc.cli.serve)
    collect_when_quiet(lambda: front.arrived)
    try:
        asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))
    finally:  # what is left of the stop is bounded, as in every service (rpc.cli.serve)
        faulthandler.dump_traceback_later(STOP_MARGIN_S, exit=True)
        if metrics is not None:
            metrics.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
