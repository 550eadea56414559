"""`kvserve bench http`: what the HTTP API adds to a request, against the same request through gRPC, in one run.

One stack (plaintext; on the real model where it has been fetched, else the tiny one, by default) with its
HTTP front (`kvserve http`) in front of decode. Each request is one chat turn over a shared system prompt
(`--system-words`, cached after the untimed warm-up) with a question of its own, `--answer-tokens` greedy
tokens, EOS ignored: the cached-turn case, where TTFT is shortest and an added hop shows most. Requests go
in pairs, the same workload once through `client.AsyncClient` (gRPC, to decode) and once through
`openai.AsyncOpenAI` (HTTP, to the front, which calls decode), one at a time by default or `--concurrency`
of each path at once; the path that goes first alternates from pair to pair, so neither gets the warmer
cache or the quieter second.

Both are measured as a client sees them: TTFT to the first chunk with text, ITL as the gaps between chunks
with text (the tiny byte-level model's partial characters have none, on both paths), end-to-end to the
last. Besides each path's percentiles over all its requests, the paired figures: the median over pairs of
HTTP's TTFT over gRPC's, and of the difference of their ITL medians, which the machine's drift from one
pair to the next moves less. The HTTP front's own CPU time (from /proc) per request and per token says
what it costs the cores it shares with the engine. Goals printed as met or not, on the paired figures:
HTTP TTFT <= 1.1x gRPC's, HTTP ITL within 1 ms of gRPC's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.bench.report import (
    Column,
    Panel,
    Progress,
    add_output_flags,
    bar_panel,
    emit,
    format_table,
    goal,
    goal_line,
    percentile,
)
from kvserve.bench.serve import words
from kvserve.bench.target import MODEL_HELP, ensure_model, local_stack

PATHS = ("grpc", "http")
TTFT_GOAL, ITL_GOAL_MS = 1.1, 1.0


@dataclass
class Trace:
    sent: float
    chunks: list[float] = field(default_factory=list)  # when each chunk with text came
    done: float = 0.0

    @property
    def ttft_s(self) -> float:
        return self.chunks[0] - self.sent

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]


def messages(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def grpc_turn(client: Any, msgs: list[dict[str, str]], n: int) -> Trace:
    from client.client import Chunk

    trace = Trace(time.perf_counter())
    async for item in client.stream(messages=msgs, max_tokens=n, ignore_eos=True):
        if isinstance(item, Chunk) and item.text:
            trace.chunks.append(time.perf_counter())
    trace.done = time.perf_counter()
    return trace


async def http_turn(client: Any, model: str, msgs: list[dict[str, str]], n: int) -> Trace:
    trace = Trace(time.perf_counter())
    stream = await client.chat.completions.create(model=model, messages=msgs, max_tokens=n, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            trace.chunks.append(time.perf_counter())
    trace.done = time.perf_counter()
    return trace


def cpu_s(pid: int) -> float:
    """The user and system CPU seconds process `pid` has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(args: argparse.Namespace, grpc_addr: str, http_url: str, model: str,
                  progress: Progress) -> dict[str, list[Trace]]:
    import openai

    from client.client import AsyncClient

    system = f"Session {random.Random().getrandbits(32):08x}. " + words(random.Random(1), args.system_words)
    rng = random.Random(2)
    traces: dict[str, list[Trace]] = {p: [] for p in PATHS}
    grpc_client = AsyncClient(grpc_addr, token="", timeout_s=600)
    http_client = openai.AsyncOpenAI(base_url=http_url, api_key="none", max_retries=0, timeout=600)
    turn: dict[str, Callable[[list[dict[str, str]]], Awaitable[Trace]]] = {
        "grpc": lambda m: grpc_turn(grpc_client, m, args.answer_tokens),
        "http": lambda m: http_turn(http_client, model, m, args.answer_tokens),
    }
    try:
        for path in PATHS:  # untimed: the system prompt into the cache, each path's connection up
            await turn[path](messages(system, "Warm up?"))
        for pair in range(args.pairs):
            order = PATHS if pair % 2 == 0 else PATHS[::-1]
            for path in order:
                batch = [messages(system, f"Q{pair}.{path}.{i}: {words(rng, args.question_words)}?")
                         for i in range(args.concurrency)]
                traces[path] += await asyncio.gather(*(turn[path](m) for m in batch))
                progress.step()
    finally:
        await grpc_client.close()
        await http_client.close()
    return traces


def figures(traces: Sequence[Trace]) -> dict[str, Any]:
    ttft = [t.ttft_s for t in traces if t.chunks]
    itl = [g for t in traces for g in t.itl_s]
    e2e = [t.done - t.sent for t in traces]
    return {"requests": len(traces), "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
            "itl_p50_s": percentile(itl, 50), "itl_p90_s": percentile(itl, 90), "e2e_p50_s": percentile(e2e, 50)}


def paired(traces: dict[str, list[Trace]], per_pair: int) -> dict[str, float]:
    """Median over pairs of HTTP's TTFT p50 / gRPC's, and of HTTP's ITL p50 - gRPC's (seconds)."""
    ttft, itl = [], []
    for i in range(0, len(traces["grpc"]), per_pair):
        g, h = traces["grpc"][i:i + per_pair], traces["http"][i:i + per_pair]
        ttft.append(percentile([t.ttft_s for t in h], 50) / percentile([t.ttft_s for t in g], 50))
        itl.append(percentile([x for t in h for x in t.itl_s], 50) - percentile([x for t in g for x in t.itl_s], 50))
    return {"ttft_ratio": percentile(ttft, 50), "itl_diff_s": percentile(itl, 50)}


def report_text(r: dict[str, Any]) -> str:
    rows = [{"path": p, **r["paths"][p]} for p in PATHS]
    table = format_table([Column("path", "path", "{}", left=True), Column("requests", "requests", "{}"),
                          Column("ttft_p50_s", "TTFT p50 ms", scale=1000), Column("ttft_p90_s", "p90", scale=1000),
                          Column("itl_p50_s", "ITL p50 ms", "{:.2f}", scale=1000),
                          Column("itl_p90_s", "p90", "{:.2f}", scale=1000),
                          Column("e2e_p50_s", "e2e p50 ms", scale=1000)], rows)
    g, c = r["goals"], r["http_cpu"]
    return "\n".join([
        f"kvserve bench http: {r['settings']['pairs']} pairs x {r['settings']['concurrency']} at once, "
        f"{r['settings']['answer_tokens']} tokens each, a cached {r['settings']['system_words']}-word system prompt; "
        f"model {r['settings']['model']}",
        table,
        f"the HTTP front's CPU: {c['per_request_s'] * 1000:.1f} ms per request, {c['per_token_s'] * 1e6:.0f} us "
        f"per token",
        goal_line(f"HTTP TTFT <= {TTFT_GOAL}x gRPC's (paired)", g["ttft"]),
        f"goal: HTTP ITL within {ITL_GOAL_MS:g} ms of gRPC's (paired): {'met' if g['itl']['met'] else 'NOT met'} "
        f"({g['itl']['value'] * 1000:+.2f} ms)",
    ])


def panels(r: dict[str, Any]) -> list[Panel]:
    paths = r["paths"]
    return [bar_panel("TTFT p50", "ms", {p: paths[p]["ttft_p50_s"] * 1000 for p in PATHS}),
            bar_panel("ITL p50", "ms", {p: paths[p]["itl_p50_s"] * 1000 for p in PATHS})]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvserve bench http", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=None, help=MODEL_HELP)
    ap.add_argument("--pairs", type=int, default=30, help="requests per path, in alternating order (default %(default)s)")
    ap.add_argument("--concurrency", type=int, default=1, help="requests of one path at once (default %(default)s)")
    ap.add_argument("--system-words", type=int, default=400, help="shared system prompt (default %(default)s)")
    ap.add_argument("--question-words", type=int, default=30, help="(default %(default)s)")
    ap.add_argument("--answer-tokens", type=int, default=32, help="(default %(default)s)")
    add_output_flags(ap)
    args = ap.parse_args(argv)
    for name in ("pairs", "concurrency", "answer_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.model_dir = ensure_model(args.model_dir)
    with Progress(2 * args.pairs + 1, "http: starting the stack", quiet=args.quiet) as progress, \
            tempfile.TemporaryDirectory(prefix="kvserve-bench-http-") as tmp, \
            local_stack(args.model_dir, Path(tmp), "stack", None, http=True) as stack:
        progress.step(label="http: measuring")
        front = stack.service("http").process.pid
        cpu_before = cpu_s(front)
        traces = asyncio.run(measure(args, stack.addr, f"{stack.service('http').url}/v1", args.model_dir.name,
                                     progress))
        front_cpu = cpu_s(front) - cpu_before
    paths = {p: figures(traces[p]) for p in PATHS}
    pairs = paired(traces, args.concurrency)
    http_requests = len(traces["http"]) + 1  # and its warm-up
    report = {
        "settings": {**{k: getattr(args, k) for k in ("pairs", "concurrency", "system_words", "question_words",
                                                      "answer_tokens")}, "model": str(args.model_dir)},
        "paths": paths,
        "paired": pairs,
        "http_cpu": {"seconds": front_cpu, "per_request_s": front_cpu / http_requests,
                     "per_token_s": front_cpu / (http_requests * args.answer_tokens)},
        "goals": {"ttft": goal(pairs["ttft_ratio"], TTFT_GOAL, at_most=True),
                  "itl": goal(pairs["itl_diff_s"], ITL_GOAL_MS / 1000, at_most=True)},
    }
    emit(args, report, report_text(report), lambda: panels(report), "HTTP against gRPC")
    return 0


if __name__ == "__main__":
    sys.exit(main())
