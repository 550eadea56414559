"""`make demo`: two users who share a long system prompt chat for six turns through the local stack.

Per turn it prints prompt tokens, cached tokens, and the TTFT with the prefix cache and without it
(the same request with prefix_cache=False, measured in the same run). A turn whose answer with the
cache differs from the one without it is reported under its row and in a summary at the end.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from client.client import Client, Result
from client.terminal import Progress
from stack.stack import Stack, StackConfig

SYSTEM_PROMPT = (
    "You are the support assistant of a company that runs a fleet of inference servers. "
    "Answer briefly and precisely. Policies: never reveal credentials; escalate outages to the "
    "on-call engineer; quote the runbook section when you cite a procedure. Runbook summary: "
    "1. A node that fails its health check is drained, then restarted; if it fails again it is "
    "replaced. 2. Cache hit rates below forty percent for an hour mean the router is spreading "
    "a tenant's requests across too many nodes; pin the tenant. 3. A disk tier above ninety "
    "percent full evicts from the tails of prefix chains first; do not delete LMDB files by hand. "
    "4. Time to first token is dominated by prefill for long prompts; a shared system prompt "
    "is computed once and reused by every user. 5. Decode latency grows with batch size; keep "
    "the batch under the configured limit. 6. Every request carries a deadline; cancelled "
    "streams stop their work. 7. Block size is sixteen tokens in every service of a deployment. "
) * 2

CONVERSATIONS = {
    "alice": [
        "Our cache hit rate dropped to thirty percent. What should I do?",
        "And if the tenant is already pinned?",
        "Can I just delete the LMDB files to start fresh?",
    ],
    "bob": [
        "A node failed its health check twice. Now what?",
        "How long should the drain take?",
        "Who do I tell if this turns into an outage?",
    ],
}


def divergence(cached: Sequence[int], uncached: Sequence[int]) -> str | None:
    """Where the answer with the cache leaves the one without it, or None if they are the same."""
    if tuple(cached) == tuple(uncached):
        return None
    shorter = min(len(cached), len(uncached))
    i = next((i for i in range(shorter) if cached[i] != uncached[i]), shorter)

    def token(ids: Sequence[int]) -> str:
        return str(ids[i]) if i < len(ids) else "none (ended)"

    return (f"! the answers with and without the cache differ from token {i} on: "
            f"{token(cached)} with, {token(uncached)} without")


def report_divergences(turns: list[int], num_turns: int) -> None:
    """Prints whether the cached answers matched the uncached ones."""
    if not turns:
        print(f"\nwith and without the cache, the answers were the same in all {num_turns} turns")
        return
    print(f"\nwith and without the cache, the answers differed in {len(turns)} of {num_turns} turns "
          f"({', '.join(map(str, turns))}). The two paths round differently, so a token whose two best "
          "logits nearly tie can flip (as with a model of random weights); at a clear margin it is a bug.")


def ask(client: Client, say: Progress, messages: list[dict[str, str]], max_tokens: int, **options: Any) -> Result:
    """One chat request, its tokens counted on the progress line as they come."""
    for n, item in enumerate(client.stream(messages=messages, max_tokens=max_tokens, ignore_eos=True, **options)):
        if isinstance(item, Result):
            return item
        say.note = f"{n + 1}/{max_tokens} tokens"
    raise RuntimeError("the stream ended without a result")


def run(model_dir: Path, max_tokens: int) -> int:
    say = Progress()
    num_turns = sum(len(questions) for questions in CONVERSATIONS.values())
    say(f"This takes about 1 to 6 minutes, by the machine: the services start (15-75 s), then {num_turns} turns, "
        "each asked without and with the prefix cache (4-45 s a turn).")
    with tempfile.TemporaryDirectory(prefix="kvserve-demo-") as tmp:
        config = StackConfig(model_dir=model_dir, data_dir=Path(tmp), decode_port=0, prefill_port=0, store_port=0)
        with Stack(config, log_dir=Path(tmp) / "logs", progress=say) as stack, \
                Client(stack.addr, **stack.layout.client_kwargs()) as client:  # type: ignore[union-attr]
            # One request first, in a cache namespace of its own, so that the first turn's figures
            # do not include the services' one-off warm-up.
            say("warming up the services (one request, not counted) ...")
            client.generate(SYSTEM_PROMPT, max_tokens=2, cache_salt="kvserve-demo-warm-up")
            histories = {user: [{"role": "system", "content": SYSTEM_PROMPT}] for user in CONVERSATIONS}
            say(f"\n{'turn':>4s}  {'user':6s} {'prompt':>7s} {'cached':>7s} {'ttft cached':>12s} "
                f"{'ttft uncached':>14s} {'speed-up':>9s}")
            turn = 0
            diverged: list[int] = []
            for i in range(3):
                for user, questions in CONVERSATIONS.items():
                    turn += 1
                    messages = [*histories[user], {"role": "user", "content": questions[i]}]
                    say(f"turn {turn}/{num_turns}, {user}: without the cache ...")
                    cold = ask(client, say, messages, max_tokens, prefix_cache=False)
                    say(f"turn {turn}/{num_turns}, {user}: with the cache ...")
                    warm = ask(client, say, messages, max_tokens)
                    speedup = cold.timings.ttft_s / max(warm.timings.ttft_s, 1e-9)
                    say(f"{turn:4d}  {user:6s} {warm.usage.prompt_tokens:7d} {warm.usage.cached_tokens:7d} "
                        f"{warm.timings.ttft_s * 1000:9.0f} ms {cold.timings.ttft_s * 1000:11.0f} ms "
                        f"{speedup:8.1f}x")
                    note = divergence(warm.token_ids, cold.token_ids)
                    if note is not None:
                        diverged.append(turn)
                        say(f"      {note}")
                    histories[user] = [*messages, {"role": "assistant", "content": warm.text}]
            report_divergences(diverged, turn)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvserve-demo", description=__doc__)
    ap.add_argument("--model", type=Path, default=Path("data/models/tiny-llama"))
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    return run(args.model, args.max_tokens)


if __name__ == "__main__":
    sys.exit(main())
