"""`python -m decode_service --model DIR --kvstore ADDR --prefill ADDR [--listen HOST:PORT] [--metrics-port N]`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from decode_service.metrics import DecodeMetrics
from decode_service.server import SERVICE_NAME, DecodeServicer
from decode_service.service import DecodeService
from engine.engine import Engine
from engine.model import load_model
from kvstore import KVStoreClient
from kvstore.serving import Server, run_until_signal
from prefill_service.client import PrefillClient
from protos.kvserve.v1 import decode_pb2_grpc


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvserve decode",
        description="The decode service, kvserve's front door: streams generated tokens for a prompt.",
    )
    ap.add_argument("--model", required=True, help="local Hugging Face model folder (the one prefill serves)")
    ap.add_argument("--kvstore", default="127.0.0.1:50053", help="KV store address (default %(default)s)")
    ap.add_argument("--prefill", default="127.0.0.1:50052", help="prefill service address (default %(default)s)")
    ap.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT to serve on; port 0 picks one "
                    "and prints LISTENING <port> (default %(default)s)")
    ap.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block; every service of a "
                    "deployment must agree (default %(default)s)")
    ap.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default %(default)s)")
    ap.add_argument("--max-batch-size", type=int, default=32,
                    help="most sequences decoded together; more wait (default %(default)s)")
    ap.add_argument("--prefill-timeout-s", type=float, default=60.0,
                    help="deadline of the Prefill call (default %(default)s)")
    ap.add_argument("--store-timeout-s", type=float, default=2.0,
                    help="deadline of each KV store call; past it decode recomputes (default %(default)s)")
    ap.add_argument("--max-workers", type=int, default=64, help="gRPC worker threads, i.e. concurrent "
                    "streams (default %(default)s)")
    ap.add_argument("--log-level", default="INFO")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s decode %(levelname)s %(name)s: %(message)s")
    try:
        engine = Engine(load_model(args.model, device=args.device), block_size=args.block_size)
    except (OSError, ValueError) as exc:  # missing folder, refused model (UnsupportedModelError)
        print(f"decode: cannot serve {args.model}: {exc}", file=sys.stderr)
        return 2
    store = KVStoreClient(args.kvstore, timeout_s=args.store_timeout_s)
    prefill = PrefillClient(args.prefill, timeout_s=args.prefill_timeout_s)
    server = Server(args.listen, max_workers=args.max_workers, metrics_port=args.metrics_port)
    service = DecodeService(engine, store, prefill, DecodeMetrics(server.registry),
                            max_batch_size=args.max_batch_size)
    server.add(decode_pb2_grpc.add_DecodeServicer_to_server, DecodeServicer(service), SERVICE_NAME)
    service.start()
    try:
        port = server.start()
    except OSError as exc:
        print(f"decode: {exc}", file=sys.stderr)
        return 2
    print(f"LISTENING {port}", flush=True)
    run_until_signal(server, before_stop=[service.stop], on_stop=[store.close])
    return 0


if __name__ == "__main__":
    sys.exit(main())
