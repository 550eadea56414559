"""``kvserve bench hash``: cost of prefix hashing per token, against one sha256 over the same bytes."""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from struct import pack

from kvserve.engine.hashing import Namespace, prefix_hashes


@dataclass(frozen=True, slots=True)
class HashBenchResult:
    tokens: int
    block_size: int
    prefix_hashes_ns_per_token: float
    baseline_ns_per_token: float  # a single sha256 over all the packed tokens: the floor
    ratio: float


def _best_ns(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter_ns()
        fn()
        best = min(best, time.perf_counter_ns() - start)
    return best


def run(tokens: int, block_size: int, repeat: int) -> HashBenchResult:
    rng = random.Random(0)
    token_ids = [rng.randrange(150_000) for _ in range(tokens)]
    root = Namespace("0" * 64, "bfloat16", block_size).root()
    ours = _best_ns(lambda: prefix_hashes(token_ids, block_size, root), repeat) / tokens
    baseline = _best_ns(lambda: hashlib.sha256(pack(f"<{tokens}I", *token_ids)).digest(), repeat) / tokens
    return HashBenchResult(tokens, block_size, ours, baseline, ours / baseline)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve bench hash", description=__doc__)
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5, help="best of this many runs")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    result = run(args.tokens, args.block_size, args.repeat)
    if args.json:
        print(json.dumps(asdict(result)))
    else:
        print(
            f"prefix_hashes: {result.prefix_hashes_ns_per_token:.1f} ns/token "
            f"({args.tokens} tokens, block size {args.block_size}); "
            f"one sha256 over the same bytes: {result.baseline_ns_per_token:.1f} ns/token "
            f"(x{result.ratio:.2f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
