"""`python -m router` / `kvserve router --decode ADDR[,ADDR...]`: the prefix-aware router."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from kvserve.host.process import exit_with_parent
from kvserve.router.index import INDEX_BYTES
from kvserve.router.policy import EJECT_AFTER, EJECTION_S, MAX_EJECTION_S, POLICIES
from kvserve.router.replica import DECODE_SERVICE
from kvserve.router.router import FIRST_TOKEN_TIMEOUT_S, MAX_MIGRATIONS, Router
from kvserve.router.server import RouterMetrics, RouterServicer
from kvserve.rpc.addresses import split_targets
from kvserve.rpc.cli import (
    add_server_flags,
    configure_logging,
    env_epilog,
    parse_args,
    serve,
    tls_from_args,
)
from kvserve.rpc.server import Server
from protos.kvserve.v1 import decode_pb2_grpc

TOKEN_ENV = "KVSERVE_TOKEN"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvserve router", epilog=env_epilog("router"),
        description="Serves the kvserve.v1.Decode API in front of several decode replicas, sending each "
                    "request to the replica whose node already holds the most of its prompt's leading KV "
                    "blocks, balanced against load; a replica that fails or hangs before the first token is "
                    "replaced by another and, failing again and again, ejected for a while, a stream whose "
                    "replica dies goes on from another, and a request "
                    "every replica refuses as busy is asked again for a moment, then refused "
                    "(RESOURCE_EXHAUSTED).")
    add_server_flags(p, listen="127.0.0.1:50050", max_workers=512)  # streams: each holds one
    p.add_argument("--decode", required=True,
                   help="decode replicas: HOST:PORT, several separated by commas; a host name that resolves to "
                        "several addresses (a Kubernetes headless Service) is that many replicas, resolved "
                        "again every 10 s")
    p.add_argument("--policy", choices=POLICIES, default="prefix",
                   help="prefix: fewest blocks left to compute plus --load-weight per sequence on the replica; "
                        "least-loaded: fewest sequences; round-robin: in turn (default %(default)s)")
    p.add_argument("--load-weight", type=float, default=32.0,
                   help="under --policy prefix, how many prompt blocks to compute one sequence already on a "
                        "replica weighs as much as: a request goes where its prefix is unless that replica runs "
                        "more sequences than another by more than the blocks it would save / this (default "
                        "%(default)s: 512 tokens at 16 per block)")
    p.add_argument("--token", default=None,
                   help=f"the router's service token, for its own calls to the replicas' internal API (their "
                        f"load, events and prompts' hashes), which decode lists in --service-tokens; requests "
                        f"pass on their callers' tokens (default ${TOKEN_ENV})")
    p.add_argument("--index-mib", type=int, default=INDEX_BYTES >> 20, metavar="MIB",
                   help="most memory the router keeps of each replica's block hashes, in MiB (its store's and its "
                        "pool's, half each; the oldest are forgotten first) (default %(default)s)")
    p.add_argument("--max-migrations", type=int, default=MAX_MIGRATIONS, metavar="N",
                   help="times one request's stream may move to another replica when its replica dies mid-stream "
                        "(the new one resumes after the tokens already sent; 0: the caller gets the failure) "
                        "(default %(default)s)")
    p.add_argument("--first-token-timeout-s", type=float, default=FIRST_TOKEN_TIMEOUT_S, metavar="S",
                   help="a replica that has sent no first response this long after it took a request (a hung "
                        "one) has the call cancelled, and the request goes to another replica; never past the "
                        "caller's deadline, and only when another replica could take it. Above the slowest first "
                        "token of a long prompt under load (0: no limit) (default %(default)s)")
    p.add_argument("--eject-after", type=int, default=EJECT_AFTER, metavar="N",
                   help="failures in a row (no first response in time, UNAVAILABLE, a stream ended without a "
                        "result) that take a replica out of choice for --ejection-s, unless it is the last one "
                        "serving (0: never) (default %(default)s)")
    p.add_argument("--ejection-s", type=float, default=EJECTION_S, metavar="S",
                   help=f"how long a replica's first ejection lasts; its n-th lasts n times that, at most "
                        f"{MAX_EJECTION_S:.0f} s; it is taken back after that once its health check says it "
                        f"serves (default %(default)s)")
    p.add_argument("--token-file", type=Path, default=None, metavar="FILE",
                   help="read the service token from FILE instead (`kvserve credentials` writes auth/router.token)")
    return p


def service_token(args: argparse.Namespace) -> str:
    """--token, else the first line of --token-file, else $KVSERVE_TOKEN ('' for none)."""
    if args.token is not None and args.token_file is not None:
        raise ValueError("give --token or --token-file, not both")
    if args.token_file is not None:
        try:
            return args.token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--token-file {args.token_file}: {getattr(exc, 'strerror', None) or exc}") from None
    return args.token if args.token is not None else os.environ.get(TOKEN_ENV, "")


def main(argv: Sequence[str] | None = None) -> int:
    exit_with_parent()
    args = parse_args(parser(), argv, "router")
    configure_logging("router", args.log_level)
    tls = tls_from_args(args, "router")
    try:
        token = service_token(args)
        if args.index_mib < 1:
            raise ValueError(f"--index-mib must be at least 1, not {args.index_mib}")
        if args.max_migrations < 0:
            raise ValueError(f"--max-migrations must be at least 0, not {args.max_migrations}")
        if args.first_token_timeout_s < 0:
            raise ValueError(f"--first-token-timeout-s must be at least 0 (0: no limit), not {args.first_token_timeout_s}")
        if args.eject_after < 0:
            raise ValueError(f"--eject-after must be at least 0 (0: never), not {args.eject_after}")
        if args.ejection_s <= 0:
            raise ValueError(f"--ejection-s must be more than 0, not {args.ejection_s}")
    except ValueError as exc:
        print(f"router: {exc}", file=sys.stderr)
        return 2
    server = Server(args.listen, max_workers=args.max_workers, metrics_port=args.metrics_port,
                        health_listen=args.health_listen, tls=tls,
                    require_client_cert=False, name="router")  # the front door, as decode's
    try:
        router = Router(split_targets(args.decode), policy=args.policy,
                        load_weight=args.load_weight, tls=tls, index_bytes=args.index_mib << 20,
                        max_migrations=args.max_migrations, first_token_timeout_s=args.first_token_timeout_s,
                        eject_after=args.eject_after, ejection_s=args.ejection_s,
                        metadata=[("authorization", f"Bearer {token}")] if token else [])
    except ValueError as exc:
        print(f"router: {exc}", file=sys.stderr)
        return 2
    router.on_route = RouterMetrics(server.registry, router).observe
    router.start()
    server.add(decode_pb2_grpc.add_DecodeServicer_to_server, RouterServicer(router), DECODE_SERVICE)
    return serve(server, "router", on_stop=[router.close])


if __name__ == "__main__":
    sys.exit(main())
