"""`python -m kvstore` / `kvserve kvstore`: run the KV store server."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from kvstore.server import StoreConfig, StoreServer
from kvstore.serving import parse_size, run_until_signal


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvserve kvstore", description="Run the tiered KV block store (gRPC kvserve.v1.KVStore).")
    p.add_argument("--listen", default="127.0.0.1:50053", help="HOST:PORT to serve on; port 0 picks one (default %(default)s)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port (0: any)")
    p.add_argument("--device", choices=["off", "cpu", "cuda"], default="off",
                   help="device tier: cuda (GPU memory), cpu (CPU tensors, for tests) or off (default)")
    p.add_argument("--device-capacity", type=parse_size, default=parse_size("1GiB"), help="device tier bytes (default 1GiB)")
    p.add_argument("--host-capacity", type=parse_size, default=parse_size("1GiB"), help="host RAM tier bytes; 0 turns it off (default 1GiB)")
    p.add_argument("--disk-capacity", type=parse_size, default=parse_size("0"),
                   help="LMDB disk tier bytes; 0 turns it off (default 0; e.g. 8GiB with --disk-path)")
    p.add_argument("--disk-path", type=Path, default=None, help="directory of the LMDB disk tier")
    p.add_argument("--shm", action=argparse.BooleanOptionalAction, default=True,
                   help="hold the host tier in /dev/shm so same-host clients read it in place (default on)")
    p.add_argument("--shm-root", default="/dev/shm", help=argparse.SUPPRESS)
    p.add_argument("--flush-timeout", type=float, default=10.0, help="seconds SIGTERM may spend flushing memory to disk")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = StoreConfig(
            host_capacity=args.host_capacity, disk_capacity=args.disk_capacity, disk_path=args.disk_path,
            device_capacity=args.device_capacity if args.device != "off" else 0, device=args.device,
            shm=args.shm, shm_root=args.shm_root, flush_timeout_s=args.flush_timeout,
        )
        server = StoreServer(config, args.listen, metrics_port=args.metrics_port)
    except ValueError as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        return 2
    try:
        port = server.start()
    except OSError as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        server.close_store()
        return 2
    print(f"LISTENING {port}", flush=True)
    run_until_signal(server.rpc, before_stop=[server.store.events.close], on_stop=[server.close_store], grace_s=2.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
