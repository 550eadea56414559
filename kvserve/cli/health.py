"""`kvserve health ADDR`: asks a server's standard gRPC health service (grpc.health.v1 Health/Check), or GETs
an http:// or https:// URL (the HTTP front's /health), for container health checks, probes and scripts.

Exit code 0 when the server (or `--service`) is SERVING, or BUSY (it refused the check as RESOURCE_EXHAUSTED: a
server answers only a few health checks at once, and busy is not down), or the URL answers HTTP 200; 1 when it answers
anything else (NOT_SERVING, as while it drains before a stop, or a service it does not know; any other
HTTP status, as 503 while the HTTP front's upstream does not serve); 2 when it cannot be asked (nothing
listens, the TLS handshake fails, the deadline passes, bad arguments). One line on stdout for an
answer, on stderr for a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import sys
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import local
from client.local import Layout
from kvserve.cli.diagnose import Dialed, explain
from kvserve.engine.fetch import DATA_DIR_DEFAULT, default_data_dir
from kvserve.stack.status import UpStatus, no_up, read_status

SERVING, NOT_SERVING, UNREACHABLE = 0, 1, 2
URL_SCHEMES = ("http://", "https://")
_BODY_EXCERPT = 200  # characters of a non-200 answer's body shown with it


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvserve health",
        description="Ask a kvserve server's gRPC health service (grpc.health.v1 Health/Check), or GET an http:// "
                    "or https:// URL such as the HTTP front's /health. Exit code 0: SERVING, or BUSY (the check refused "
                    "as RESOURCE_EXHAUSTED: busy is not down) (HTTP 200); 1: "
                    "NOT_SERVING (draining), an unknown --service, or any other HTTP status (503: the HTTP front's "
                    "upstream does not serve); 2: not reachable or bad arguments.",
        epilog="The TLS flags default to KVSERVE_TLS_CA, KVSERVE_TLS_CERT and KVSERVE_TLS_KEY, so inside a "
               "service's container the check presents the service's own certificate (the store and prefill "
               "take only callers with one from their CA). Without them, a server of a `kvserve up` on this "
               "host is asked with the admin certificate that `up` made (an https:// URL: checked against its "
               "CA), and an https:// URL otherwise against the system's CAs. A URL is asked as given: no proxy, "
               "no redirect followed.",
    )
    p.add_argument("addr", metavar="ADDR", nargs="?",
                   help="HOST:PORT (or unix:PATH) of a kvstore, prefill, decode or router server, or of its "
                        "--health-listen; or a URL, e.g. https://127.0.0.1:8000/health (the HTTP front). Default: "
                        "each service of the `kvserve up` on --data-dir, one line each (exit code: the worst)")
    p.add_argument("--data-dir", type=Path, default=default_data_dir(),
                   help=f"where the `kvserve up` to ask runs, without ADDR (default: {DATA_DIR_DEFAULT})")
    p.add_argument("--service", default="",
                   help="a service name, e.g. kvserve.v1.Decode (default: the whole server)")
    p.add_argument("--timeout", type=positive_float, default=5.0, metavar="S",
                   help="seconds to wait for the answer (default %(default)s)")
    p.add_argument("--tls-ca", default=os.environ.get("KVSERVE_TLS_CA") or None, metavar="PEM",
                   help="call over TLS, trusting this CA (default: $KVSERVE_TLS_CA)")
    p.add_argument("--tls-cert", default=os.environ.get("KVSERVE_TLS_CERT") or None, metavar="PEM",
                   help="present this certificate, for servers that require one (default: $KVSERVE_TLS_CERT)")
    p.add_argument("--tls-key", default=os.environ.get("KVSERVE_TLS_KEY") or None, metavar="PEM",
                   help="the certificate's private key (default: $KVSERVE_TLS_KEY)")
    p.add_argument("--json", action="store_true", help="print {addr, service, status} as JSON")
    return p


def known_credentials(addr: str, up: UpStatus | None) -> Layout | None:
    """The credentials of the `kvserve up` on this host that serves `addr`: those registered for its port
    (client/local.py), else `up`'s (--data-dir's up.json) when it serves `addr`. Sending them is safe
    even to a port another process took since: the call trusts only their CA."""
    return local.find(addr) or (up.credentials_of(addr) if up is not None else None)


def credentials(args: argparse.Namespace, addr: str, up: UpStatus | None = None
                ) -> tuple[grpc.ChannelCredentials | None, Dialed]:
    """TLS from the flags --tls-ca, --tls-cert, --tls-key of `args`; given none, the admin certificate of the
    `kvserve up` serving `addr` on this host (`known_credentials`); else None (plaintext). And how that dials
    `addr`, to explain a failure, naming the files of that `up`. ValueError names a missing or unreadable
    file."""
    known = known_credentials(addr, up)
    if args.tls_cert is None and args.tls_key is None and args.tls_ca is None:
        if known is None:
            return None, Dialed(addr)
        return known.admin_credentials(), Dialed(addr, True, str(known.ca), client_cert=True, known=known)
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together: give both or neither")

    def read(path: str | None, flag: str) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None

    creds = grpc.ssl_channel_credentials(root_certificates=read(args.tls_ca, "--tls-ca"),
                                         private_key=read(args.tls_key, "--tls-key"),
                                         certificate_chain=read(args.tls_cert, "--tls-cert"))
    return creds, Dialed(addr, True, args.tls_ca, client_cert=args.tls_cert is not None, known=known)


def check(addr: str, service: str = "", timeout_s: float = 5.0,
          creds: grpc.ChannelCredentials | None = None) -> str:
    """The status name the server at `addr` gives `service` ("SERVING", "NOT_SERVING", ...; "SERVICE_UNKNOWN"
    for a name it does not serve; "BUSY" when it refuses the check as RESOURCE_EXHAUSTED). grpc.RpcError when it
    cannot be asked."""
    with grpc.insecure_channel(addr) if creds is None else grpc.secure_channel(addr, creds) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s).status
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # the standard servicer's answer for an unknown name
                return "SERVICE_UNKNOWN"
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # its health checks at their limit: it runs
                return "BUSY"
            raise
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(status))


@dataclass(frozen=True, slots=True)
class HttpAnswer:
    """What a URL answered: its status line and the start of its body (one line)."""

    status: int
    reason: str
    body: str


class Unreachable(Exception):
    """The URL could not be asked; the message says why, for a person."""


def is_url(addr: str) -> bool:
    return addr.startswith(URL_SCHEMES)


def ssl_context(args: argparse.Namespace, netloc: str, up: UpStatus | None = None) -> ssl.SSLContext:
    """An https check's TLS: --tls-ca (given none, the CA of a `kvserve up` serving `netloc` on this host: the
    registry's, else `up`'s; else the system's), and --tls-cert/--tls-key when given. ValueError names a missing
    or unusable file."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together: give both or neither")
    ca = args.tls_ca
    if ca is None and (found := local.find(netloc)) is not None:
        ca = str(found.ca)
    elif ca is None and up is not None and up.serves(netloc):
        ca = up.ca
    try:
        context = ssl.create_default_context(cafile=ca)
    except OSError as exc:  # ssl.SSLError too
        raise ValueError(f"--tls-ca {ca}: {_file_problem(exc, 'not a PEM certificate')}") from None
    if args.tls_cert is not None:
        try:
            context.load_cert_chain(args.tls_cert, args.tls_key)
        except OSError as exc:
            problem = _file_problem(exc, "not a PEM certificate and its key")
            raise ValueError(f"--tls-cert {args.tls_cert} --tls-key {args.tls_key}: {problem}") from None
    return context


def _file_problem(exc: OSError, unreadable: str) -> str:
    """An OSError's words (no such file, ...), or `unreadable` for a file that OpenSSL could not read."""
    return unreadable if isinstance(exc, ssl.SSLError) or not exc.strerror else exc.strerror


def _why(exc: Exception, url: urllib.parse.SplitResult, timeout_s: float) -> str:
    """A failed request's cause, in words, with a hint where the usual mistake is known."""
    import http.client
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (f"TLS: the server's certificate is not trusted: {exc.verify_message} (check it against the CA "
                "that signed it with --tls-ca; the URL's host must be one the certificate names)")
    if isinstance(exc, ssl.SSLError):
        if exc.reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE"):
            return f"TLS: the server does not answer in TLS ({exc.reason}): a plain HTTP server? ask http://"
        return f"TLS: {exc.reason or exc}"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing listens there)"
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve {url.hostname}: {exc.strerror}"
    if isinstance(exc, (http.client.HTTPException, ConnectionResetError)):  # RemoteDisconnected is both
        hint = " (an HTTPS server? ask https://)" if url.scheme == "http" else ""
        return f"the connection closed without an HTTP answer{hint}"
    return str(getattr(exc, "strerror", None) or exc)


def check_url(url: str, timeout_s: float = 5.0, context: ssl.SSLContext | None = None) -> HttpAnswer:
    """GETs `url` (no proxy, no redirect followed), each step of it within `timeout_s`. Unreachable when it
    cannot be asked; ValueError for a URL that is not http:// or https:// with a host."""
    import http.client  # here, not at the top: a gRPC probe, the frequent one, spares its import (kvserve/cli/__init__.py)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http:// or https:// URL with a host")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{url!r}: {exc}") from None
    target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
    conn = (http.client.HTTPSConnection(parts.hostname, port, timeout=timeout_s, context=context)
            if parts.scheme == "https" else http.client.HTTPConnection(parts.hostname, port, timeout=timeout_s))
    try:
        conn.request("GET", target, headers={"Accept": "application/json, text/plain"})
        response = conn.getresponse()
        body = response.read(64 * 1024).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException) as exc:
        raise Unreachable(_why(exc, parts, timeout_s)) from None
    finally:
        conn.close()
    first_line = " ".join(body.split())[:_BODY_EXCERPT]
    return HttpAnswer(response.status, response.reason, first_line)


def _main_url(args: argparse.Namespace, url: str, up: UpStatus | None = None) -> int:
    try:
        if args.service:
            raise ValueError("--service names a gRPC service: a URL is asked as it is")
        context = ssl_context(args, urllib.parse.urlsplit(url).netloc, up) if url.startswith("https://") else None
        answer = check_url(url, args.timeout, context)
    except ValueError as exc:
        print(f"health: {exc}", file=sys.stderr)
        return UNREACHABLE
    except Unreachable as exc:
        if args.json:
            print(json.dumps({"addr": url, "service": "", "status": "UNREACHABLE", "error": str(exc)}))
        print(f"{url}: not reachable: {exc}", file=sys.stderr)
        return UNREACHABLE
    status = "SERVING" if answer.status == 200 else "NOT_SERVING"
    said = f"HTTP {answer.status} {answer.reason}".rstrip() + (f": {answer.body}" if answer.body else "")
    if args.json:
        report = {"addr": url, "service": "", "status": status, "http_status": answer.status}
        print(json.dumps(report if answer.status == 200 else {**report, "error": said}))
    else:
        print(f"{url}: {status}" if answer.status == 200 else f"{url}: {status} ({said})")
    return SERVING if answer.status == 200 else NOT_SERVING


def _main_grpc(args: argparse.Namespace, addr: str, up: UpStatus | None = None) -> int:
    what = f"{addr} {args.service}".rstrip()
    try:
        creds, dialed = credentials(args, addr, up)
        status = check(addr, args.service, args.timeout, creds)
    except ValueError as exc:
        print(f"health: {exc}", file=sys.stderr)
        return UNREACHABLE
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
        detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        why = explain(dialed, code, detail or "")
        if args.json:
            print(json.dumps({"addr": addr, "service": args.service, "status": "UNREACHABLE", "error": why}))
        print(f"{what}: not reachable: {why}", file=sys.stderr)
        return UNREACHABLE
    if args.json:
        print(json.dumps({"addr": addr, "service": args.service, "status": status}))
    else:
        print(f"{what}: {status}")
    return SERVING if status in ("SERVING", "BUSY") else NOT_SERVING


def _main_up(args: argparse.Namespace) -> int:
    """Each service of the `kvserve up` on --data-dir; the worst exit code."""
    up = read_status(args.data_dir)
    if up is None:
        print(f"health: {no_up(args.data_dir)}: give ADDR, or start one with `kvserve up`", file=sys.stderr)
        return UNREACHABLE
    codes = [_main_grpc(args, s.addr, up) for name, s in up.services.items() if name != "http"]
    if up.http_url is not None:
        codes.append(_main_url(args, f"{up.http_url}/health", up))
    return max(codes)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.addr is None:
        if args.service:
            p.error("--service names a service of one server: give its ADDR")
        return _main_up(args)
    if is_url(args.addr):
        return _main_url(args, args.addr, read_status(args.data_dir))
    return _main_grpc(args, args.addr, read_status(args.data_dir))


if __name__ == "__main__":
    sys.exit(main())
