"""`kvserve bench store --device cuda|cpu`: hand-off through the store's device arena against a plain
device-to-device copy of the same bytes, in one run.

Starts `python -m kvstore --device DEV` as a process of its own; this process plays prefill and decode
(each opens the arena the same way). Measured, best of --repeat, on --total bytes of blocks of
--block-size (default: a 16-token block of the ~0.6B benchmark model, 768 KiB):
- copy: torch's copy_ of all the bytes between two buffers on the device (the baseline), and the same
  blocks moved into pool slots by one index_copy per batch (what a one-copy hand-off does at best);
- put: `put_tensors` of pool slots with their headers, a batch of --batch blocks a call (prefill saving);
- get: `get_tensors` of those blocks and one index_copy of them into pool slots (decode taking the
  prefix prefill left: the hand-off).
Goal: get >= 0.5 x copy (each block is copied twice, once out of the arena and once into the pool,
and checksummed once, where a copy moves it once).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from kvserve.rpc.cli import parse_size
from kvstore.client import KVStoreClient
from protos.block_hash import BlockHash

GOAL = 0.5
HEADER_BYTES = 64
LABELS = {
    "index_copy": "copy of the same blocks into pool slots",
    "put": "put_tensors (pool -> arena)",
    "get": "get_tensors + into pool slots (arena -> pool)",
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_of(repeat: int, device: torch.device, fn: Callable[[], object]) -> float:
    fn()  # warm: caches, kernels, weights of the checksum
    best = float("inf")
    for _ in range(repeat):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def start_store(device: str, capacity: int) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "--listen", "127.0.0.1:0", "--insecure", "--device", device, "--device-capacity",
         str(capacity), "--host-capacity", str(64 << 20), "--log-level", "WARNING"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("LISTENING "):
        proc.kill()
        raise RuntimeError(f"kvstore --device {device} did not start (is the device there?)")
    return proc, f"127.0.0.1:{line.split()[1]}"


def run(device_name: str, total: int, block: int, batch: int, repeat: int) -> dict[str, Any]:
    device = torch.device(device_name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # as the arena's tensors say it
    count = max(1, total // block)
    nbytes = count * block
    pool = torch.randint(0, 256, (2 * count, block), dtype=torch.uint8, device=device)  # a KV pool's slots
    words = pool.view(torch.int64)  # indexed copies move 8-byte words, as the engine's do
    src = torch.arange(count, device=device)
    dst = torch.arange(count, 2 * count, device=device)
    flat_src, flat_dst = pool[:count].view(-1), pool[count:].view(-1)
    times = {"copy": best_of(repeat, device, lambda: flat_dst.copy_(flat_src))}
    times["index_copy"] = best_of(repeat, device, lambda: [
        words.index_copy_(0, dst[i : i + batch], words.index_select(0, src[i : i + batch]))
        for i in range(0, count, batch)])  # fmt: skip
    header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    proc, addr = start_store(device_name, (repeat + 3) * (nbytes + count * 4096) + (64 << 20))
    try:
        with KVStoreClient(addr, timeout_s=120) as client:
            if client.tensor_device() is None:
                raise RuntimeError("this process could not open the store's device arena")
            rounds: list[list[BlockHash]] = []

            def put() -> None:  # new blocks each round: a put of stored blocks copies nothing
                keys = [BlockHash(hashlib.sha256(f"{len(rounds)}-{i}".encode()).digest()) for i in range(count)]
                rounds.append(keys)
                for i in range(0, count, batch):
                    n = client.put_tensors([(keys[j], (header, pool[j])) for j in range(i, min(i + batch, count))])
                    if n != min(batch, count - i):
                        raise RuntimeError("the store did not take every block")

            times["put"] = best_of(repeat, device, put)
            keys = rounds[-1]

            def get() -> None:
                for i in range(0, count, batch):
                    got = client.get_tensors(keys[i : i + batch])
                    if any(t is None or t.device != device for t in got):
                        raise RuntimeError("a block came back other than from the device arena")
                    rows = torch.stack([t[HEADER_BYTES:] for t in got])  # type: ignore[index]
                    words.index_copy_(0, dst[i : i + len(got)], rows.view(torch.int64))

            times["get"] = best_of(repeat, device, get)
            if not torch.equal(pool[count:], pool[:count]):
                raise RuntimeError("the hand-off moved other bytes than were put")
            stats = client.stats()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    gbps = {k: nbytes / t / 1e9 for k, t in times.items()}
    ratio = gbps["get"] / gbps["copy"]
    return {
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "total_bytes": nbytes, "block_bytes": block, "blocks": count, "batch": batch, "gbps": gbps,
        "ratios": {k: v / gbps["copy"] for k, v in gbps.items()}, "labels": LABELS,
        "checksum_failures": stats.checksum_failures,
        "goals": {"handoff": {"text": f"device hand-off (get) >= {GOAL} x device copy", "value": ratio,
                              "goal": GOAL, "met": ratio >= GOAL}},
    }  # fmt: skip


def report(r: dict[str, Any]) -> str:
    lines = [f"device arena bench on {r['device']}: {r['total_bytes'] / 2**20:.0f} MiB in {r['blocks']} blocks of "
             f"{r['block_bytes'] / 2**10:.0f} KiB, {r['batch']} a call, through a kvstore process",
             f"  {'device copy (copy_, best)':<46} {r['gbps']['copy']:9.1f} GB/s"]
    lines += [f"  {label:<46} {r['gbps'][k]:9.1f} GB/s   {r['ratios'][k]:5.2f} x copy" for k, label in LABELS.items()]
    lines += [f"  goal: {g['text']}: {'met' if g['met'] else 'NOT met'} (x{g['value']:.2f})" for g in r["goals"].values()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.store_device", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda or cpu (default %(default)s)")
    p.add_argument("--total", type=parse_size, default=parse_size("1GiB"), help="bytes of blocks (default 1GiB)")
    p.add_argument("--block-size", type=parse_size, default=parse_size("768KiB"),
                   help="KV bytes of a block, put with a 64-byte header (default 768KiB)")
    p.add_argument("--batch", type=int, default=64, help="blocks per call (default %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="best of N for every figure (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.block_size % 64 or args.block_size <= 0 or args.batch <= 0 or args.repeat <= 0:
        p.error("--block-size must be a positive multiple of 64 bytes; --batch and --repeat > 0")
    result = run(args.device, args.total, args.block_size, args.batch, args.repeat)
    print(json.dumps(result) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
