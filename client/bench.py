"""`kvserve bench e2e`: per-turn TTFT of a growing chat, with the prefix cache against without it.

Both are measured in the same run on the same stack; the ratio is what to read, not the seconds.
Without the cache every turn recomputes the whole conversation, so its TTFT grows with the
conversation; with it, each turn computes only the new message and TTFT stays about flat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

from client.client import Client
from client.stack import Stack, StackConfig

QUESTION = "Tell me more about block {n} of the runbook and how it relates to the previous answer. "


def run_turns(client: Client, turns: int, max_tokens: int, system_chars: int, repeats: int) -> list[dict]:
    """Runs the same chat `repeats` times, each under its own cache salt (so each is a chat of its
    own, cold at turn 1), and reports per turn the median TTFT with the cache and without it, the
    prompt tokens each computed, and whether every answer was the same with and without it."""
    messages = [{"role": "system", "content": ("Shared system prompt. " * system_chars)[:system_chars]}]
    salts = [f"bench-{uuid.uuid4().hex}" for _ in range(repeats)]
    rows = []
    for n in range(1, turns + 1):
        messages.append({"role": "user", "content": QUESTION.format(n=n) * 3})
        cached = [client.chat(messages, max_tokens=max_tokens, ignore_eos=True, cache_salt=s) for s in salts]
        uncached = [client.chat(messages, max_tokens=max_tokens, ignore_eos=True, prefix_cache=False)
                    for _ in salts]
        result, baseline = cached[0], uncached[0]
        rows.append({
            "turn": n,
            "prompt_tokens": result.usage.prompt_tokens,
            "cached_tokens": result.usage.cached_tokens,
            "computed_tokens_cached": result.usage.prompt_tokens - result.usage.cached_tokens,
            "computed_tokens_uncached": baseline.usage.prompt_tokens - baseline.usage.cached_tokens,
            "same_tokens": all(r.token_ids == baseline.token_ids for r in [*cached, *uncached]),
            "ttft_cached_s": statistics.median(r.timings.ttft_s for r in cached),
            "ttft_uncached_s": statistics.median(r.timings.ttft_s for r in uncached),
        })
        messages.append({"role": "assistant", "content": result.text})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvserve bench e2e", description=__doc__)
    ap.add_argument("--addr", default=None, help="use a running stack's front door (default: start one)")
    ap.add_argument("--model", type=Path, default=Path("data/models/tiny-llama"))
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--system-chars", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=3, help="median over this many separate chats (cache salts)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    def measure(addr: str) -> list[dict]:
        with Client(addr) as client:
            return run_turns(client, args.turns, args.max_tokens, args.system_chars, args.repeats)

    if args.addr:
        rows = measure(args.addr)
    else:
        with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
            config = StackConfig(model_dir=args.model, data_dir=Path(tmp), decode_port=0, prefill_port=0,
                                 store_port=0)
            with Stack(config, log_dir=Path(tmp) / "logs") as stack:
                rows = measure(stack.addr)
    # Turn 1 is cold either way; growth is read from turn 2, the first turn with a cached history.
    first, last = rows[min(1, len(rows) - 1)], rows[-1]
    summary = {
        "turns": rows,
        "uncached_growth": last["ttft_uncached_s"] / first["ttft_uncached_s"],
        "cached_growth": last["ttft_cached_s"] / first["ttft_cached_s"],
        "last_turn_speedup": last["ttft_uncached_s"] / last["ttft_cached_s"],
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{'turn':>4s} {'prompt':>7s} {'cached':>7s} {'ttft cached':>12s} {'ttft uncached':>14s} {'ratio':>6s}")
    for r in rows:
        print(f"{r['turn']:4d} {r['prompt_tokens']:7d} {r['cached_tokens']:7d} {r['ttft_cached_s'] * 1000:9.1f} ms "
              f"{r['ttft_uncached_s'] * 1000:11.1f} ms {r['ttft_uncached_s'] / r['ttft_cached_s']:5.1f}x")
    print(f"\nTTFT growth from turn {first['turn']} to turn {last['turn']}: uncached {summary['uncached_growth']:.2f}x, "
          f"cached {summary['cached_growth']:.2f}x; last-turn speed-up {summary['last_turn_speedup']:.1f}x")
    differ = [r["turn"] for r in rows if not r["same_tokens"]]
    if differ:
        print(f"cached and uncached answers differed at turn(s) {', '.join(map(str, differ))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
