"""`kvserve bench store`: put/get throughput of a real store server over loopback, against memcpy.

Starts `python -m kvstore` as a separate process (host tier in its shared-memory arena), then
measures, in one run: memcpy of warm buffers (the baseline), put and get through the same-host
arena path, put and get through plain gRPC bytes (the remote path), and lookups per second.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from kvserve.rpc.cli import parse_size
from kvstore.client import KVStoreClient
from protos.block_hash import BlockHash


def tune_malloc_for_blocks() -> bool:
    """Keeps freed block-sized allocations in glibc's heap instead of returning them to the OS.

    By default every payload over 128 KiB is a fresh mmap whose pages fault in on first write,
    which caps `get()` far below memory bandwidth; the benchmark measures `get()` with and without
    it (`get_into` needs no such tuning). Returns False where it does not apply.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 64 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))


@dataclass(frozen=True, slots=True)
class BenchResult:
    total_bytes: int
    block_bytes: int
    blocks: int
    memcpy_gbps: float
    block_memcpy_gbps: float  # the same blocks copied one by one: the bound of any one-copy transfer
    gbps: dict[str, float]  # put_shm, put_grpc, get_shm, get_grpc, get_*_tuned, get_into_shm
    lookups_per_s: float
    lookup_hashes: int

    def ratio(self, name: str) -> float:
        return self.gbps[name] / self.memcpy_gbps


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def memcpy_gbps(nbytes: int, repeat: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)  # touch both
    return nbytes / best_of(repeat, lambda: np.copyto(dst, src)) / 1e9


def block_memcpy_gbps(count: int, block: int, repeat: int) -> float:
    """Copying `count` blocks of `block` bytes one by one between two large buffers, with the copy a
    same-host client does (a memoryview slice assignment): a whole-buffer memcpy streams past the
    caches (non-temporal stores), a block-sized copy cannot."""
    src = np.ones(count * block, dtype=np.uint8).data
    dst = np.zeros(count * block, dtype=np.uint8).data

    def copy() -> None:
        for i in range(0, count * block, block):
            dst[i : i + block] = src[i : i + block]

    copy()
    return count * block / best_of(repeat, copy) / 1e9


def start_server(host_capacity: int) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "--listen", "127.0.0.1:0", "--insecure", "--host-capacity", str(host_capacity), "--log-level", "WARNING"],
        stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("LISTENING "):
        proc.kill()
        raise RuntimeError("kvstore server did not start")
    return proc, f"127.0.0.1:{line.split()[1]}"


def make_blocks(tag: str, count: int, size: int) -> list[tuple[BlockHash, bytes]]:
    base = np.random.default_rng(0).integers(0, 256, size + count, dtype=np.uint8).tobytes()
    return [(BlockHash(hashlib.sha256(f"{tag}-{i}".encode()).digest()), base[i : i + size]) for i in range(count)]


def consume(get: Callable[[Sequence[BlockHash]], list[bytes | None]], parts: list[Sequence[BlockHash]]) -> int:
    """Gets batch after batch, dropping each before the next, as a consumer decoding blocks would."""
    n = 0
    for part in parts:
        n += sum(len(p) for p in get(part) if p is not None)
    return n


def batches(items: Sequence[BlockHash], n: int) -> list[Sequence[BlockHash]]:
    return [items[i : i + n] for i in range(0, len(items), n)]


def run(total: int, block: int, batch: int, repeat: int) -> BenchResult:
    count = max(1, total // block)
    nbytes = count * block
    memcpy = memcpy_gbps(nbytes, repeat)
    block_memcpy = block_memcpy_gbps(count, block, repeat)
    proc, addr = start_server(host_capacity=(2 * repeat + 1) * nbytes + (64 << 20))
    gbps: dict[str, float] = {}
    try:
        with KVStoreClient(addr, timeout_s=120) as local, KVStoreClient(addr, timeout_s=120, use_shm=False) as remote:
            if local.shm_dir() is None:
                raise RuntimeError("same-host path unavailable (server not on this host or shm off)")
            clients = {"shm": local, "grpc": remote}
            keys: dict[str, list[BlockHash]] = {}
            for name, client in clients.items():
                best = float("inf")
                for round_ in range(repeat):  # new blocks each round: a put of stored blocks does nothing
                    blocks = make_blocks(f"{name}-{round_}", count, block)
                    start = time.perf_counter()
                    for i in range(0, count, batch):
                        client.put(blocks[i : i + batch])
                    best = min(best, time.perf_counter() - start)
                gbps[f"put_{name}"] = nbytes / best / 1e9
                keys[name] = [k for k, _ in blocks]
                got = [p for part in batches(keys[name], batch) for p in client.get(part)]
                assert got == [p for _, p in blocks], "bench read back wrong bytes"
                del got, blocks
            for tuned in (False, True):
                if tuned:
                    tune_malloc_for_blocks()
                for name, client in clients.items():
                    parts = batches(keys[name], batch)
                    t = best_of(repeat, lambda c=client, p=parts: consume(c.get, p))  # type: ignore[misc]
                    gbps[f"get_{name}{'_tuned' if tuned else ''}"] = nbytes / t / 1e9
            bufs = [memoryview(bytearray(block)) for _ in range(batch)]
            parts = batches(keys["shm"], batch)
            gbps["get_into_shm"] = nbytes / best_of(repeat, lambda: [local.get_into(p, bufs) for p in parts]) / 1e9
            chain = keys["shm"][:16]
            n_lookups = 0
            start = time.perf_counter()
            while time.perf_counter() - start < 1.0:
                local.lookup(chain)
                n_lookups += 1
            lookups = n_lookups / (time.perf_counter() - start)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return BenchResult(nbytes, block, count, memcpy, block_memcpy, gbps, lookups, len(chain))


ROWS = {
    "put_shm": "put, same host (shm)",
    "get_shm": "get, same host (shm) -> bytes",
    "get_shm_tuned": "  same, malloc tuned",
    "get_into_shm": "get_into, same host (warm buffers)",
    "put_grpc": "put, gRPC bytes",
    "get_grpc": "get, gRPC bytes",
    "get_grpc_tuned": "  same, malloc tuned",
}


def report(r: BenchResult) -> str:
    lines = [
        f"kvstore bench: {r.total_bytes / 2**20:.0f} MiB in {r.blocks} blocks of {r.block_bytes / 2**10:.0f} KiB "
        "through a kvstore server process over loopback (host tier in a shared-memory arena)",
        f"  {'memcpy (warm buffers, best)':<36} {r.memcpy_gbps:7.2f} GB/s",
        f"  {'memcpy of the same blocks, one by one':<36} {r.block_memcpy_gbps:7.2f} GB/s   "
        f"{r.block_memcpy_gbps / r.memcpy_gbps:5.2f} x memcpy",
    ]
    lines += [f"  {label:<36} {r.gbps[k]:7.2f} GB/s   {r.ratio(k):5.2f} x memcpy" for k, label in ROWS.items()]
    lines.append(f"  {'lookups (' + str(r.lookup_hashes) + ' hashes each)':<36} {r.lookups_per_s:7.0f} /s")
    lines += [f"  goal: {g['text']}: {'met' if g['met'] else 'NOT met'} ({g['value']:.2f}; "
              f"{g['vs_block_memcpy']:.2f} x memcpy of the same blocks)" for g in goals(r).values()]
    return "\n".join(lines)


def goals(r: BenchResult) -> dict[str, dict[str, object]]:
    """The goals against memcpy of the whole buffer, and (for reference) against the same blocks copied one
    by one."""
    get, put = r.ratio("get_into_shm"), r.ratio("put_shm")
    by_block = r.memcpy_gbps / r.block_memcpy_gbps
    return {
        "same_host_get": {"text": "same-host get (get_into) >= 0.7 x memcpy", "value": get, "goal": 0.7,
                          "met": get >= 0.7, "vs_block_memcpy": get * by_block},
        "same_host_put": {"text": "same-host put >= 0.5 x memcpy", "value": put, "goal": 0.5, "met": put >= 0.5,
                          "vs_block_memcpy": put * by_block},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvserve bench store", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--total", type=parse_size, default=parse_size("256MiB"), help="bytes of blocks (default 256MiB)")
    p.add_argument("--block-size", type=parse_size, default=parse_size("256KiB"), help="block size (default 256KiB)")
    p.add_argument("--batch", type=int, default=64, help="blocks per put/get call (default 64)")
    p.add_argument("--repeat", type=int, default=3, help="best of N for every figure (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    result = run(args.total, args.block_size, args.batch, args.repeat)
    if args.json:
        ratios = {f"{k}_ratio": round(result.ratio(k), 3) for k in result.gbps}
        print(json.dumps({**asdict(result), **ratios, "labels": ROWS, "goals": goals(result)}))
    else:
        print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
