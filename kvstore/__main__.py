"""`python -m kvstore` / `kvserve kvstore`: run the KV store server."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvstore.config import MAX_BLOCK_BYTES, StoreConfig
from kvstore.leases import MAX_TTL_S
from kvstore.server import StoreServer
from serving.cli import (
    add_server_flags,
    configure_logging,
    env_epilog,
    exit_with_parent,
    parse_args,
    parse_size,
    serve,
    tls_from_args,
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(epilog=env_epilog("kvstore"), prog="kvserve kvstore", description="Run the tiered KV block store (gRPC kvserve.v1.KVStore).")
    add_server_flags(p, listen="127.0.0.1:50053")
    p.add_argument("--device", choices=["off", "cpu", "cuda"], default="off",
                   help="device tier: cuda (GPU memory), cpu (CPU tensors, for tests) or off (default)")
    p.add_argument("--device-capacity", type=parse_size, default=parse_size("1GiB"), help="device tier bytes (default 1GiB)")
    p.add_argument("--host-capacity", type=parse_size, default=parse_size("1GiB"), help="host RAM tier bytes; 0 turns it off (default 1GiB)")
    p.add_argument("--disk-capacity", type=parse_size, default=parse_size("0"),
                   help="LMDB disk tier bytes; 0 turns it off (default 0; e.g. 8GiB with --disk-path)")
    p.add_argument("--disk-path", type=Path, default=None, help="directory of the LMDB disk tier")
    p.add_argument("--shm", action=argparse.BooleanOptionalAction, default=True,
                   help="hold the host tier in a shared-memory arena (allocated and pre-faulted at start) that "
                        "same-host clients map, moving each block with one copy; its socket lives in /dev/shm "
                        "(default on)")
    p.add_argument("--shm-root", default="/dev/shm", help=argparse.SUPPRESS)
    p.add_argument("--flush-timeout", type=float, default=10.0, help="seconds SIGTERM may spend flushing memory to disk")
    p.add_argument("--max-block-bytes", type=parse_size, default=MAX_BLOCK_BYTES,
                   help="largest block a caller may put (never more than the largest tier); a larger one is "
                        "refused with RESOURCE_EXHAUSTED before its bytes are buffered (default 256MiB)")
    p.add_argument("--max-lease-ttl-s", type=float, default=MAX_TTL_S,
                   help="longest lease a Lookup may take; a longer one is granted this much, and the answer "
                        "says so (default %(default)s)")
    p.add_argument("--max-pinned-bytes-per-caller", type=parse_size, default=None,
                   help="bytes one caller's leases may pin at once; past it a Lookup with a lease is "
                        "RESOURCE_EXHAUSTED. Callers are told apart by certificate with mTLS, else by host "
                        "(default: a quarter of the top tier, at least 64MiB)")
    return p


def main(argv: list[str] | None = None) -> int:
    exit_with_parent()
    args = parse_args(parser(), argv, "kvstore")
    configure_logging("kvstore", args.log_level)
    tls = tls_from_args(args, "kvstore")
    try:
        config = StoreConfig(
            host_capacity=args.host_capacity, disk_capacity=args.disk_capacity, disk_path=args.disk_path,
            device_capacity=args.device_capacity if args.device != "off" else 0, device=args.device,
            shm=args.shm, shm_root=args.shm_root, flush_timeout_s=args.flush_timeout,
            max_block_bytes=args.max_block_bytes, max_lease_ttl_s=args.max_lease_ttl_s,
            max_pinned_bytes_per_caller=args.max_pinned_bytes_per_caller,
        )
        server = StoreServer(config, args.listen, metrics_port=args.metrics_port, tls=tls)
    except ValueError as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        return 2
    server.start_sweeper()
    return serve(server.rpc, "kvstore", before_stop=[server.store.events.close], on_stop=[server.close_store],
                 grace_s=2.0)


if __name__ == "__main__":
    sys.exit(main())
