"""`kvserve bench shared-prefix`: N users fan out from one fresh system prompt, each with a question of
their own; how many prompt tokens the stack computes against the ideal, and what it does to TTFT.

For each N of `--users`, in two modes, "at once" (every request sent together) and "staggered"
(`--stagger-ms` apart): a fresh system prompt of `--prefix-tokens` random byte token ids under a fresh
cache salt, and N requests of that prompt followed by a distinct `--question-tokens` question each
(`--answer-tokens` generated, greedy, EOS ignored). Figures per run:

- computed tokens, from the requests' usage: the sum of prompt - cached tokens;
- computed tokens, from the engine: what prefill's engine forwarded (its batch-token histogram; an
  engine counter of computed tokens where the services have one) plus the prompt tokens decode's
  engine computed (a prompt computed there, --local-prefill-tokens, or recomputed for lack of KV),
  read off the services' Prometheus pages before and after the run; and the tokens got
  by in-flight coalescing where the services count them (none: "-");
- the ideal: the prefix once and every question once (prefix + N x question), and computed / ideal;
- TTFT p50/p90/p99 as the client sees it, and p50 over the cold TTFT of one user alone: a fresh
  prompt of the same length under a fresh salt on the same stack, measured in the same run (the
  median of `--cold-repeats`, after one untimed request).

Goals printed as met or not, at the largest N in each mode: computed <= 1.25x ideal (the engine's
count where the services expose it, else usage's); TTFT p50 <= 2x one user cold.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from client.client import Client
from kvserve.bench.report import (
    Column,
    Line,
    Panel,
    Progress,
    add_output_flags,
    emit,
    format_table,
    goal,
    goal_line,
    line_panel,
    percentiles_s,
)
from kvserve.bench.streams import StreamTrace, timed_stream
from kvserve.bench.target import Target, add_target_flags, delta, ensure_model, open_target, scrape

COMPUTED_GOAL = 1.25  # computed <= 1.25x ideal
TTFT_GOAL = 2.0  # TTFT p50 <= 2x one user cold

# Prompt tokens the engines computed, by Prometheus sample, the first the services have: prefill's engine
# counters of prompt tokens computed, else every token prefill's engine forwarded (all prompt tokens
# there); plus decode's engine's prompt tokens (prompts computed there, and recomputed ones) but the
# first token of each request prefill computed (decode computes its KV as the last prompt token), or,
# from services without that counter, what decode recomputed for lack of KV.
ENGINE_COMPUTED = ("kvserve_prefill_engine_prompt_tokens_total", "kvserve_prefill_engine_computed_tokens_total",
                   "kvserve_prefill_engine_batch_tokens_sum")
DECODE_COMPUTED = "kvserve_decode_engine_prompt_tokens_total"
DECODE_DISAGGREGATED = 'kvserve_decode_prefills_total{path="disaggregated"}'
DECODE_RECOMPUTED = "kvserve_decode_recomputed_tokens_total"
COALESCED = "coalesc"  # part of the name of any counter of tokens got by in-flight coalescing


def engine_counts(d: dict[str, float]) -> tuple[float | None, float | None]:
    """(prompt tokens computed, tokens got by in-flight coalescing) in a metrics delta; None where the
    services do not count them (or no metrics pages were read)."""
    computed = next((d[name] for name in ENGINE_COMPUTED if name in d), None)
    if computed is not None and DECODE_DISAGGREGATED in d:
        computed += d.get(DECODE_COMPUTED, 0.0) - d[DECODE_DISAGGREGATED]
    elif computed is not None:
        computed += d.get(DECODE_RECOMPUTED, 0.0)
    coalesced = [v for k, v in d.items() if COALESCED in k and k.split("{")[0].endswith("_total")]
    return computed, (sum(coalesced) if coalesced else None)


def fan_out(client: Client, prefix: list[int], questions: list[list[int]], stagger_s: float, salt: str,
            answer_tokens: int, progress: Progress) -> list[StreamTrace]:
    """Every question after the prefix, sent `stagger_s` apart (all together for 0)."""
    def one(i: int, start_at: float) -> StreamTrace:
        trace = timed_stream(client, start_at, token_ids=prefix + questions[i], max_tokens=answer_tokens,
                             ignore_eos=True, cache_salt=salt)
        progress.step()
        return trace

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(questions), thread_name_prefix="bench-user") as pool:
        return list(pool.map(one, range(len(questions)), [t0 + i * stagger_s for i in range(len(questions))]))


def cold_ttft(client: Client, rng: random.Random, tokens: int, answer_tokens: int) -> float:
    trace = timed_stream(client, token_ids=[rng.randrange(256) for _ in range(tokens)], max_tokens=answer_tokens,
                         ignore_eos=True, cache_salt=f"cold-{uuid.uuid4().hex}")
    return trace.ttft_s


def run_level(client: Client, target: Target, args: argparse.Namespace, rng: random.Random, mode: str,
              stagger_s: float, users: int, progress: Progress) -> dict[str, Any]:
    prefix = [rng.randrange(256) for _ in range(args.prefix_tokens)]
    questions = [[rng.randrange(256) for _ in range(args.question_tokens)] for _ in range(users)]
    before = scrape(target.metrics_urls)
    traces = fan_out(client, prefix, questions, stagger_s, f"shared-{uuid.uuid4().hex}", args.answer_tokens,
                     progress)
    engine, coalesced = engine_counts(delta(before, scrape(target.metrics_urls)))
    usage = sum(t.usage.prompt_tokens - t.usage.cached_tokens for t in traces)
    ideal = args.prefix_tokens + users * args.question_tokens
    return {
        "mode": mode, "users": users, "stagger_s": stagger_s,
        "computed_tokens_usage": usage, "computed_tokens_engine": engine, "coalesced_tokens": coalesced,
        "ideal_tokens": ideal, "computed_vs_ideal": (usage if engine is None else engine) / ideal,
        **percentiles_s("ttft", [t.ttft_s for t in traces]),
    }


COLUMNS = [
    Column("mode", "mode", "{}", left=True),
    Column("users", "users", "{:d}"),
    Column("computed_tokens_usage", "computed (usage)", "{:d}"),
    Column("computed_tokens_engine", "computed (engine)", "{:.0f}"),
    Column("coalesced_tokens", "coalesced", "{:.0f}"),
    Column("ideal_tokens", "ideal", "{:d}"),
    Column("computed_vs_ideal", "x ideal", "{:.2f}"),
    Column("ttft_p50_s", "TTFT p50 ms", "{:.1f}", 1000),
    Column("ttft_p90_s", "p90", "{:.1f}", 1000),
    Column("ttft_p99_s", "p99", "{:.1f}", 1000),
    Column("ttft_p50_vs_cold", "p50 x cold", "{:.2f}"),
]


def run(args: argparse.Namespace, levels: list[int]) -> dict[str, Any]:
    modes = [("at once", 0.0), ("staggered", args.stagger_ms / 1000)]
    rng = random.Random(args.seed)
    steps = 2 + args.cold_repeats + len(modes) * sum(levels)
    with Progress(steps, "shared-prefix: starting the stack", quiet=args.quiet) as progress, \
            open_target(args, "shared-prefix") as target, Client(target.addr, timeout_s=600) as client:
        progress.step(label="shared-prefix: one user cold")
        cold_ttft(client, rng, args.prefix_tokens + args.question_tokens, 2)  # untimed: one-time costs
        progress.step()
        cold = []
        for _ in range(args.cold_repeats):
            cold.append(cold_ttft(client, rng, args.prefix_tokens + args.question_tokens, args.answer_tokens))
            progress.step()
        rows = []
        for mode, stagger_s in modes:
            progress.phase(f"shared-prefix: {mode}")
            rows += [run_level(client, target, args, rng, mode, stagger_s, n, progress) for n in levels]
        metrics = bool(target.metrics_urls)
    cold_s = statistics.median(cold)
    for row in rows:
        row["ttft_p50_vs_cold"] = row["ttft_p50_s"] / cold_s
    goals = {}
    for mode, _ in modes:
        top = max((r for r in rows if r["mode"] == mode), key=lambda r: r["users"])
        key = mode.replace(" ", "_")
        goals[f"computed_{key}"] = goal(top["computed_vs_ideal"], COMPUTED_GOAL, at_most=True)
        goals[f"ttft_{key}"] = goal(top["ttft_p50_vs_cold"], TTFT_GOAL, at_most=True)
    settings = {k: getattr(args, k) for k in ("prefix_tokens", "question_tokens", "answer_tokens", "stagger_ms",
                                              "cold_repeats", "seed")}
    return {"bench": "shared-prefix", "settings": {**settings, "users": levels, "model": str(args.model),
                                                   "metrics_read": metrics},
            "cold_ttft_s": cold_s, "cold_ttft_samples_s": cold, "runs": rows, "goals": goals}


def report_text(r: dict[str, Any]) -> str:
    s = r["settings"]
    lines = [
        f"shared-prefix: a fresh {s['prefix_tokens']}-token system prompt, a {s['question_tokens']}-token question "
        f"per user, {s['answer_tokens']} tokens generated; model {s['model']}",
        "computed: prompt tokens computed, from usage (prompt - cached) and from the services' engine counters"
        + ("" if s["metrics_read"] else " (not read: no metrics pages)") + "; ideal: prefix + users x question",
        format_table(COLUMNS, r["runs"]),
        f"one user alone, cold, same total length: TTFT {r['cold_ttft_s'] * 1000:.1f} ms "
        f"(median of {len(r['cold_ttft_samples_s'])})",
    ]
    for mode in dict.fromkeys(row["mode"] for row in r["runs"]):
        key, n = mode.replace(" ", "_"), max(row["users"] for row in r["runs"] if row["mode"] == mode)
        lines.append(goal_line(f"{mode}, {n} users: computed <= {COMPUTED_GOAL:g}x ideal", r["goals"][f"computed_{key}"]))
        lines.append(goal_line(f"{mode}, {n} users: TTFT p50 <= {TTFT_GOAL:g}x one user cold",
                               r["goals"][f"ttft_{key}"]))
    return "\n".join(lines)


def panels(r: dict[str, Any]) -> list[Panel]:
    modes = list(dict.fromkeys(row["mode"] for row in r["runs"]))
    rows = {m: [row for row in r["runs"] if row["mode"] == m] for m in modes}
    x = [row["users"] for row in rows[modes[0]]]

    def computed(row: dict[str, Any]) -> float:
        engine = row["computed_tokens_engine"]
        return float(row["computed_tokens_usage"] if engine is None else engine)

    return [
        line_panel("prompt tokens computed", "users", "tokens", [
            *(Line(m, [row["users"] for row in rows[m]], [computed(row) for row in rows[m]]) for m in modes),
            Line("ideal: prefix + users x question", x, [row["ideal_tokens"] for row in rows[modes[0]]], dashed=True),
        ]),
        line_panel("TTFT p50", "users", "ms", [
            *(Line(m, [row["users"] for row in rows[m]], [row["ttft_p50_s"] * 1000 for row in rows[m]]) for m in modes),
            Line("one user alone, cold", x, [r["cold_ttft_s"] * 1000] * len(x), dashed=True),
        ]),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvserve bench shared-prefix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_flags(ap)
    ap.add_argument("--users", default="1,4,8,16", help="numbers of users, comma-separated (default %(default)s)")
    ap.add_argument("--prefix-tokens", type=int, default=2048, help="shared system prompt (default %(default)s)")
    ap.add_argument("--question-tokens", type=int, default=64, help="per user (default %(default)s)")
    ap.add_argument("--answer-tokens", type=int, default=4, help="generated per user (default %(default)s)")
    ap.add_argument("--stagger-ms", type=float, default=50.0,
                    help="gap between users in the staggered mode (default %(default)s)")
    ap.add_argument("--cold-repeats", type=int, default=3, help="one user cold: median of (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="of the random prompts (default %(default)s)")
    add_output_flags(ap)
    args = ap.parse_args(argv)
    levels = sorted({int(n) for n in args.users.split(",")})
    if levels[0] < 1 or args.cold_repeats < 1 or args.question_tokens < 1 or args.answer_tokens < 1:
        ap.error("--users, --cold-repeats, --question-tokens and --answer-tokens must be >= 1")
    args.model = ensure_model(args.model)
    report = run(args, levels)
    emit(args, report, report_text(report), lambda: panels(report), "kvserve bench shared-prefix")
    return 0


if __name__ == "__main__":
    sys.exit(main())
