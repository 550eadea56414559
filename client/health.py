"""`kvserve health ADDR`: asks a server's standard gRPC health service (grpc.health.v1 Health/Check), for
container health checks, probes and scripts.

Exit code 0 when the server (or `--service`) is SERVING; 1 when it answers anything else (NOT_SERVING,
as while it drains before a stop, or a service it does not know); 2 when it cannot be asked (nothing
listens, the TLS handshake fails, the deadline passes, bad arguments). One line on stdout for an
answer, on stderr for a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import local

SERVING, NOT_SERVING, UNREACHABLE = 0, 1, 2


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvserve health",
        description="Ask a kvserve server's gRPC health service (grpc.health.v1 Health/Check). Exit code 0: "
                    "SERVING; 1: NOT_SERVING (draining) or an unknown --service; 2: not reachable or bad "
                    "arguments.",
        epilog="The TLS flags default to KVSERVE_TLS_CA, KVSERVE_TLS_CERT and KVSERVE_TLS_KEY, so inside a "
               "service's container the check presents the service's own certificate (the store and prefill "
               "take only callers with one from their CA). Without them, a server of a `kvserve up` on this "
               "host is asked with the admin certificate that `up` made.",
    )
    p.add_argument("addr", metavar="ADDR", help="HOST:PORT (or unix:PATH) of a kvstore, prefill, decode or router "
                                                "server, or of its --health-listen")
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


def credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS from the flags; given none, the admin certificate of a `kvserve up` serving `args.addr` on this host
    (client/local.py); else None (plaintext). ValueError names a missing or unreadable file."""
    if args.tls_cert is None and args.tls_key is None and args.tls_ca is None:
        found = local.find(args.addr)
        return None if found is None else found.admin_credentials()
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together: give both or neither")

    def read(path: str | None, flag: str) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None

    return grpc.ssl_channel_credentials(root_certificates=read(args.tls_ca, "--tls-ca"),
                                        private_key=read(args.tls_key, "--tls-key"),
                                        certificate_chain=read(args.tls_cert, "--tls-cert"))


def check(addr: str, service: str = "", timeout_s: float = 5.0,
          creds: grpc.ChannelCredentials | None = None) -> str:
    """The status name the server at `addr` gives `service` ("SERVING", "NOT_SERVING", ...; "SERVICE_UNKNOWN"
    for a name it does not serve). grpc.RpcError when it cannot be asked."""
    with grpc.insecure_channel(addr) if creds is None else grpc.secure_channel(addr, creds) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s).status
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # the standard servicer's answer for an unknown name
                return "SERVICE_UNKNOWN"
            raise
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(status))


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    what = f"{args.addr} {args.service}".rstrip()
    try:
        status = check(args.addr, args.service, args.timeout, credentials(args))
    except ValueError as exc:
        print(f"health: {exc}", file=sys.stderr)
        return UNREACHABLE
    except grpc.RpcError as exc:
        code = exc.code().name if isinstance(exc, grpc.Call) else "UNKNOWN"
        detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        if args.json:
            print(json.dumps({"addr": args.addr, "service": args.service, "status": "UNREACHABLE",
                              "error": f"{code}: {detail}"}))
        print(f"{what}: not reachable: {code}: {detail}", file=sys.stderr)
        return UNREACHABLE
    if args.json:
        print(json.dumps({"addr": args.addr, "service": args.service, "status": status}))
    else:
        print(f"{what}: {status}")
    return SERVING if status == "SERVING" else NOT_SERVING


if __name__ == "__main__":
    sys.exit(main())
