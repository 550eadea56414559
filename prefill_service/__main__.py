"""`python -m prefill_service --model DIR --kvstore ADDR [--listen HOST:PORT] [--metrics-port N]`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from engine.engine import Engine
from engine.model import load_model
from kvstore import KVStoreClient
from kvstore.serving import Server, run_until_signal
from prefill_service.metrics import PrefillMetrics
from prefill_service.server import SERVICE_NAME, PrefillServicer
from prefill_service.service import DEFAULT_LEASE_TTL_S, PrefillService
from protos.kvserve.v1 import prefill_pb2_grpc


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvserve prefill",
        description="The prefill service: computes the prompt KV the store lacks and leaves it there for decode.",
    )
    ap.add_argument("--model", required=True, help="local Hugging Face model folder")
    ap.add_argument("--kvstore", default="127.0.0.1:50053", help="KV store address (default %(default)s)")
    ap.add_argument("--listen", default="127.0.0.1:50052", help="HOST:PORT to serve on; port 0 picks one "
                    "and prints LISTENING <port> (default %(default)s)")
    ap.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block; every service of a "
                    "deployment must agree (default %(default)s)")
    ap.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default %(default)s)")
    ap.add_argument("--store-timeout-s", type=float, default=2.0,
                    help="deadline of each KV store call; past it the request recomputes (default %(default)s)")
    ap.add_argument("--lease-ttl-s", type=float, default=DEFAULT_LEASE_TTL_S,
                    help="how long the prompt's blocks stay pinned for decode (default %(default)s)")
    ap.add_argument("--max-workers", type=int, default=16, help="gRPC worker threads (default %(default)s)")
    ap.add_argument("--log-level", default="INFO")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s prefill %(levelname)s %(name)s: %(message)s")
    try:
        engine = Engine(load_model(args.model, device=args.device), block_size=args.block_size)
    except (OSError, ValueError) as exc:  # missing folder, refused model (UnsupportedModelError)
        print(f"prefill: cannot serve {args.model}: {exc}", file=sys.stderr)
        return 2
    store = KVStoreClient(args.kvstore, timeout_s=args.store_timeout_s)
    server = Server(args.listen, max_workers=args.max_workers, metrics_port=args.metrics_port)
    service = PrefillService(engine, store, PrefillMetrics(server.registry), lease_ttl_s=args.lease_ttl_s)
    server.add(prefill_pb2_grpc.add_PrefillServicer_to_server, PrefillServicer(service), SERVICE_NAME)
    try:
        port = server.start()
    except OSError as exc:
        print(f"prefill: {exc}", file=sys.stderr)
        return 2
    print(f"LISTENING {port}", flush=True)
    run_until_signal(server, on_stop=[store.close])
    return 0


if __name__ == "__main__":
    sys.exit(main())
