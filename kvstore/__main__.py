"""`python -m kvstore` / `kvserve kvstore`: run the KV store server."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from kvserve.host.memory import memory_cap
from kvserve.host.process import exit_with_parent
from kvserve.rpc.cli import (
    add_server_flags,
    configure_logging,
    env_epilog,
    parse_args,
    parse_size,
    serve,
    tls_from_args,
)
from kvstore import record_key
from kvstore.config import MAX_BLOCK_BYTES, RemoteConfig, StoreConfig
from kvstore.leases import MAX_TTL_S
from kvstore.server import StoreServer

log = logging.getLogger("kvstore")


def default_host_capacity() -> int:
    """--host-capacity's default: kvserve.host.memory.memory_cap, a share of the memory available at start (1 GiB where it
    cannot be read)."""
    return memory_cap() or 1 << 30


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(epilog=env_epilog("kvstore"), prog="kvserve kvstore", description="Run the tiered KV block store (gRPC kvserve.v1.KVStore).")
    add_server_flags(p, listen="127.0.0.1:50053")
    _tier_flags(p)
    _limit_flags(p)
    p.add_argument("--record-key-file", type=Path, default=None, metavar="FILE",
                   help="a secret the deployment's stores share (at least 32 hex characters, read once at start; "
                        "`kvserve up` makes one): every record on disk and in the remote tier carries an HMAC-SHA256 "
                        "binding it to its block hash, so that a record moved to another key, forged, or written "
                        "by another deployment is a miss. Without it, records are bound to their keys by checksum "
                        "only (anyone who can write the disk tier or Redis can forge blocks), and --remote-url "
                        "needs --insecure")
    _remote_flags(p)
    return p


def _tier_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["off", "cpu", "cuda"], default="off",
                   help="device tier: cuda (an arena in GPU memory that same-node clients open by CUDA IPC), "
                        "cpu (the same arena in CPU memory, for tests) or off (default)")
    p.add_argument("--device-capacity", type=parse_size, default=parse_size("1GiB"), help="device tier bytes (default 1GiB)")
    p.add_argument("--host-capacity", type=parse_size, default=None,
                   help="host RAM tier bytes, taken as the tier fills; 0 turns it off (default: a fifth of the "
                        "memory available at start)")
    p.add_argument("--disk-capacity", type=parse_size, default=parse_size("0"),
                   help="LMDB disk tier bytes; 0 turns it off (default 0; e.g. 8GiB with --disk-path)")
    p.add_argument("--disk-path", type=Path, default=None, help="directory of the LMDB disk tier")
    p.add_argument("--shm", action=argparse.BooleanOptionalAction, default=True,
                   help="hold the host tier in a shared-memory arena that "
                        "same-host clients map, moving each block with one copy; its socket lives in /dev/shm "
                        "(default on)")
    p.add_argument("--shm-root", default="/dev/shm", help=argparse.SUPPRESS)
    p.add_argument("--flush-timeout", type=float, default=10.0, help="seconds SIGTERM may spend flushing memory to disk")


def _limit_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-block-bytes", type=parse_size, default=MAX_BLOCK_BYTES,
                   help="largest block a caller may put (never more than the largest tier); a larger one is "
                        "refused with RESOURCE_EXHAUSTED before its bytes are buffered (default 256MiB)")
    p.add_argument("--max-lease-ttl-s", type=float, default=MAX_TTL_S,
                   help="longest lease a Lookup may take; a longer one is granted this much, and the answer "
                        "says so (default %(default)s)")
    p.add_argument("--max-pinned-bytes-per-caller", type=parse_size, default=None,
                   help="bytes one caller's leases may pin at once; past it a Lookup with a lease is "
                        "RESOURCE_EXHAUSTED. Callers are told apart by certificate with mTLS, else by host; on "
                        "the same host's arena socket by process (default: a quarter of the top tier, at least "
                        "64MiB)")


def _remote_flags(p: argparse.ArgumentParser) -> None:
    remote = p.add_argument_group(
        "remote tier", "A Redis or Valkey shared by every node's store, under the local tiers: blocks stored here are "
        "written behind to it (never blocking a Put), and a local miss asks it once before computing. Its errors "
        "and timeouts are misses; after 3 in a row a circuit breaker stops calling it for 1 s, doubling to 30 s. "
        "Run it as a cache: maxmemory set (e.g. --maxmemory 8gb), --maxmemory-policy allkeys-lru, no persistence "
        "(--save '' --appendonly no). See docs/REMOTE-TIER.md")
    remote.add_argument("--remote-url", default=None, metavar="URL",
                        help="redis://[:PASSWORD@]HOST:PORT/DB, or rediss://... for TLS (off by default). redis-py's "
                             "query parameters work too (e.g. ?ssl_cert_reqs=none). Put a password in the "
                             "environment (KVSERVE_KVSTORE_REMOTE_URL) rather than on the command line; logs and "
                             "stats show the URL without it")
    remote.add_argument("--remote-cluster", action="store_true",
                        help="the URL names one node of a Redis Cluster (keys spread over its masters)")
    remote.add_argument("--remote-ttl-s", type=float, default=86400.0,
                        help="expiry of each block written (default %(default)g)")
    remote.add_argument("--remote-timeout-s", type=float, default=0.1,
                        help="timeout of each call (connect, read, write): past it the call is a miss "
                             "(default %(default)g)")
    remote.add_argument("--remote-key-prefix", default="kvserve",
                        help="keys are PREFIX:v<record version>:<block hash hex> (default %(default)s)")
    remote.add_argument("--remote-queue-bytes", type=parse_size, default=parse_size("256MiB"),
                        help="blocks waiting to be written; past it the oldest are dropped and counted "
                             "(default 256MiB)")
    remote.add_argument("--remote-tls-ca", default=None, metavar="PEM",
                        help="with rediss://: the CA that signed Redis's certificate (default: the system's)")
    remote.add_argument("--remote-tls-cert", default=None, metavar="PEM",
                        help="with rediss://: a client certificate, for a Redis that requires one (tls-auth-clients)")
    remote.add_argument("--remote-tls-key", default=None, metavar="PEM", help="the client certificate's key")


def remote_config(args: argparse.Namespace) -> RemoteConfig | None:
    if args.remote_url is None:
        if args.remote_cluster or args.remote_tls_ca or args.remote_tls_cert or args.remote_tls_key:
            raise ValueError("--remote-cluster and --remote-tls-* need --remote-url")
        return None
    return RemoteConfig(args.remote_url, cluster=args.remote_cluster, ttl_s=args.remote_ttl_s,
                        timeout_s=args.remote_timeout_s, key_prefix=args.remote_key_prefix,
                        queue_bytes=args.remote_queue_bytes, tls_ca=args.remote_tls_ca,
                        tls_cert=args.remote_tls_cert, tls_key=args.remote_tls_key)


def load_record_key(args: argparse.Namespace) -> record_key.RecordKey | None:
    """The record key --record-key-file names; None (with a warning) without one. ValueError for a file that
    cannot be used, and for a remote tier without a key unless --insecure."""
    if args.record_key_file is not None:
        return record_key.load(args.record_key_file)
    if args.remote_url is not None and not getattr(args, "insecure", False):
        raise ValueError("--remote-url needs --record-key-file (whoever can write to Redis could otherwise serve any "
                         "block to this store), or --insecure to accept that")
    log.warning("no --record-key-file: store records are bound to their keys by checksum only; whoever can write "
                "the disk tier%s can forge blocks", " or the remote tier" if args.remote_url else "")
    return None


def main(argv: list[str] | None = None) -> int:
    exit_with_parent()
    args = parse_args(parser(), argv, "kvstore")
    configure_logging("kvstore", args.log_level)
    try:
        key = load_record_key(args)
    except ValueError as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        return 2
    tls = tls_from_args(args, "kvstore")
    try:
        config = StoreConfig(
            host_capacity=default_host_capacity() if args.host_capacity is None else args.host_capacity,
            disk_capacity=args.disk_capacity, disk_path=args.disk_path,
            device_capacity=args.device_capacity if args.device != "off" else 0, device=args.device,
            shm=args.shm, shm_root=args.shm_root, flush_timeout_s=args.flush_timeout,
            max_block_bytes=args.max_block_bytes, max_lease_ttl_s=args.max_lease_ttl_s,
            max_pinned_bytes_per_caller=args.max_pinned_bytes_per_caller, remote=remote_config(args),
            record_key=key,
        )
        server = StoreServer(config, args.listen, metrics_port=args.metrics_port, tls=tls,
                             health_listen=args.health_listen)
    except ValueError as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        return 2
    server.start_sweeper()
    return serve(server.rpc, "kvstore", before_stop=[server.store.events.close], on_stop=[server.close_store],
                 grace_s=2.0, callbacks_s=args.flush_timeout)


if __name__ == "__main__":
    sys.exit(main())
