"""Helpers for the kvstore tests: keys, payloads, stores of tiny capacity, a fake clock, servers, a block
corrupted on disk."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import lmdb

from kvstore.block_format import HEADER_BYTES
from kvstore.config import StoreConfig
from kvstore.disk_tier import DiskTier
from kvstore.host_tier import ArenaHostTier, MemoryHostTier
from kvstore.record_key import RecordKey
from kvstore.server import StoreServer
from kvstore.store import BlockStore
from kvstore.tier import TierStorage

REPO = Path(__file__).resolve().parents[1]


def key(i: int | str) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def payload(i: int | str, size: int = 100) -> bytes:
    seed = hashlib.sha256(f"payload-{i}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_store(
    *,
    host: int = 400,
    disk: int = 0,
    device: int = 0,
    tmp: Path | None = None,
    shm: bool = False,
    clock: FakeClock | None = None,
    record_key: RecordKey | None = None,
    **limits: Any,
) -> BlockStore:
    """A store of tiny capacities (bytes); tiers with capacity 0 are left out; `record_key` for its disk tier.
    `limits`: BlockStore's per-caller limits (max_block_bytes, max_lease_ttl_s, max_pinned_bytes_per_caller)."""
    tiers: list[tuple[TierStorage, int]] = []
    if device:
        from kvstore.device_tier import DeviceArenaTier

        assert tmp is not None
        tiers.append((DeviceArenaTier(tmp / "device", device, "cpu"), device))
    if host:
        assert not shm or tmp is not None
        tiers.append((ArenaHostTier(tmp / "shm", host) if shm and tmp else MemoryHostTier(), host))
    if disk:
        assert tmp is not None
        tiers.append((DiskTier(tmp / "lmdb", disk, record_key=record_key), disk))
    return BlockStore(tiers, clock=clock or FakeClock(), **limits)


@contextmanager
def running_server(tmp: Path, **config: object) -> Iterator[StoreServer]:
    """An in-process store server on a free port; shm dir under tmp unless shm=False."""
    defaults: dict[str, object] = {"shm_root": str(tmp), "sweep_interval_s": 0.05}
    server = StoreServer(StoreConfig(**{**defaults, **config}))  # type: ignore[arg-type]
    server.start()
    try:
        yield server
    finally:
        server.stop(grace_s=0.5)


def start_process(args: list[str], *, max_file_bytes: int | None = None, stderr: IO[str] | None = None
                  ) -> tuple[subprocess.Popen[str], int]:
    """`python -m kvstore ARGS` on port 0; returns the process and its port once it serves. With
    `max_file_bytes`, no file the process writes may grow past it (RLIMIT_FSIZE: a disk that fills up,
    writes failing with EFBIG); `stderr`: where its log goes."""

    # The limit is set by the child itself, not a preexec_fn: that would run the at-fork hooks of this process's
    # gRPC threads in the child, which can hang it.
    start = ["-m", "kvstore"] if max_file_bytes is None else [
        "-c", f"import resource, runpy; resource.setrlimit(resource.RLIMIT_FSIZE, ({max_file_bytes}, {max_file_bytes})); "
        "runpy.run_module('kvstore', run_name='__main__', alter_sys=True)"]
    proc = subprocess.Popen(
        [sys.executable, *start, "--listen", "127.0.0.1:0", "--log-level", "WARNING", "--insecure", *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("LISTENING "):
            return proc, int(line.split()[1])
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"kvstore did not start (exit code {proc.poll()})")


def corrupt_lmdb_value(path: Path, k: bytes) -> None:
    """Flips one payload byte of block `k` in the LMDB database at `path` (a disk tier's, its store closed)."""
    env = lmdb.open(str(path))
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(k) or b"")
        value[HEADER_BYTES + 3] ^= 0xFF  # one payload byte
        txn.put(k, bytes(value))
    env.close()


def run_in_threads(work: Callable[[int], None], n: int = 8) -> None:
    """Runs work(0), ..., work(n - 1) on n threads at once; re-raises the first failure."""
    with ThreadPoolExecutor(n) as pool:
        for future in [pool.submit(work, t) for t in range(n)]:
            future.result()
