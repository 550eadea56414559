"""`kvserve bench multi-turn` (alias `e2e`): users chatting in rounds over a shared system prompt, in the
style of LMCache's multi-round QA benchmark, with the prefix cache and without it.

`--users` users start `1/--rate` seconds apart (0: all at once). Each sends `--rounds` questions, one
after the other: round r's prompt is the shared system prompt (`--system-tokens`), the user's own
context (`--user-tokens`, e.g. a document; 0 by default), then the user's
questions (`--question-tokens` random byte token ids each, distinct per user) and the answers so far
(`--answer-tokens` each, greedy, EOS ignored); the next question goes as soon as the answer is in.
Prompts are token ids, so lengths are exact and an answer's KV is reused by the next round.
After one untimed request (a fresh stack's one-time costs), the whole session runs twice on the same
stack: with the cache (under a fresh cache salt, so the system prompt is cold in round 1) and without
it (prefix_cache=False: every round recomputes the whole history). Per round, over the users: TTFT, inter-token latency and end-to-end latency
p50/p90/p99 as the client sees them, throughput (tokens generated in the round / the round's span,
first request sent to last result), the cache hit rate (cached / prompt tokens) and the prompt
tokens computed (prompt - cached, summed).

Baselines, one user, measured in the same run before the stack starts (`python -m bench.prefill
baselines` in a subprocess): "HF full", Hugging Face over the whole history of each round, what a
user without a serving system has; "reuse", the same model in one process over a DynamicCache of the
previous rounds (answers included), computing only the new question and the first token: the limit.

Goals printed as met or not: TTFT p50 of the last round <= 1.5x round 1 with the cache; last-round
speed-up (TTFT p50 without the cache / with it) >= 15x.

`--peer vllm` (bench.vllm_peer): a real peer in the same run, at its best. After the baselines and before the
stack starts, vLLM's CPU build (its venv from `make bench-peers`) serves the same model folder and gets the
same session, the same token ids, through the official `openai` SDK, twice, on a server of its own each time:
with vLLM's default threads (a core kept for its API server) and with every core bound to its OpenMP team; each
server is stopped before the next starts, so no two sides share the cores. Then the stack's sessions run as
above (the one without the cache too: its goal needs it). Reported: both settings' TTFT p50 over rounds 2+ and
output tok/s, and which is faster (the higher output tok/s); against the faster, per round, TTFT p50 and tok/s
of both and their ratio (kvserve / vLLM), and over rounds 2+ the TTFT p50 ratio and the whole session's output
tok/s ratio, with goals: with >= 2 users, TTFT p50 over rounds 2+ <= 1.0x vLLM's and output tok/s >= 1.0x
vLLM's; with 1 user, TTFT p50 over rounds 2+ <= 0.7x. Without the venv, or when vLLM does not start with
either setting, the peer is reported as skipped, and why (a setting that did not start, as that setting's).
"""

from __future__ import annotations

import argparse
import random
import sys
import uuid
from dataclasses import asdict
from typing import Any

from client.client import Client
from kvserve.bench import routing as bench_routing
from kvserve.bench import vllm_peer
from kvserve.bench.isolated import ttft_baselines
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
    ratio,
)
from kvserve.bench.sessions import Settings, random_tokens, run_session, throughput_tok_s
from kvserve.bench.streams import StreamTrace, timed_stream
from kvserve.bench.target import add_record_key_flag, add_target_flags, ensure_model, open_target

GROWTH_GOAL = 1.5  # TTFT(last round) <= 1.5x TTFT(round 1), with the cache
SPEEDUP_GOAL = 15.0  # last round: >= 15x faster than without the cache


def round_row(round_: int, cached: list[StreamTrace], uncached: list[StreamTrace], base: dict[str, Any]
              ) -> dict[str, Any]:
    prompt = sum(t.usage.prompt_tokens for t in cached)
    hits = sum(t.usage.cached_tokens for t in cached)
    generated = sum(len(t.token_ids) for t in cached)
    span = max(t.end for t in cached) - min(t.sent for t in cached)
    return {
        "round": round_,
        "prompt_tokens": prompt / len(cached),
        "hit_rate": hits / prompt,
        "computed_tokens": prompt - hits,
        "computed_tokens_no_cache": sum(t.usage.prompt_tokens - t.usage.cached_tokens for t in uncached),
        **percentiles_s("ttft_cache", [t.ttft_s for t in cached]),
        **percentiles_s("ttft_no_cache", [t.ttft_s for t in uncached]),
        **percentiles_s("itl", [gap for t in cached for gap in t.itl_s()]),
        **percentiles_s("e2e", [t.e2e_s for t in cached]),
        "throughput_tok_s": generated / span,
        "hf_full_ttft_s": base["full_median_s"],
        "reuse_ttft_s": base["reuse_median_s"],
        "same_answers": all(a.token_ids == b.token_ids for a, b in zip(cached, uncached, strict=True)),
    }


TTFT_COLUMNS = [
    Column("round", "round", "{:d}"),
    Column("prompt_tokens", "prompt", "{:.0f}"),
    Column("hit_rate", "hit %", "{:.0f}", 100),
    Column("computed_tokens", "computed", "{:d}"),
    Column("ttft_cache_p50_s", "TTFT p50", "{:.1f}", 1000),
    Column("ttft_cache_p90_s", "p90", "{:.1f}", 1000),
    Column("ttft_cache_p99_s", "p99", "{:.1f}", 1000),
    Column("ttft_no_cache_p50_s", "no cache p50", "{:.1f}", 1000),
    Column("ttft_no_cache_p90_s", "p90", "{:.1f}", 1000),
    Column("ttft_no_cache_p99_s", "p99", "{:.1f}", 1000),
    Column("hf_full_ttft_s", "HF full", "{:.1f}", 1000),
    Column("reuse_ttft_s", "reuse", "{:.1f}", 1000),
]
STREAM_COLUMNS = [
    Column("round", "round", "{:d}"),
    Column("itl_p50_s", "ITL p50", "{:.1f}", 1000),
    Column("itl_p90_s", "p90", "{:.1f}", 1000),
    Column("itl_p99_s", "p99", "{:.1f}", 1000),
    Column("e2e_p50_s", "e2e p50", "{:.1f}", 1000),
    Column("e2e_p90_s", "p90", "{:.1f}", 1000),
    Column("e2e_p99_s", "p99", "{:.1f}", 1000),
    Column("throughput_tok_s", "tok/s", "{:.1f}"),
]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    first, second, last = rows[0], rows[min(1, len(rows) - 1)], rows[-1]
    growth = last["ttft_cache_p50_s"] / first["ttft_cache_p50_s"]
    speedup = last["ttft_no_cache_p50_s"] / last["ttft_cache_p50_s"]
    return {
        "summary": {"ttft_growth": growth, "last_round_speedup": speedup,
                    # from round 2, the first with a cached history of its own (round 1 computes the system
                    # prompt cold for the first user)
                    "ttft_growth_from_round_2": last["ttft_cache_p50_s"] / second["ttft_cache_p50_s"],
                    "last_round_vs_reuse": ratio(last["ttft_cache_p50_s"], last["reuse_ttft_s"]),
                    "last_round_hf_full_vs_stack": ratio(last["hf_full_ttft_s"], last["ttft_cache_p50_s"])},
        "goals": {"ttft_growth": goal(growth, GROWTH_GOAL, at_most=True),
                  "last_round_speedup": goal(speedup, SPEEDUP_GOAL, at_most=False)},
    }


def run(args: argparse.Namespace, s: Settings) -> dict[str, Any]:
    peer_steps = vllm_peer.progress_steps([s]) if args.peer else 0
    with Progress(3 + 2 * s.users * s.rounds + peer_steps, "multi-turn: baselines", quiet=args.quiet) as progress:
        turns = [(0, s.prompt_tokens(1))] + [(s.prompt_tokens(r - 1) + s.answer_tokens, s.question_tokens)
                                             for r in range(2, s.rounds + 1)]
        base = ttft_baselines(args.model, turns, args.baseline_repeats)
        # The peer before the stack starts, its server stopped before: one side on the cores at a time.
        peer, peer_runs = vllm_peer.run_vllm(args, [s], progress) if args.peer else (None, {})
        progress.step(label="multi-turn: starting the stack")
        with open_target(args, "multi-turn") as target, Client(target.addr, timeout_s=600) as client:
            progress.step(label="multi-turn: warm-up")
            # Untimed: a fresh stack's one-time costs (first forwards, memory) on a prompt of the longest length.
            timed_stream(client, token_ids=random_tokens(random.Random(-1), s.prompt_tokens(s.rounds)),
                         max_tokens=s.answer_tokens, ignore_eos=True, cache_salt=f"warm-up-{uuid.uuid4().hex}")
            progress.step(label="multi-turn: with the cache")
            cached = run_session(client, s, progress, cache_salt=f"multi-turn-{uuid.uuid4().hex}")
            progress.phase("multi-turn: without the cache")
            uncached = run_session(client, s, progress, prefix_cache=False)
    rows = [round_row(r + 1, [u[r] for u in cached], [u[r] for u in uncached], base["turns"][r])
            for r in range(s.rounds)]
    report = {"bench": "multi-turn", "settings": {**asdict(s), "model": str(args.model), "record_key": args.record_key,
                                                  "baseline_repeats": args.baseline_repeats, "peer": args.peer},
              "baseline_torch_threads": base["torch_threads"], "rounds": rows,
              "throughput_tok_s": throughput_tok_s(cached), **summarize(rows)}
    if peer is not None:
        if peer_runs:
            versus = vllm_peer.compare(rows, cached, peer_runs[peer["faster"]][0])
            peer.update(comparison=versus["rounds"], rounds=versus["vllm_rounds"], summary=versus["summary"])
            report["goals"].update(versus["goals"])
        report["peer"] = peer
    return report


def report_text(r: dict[str, Any]) -> str:
    s, rows, goals = r["settings"], r["rounds"], r["goals"]
    rate = f"{s['rate']:g} users/s" if s["rate"] else "all at once"
    lines = [
        f"multi-turn: {s['users']} users ({rate}), {s['rounds']} rounds, system prompt {s['system_tokens']} tokens, "
        f"each user's own context {s['user_tokens']}, "
        f"questions {s['question_tokens']}, answers {s['answer_tokens']} tokens; model {s['model']}"
        + (f"; store record key {s['record_key']}" if s.get("record_key") else ""),
        "TTFT in ms as the client sees it, with the cache and without it (same run, same stack); "
        "HF full / reuse: one user, no serving system, whole history / over a cache of the history",
        format_table(TTFT_COLUMNS, rows),
        "",
        "with the cache: inter-token and end-to-end latency in ms, throughput of each round",
        format_table(STREAM_COLUMNS, rows),
        f"throughput over the session: {r['throughput_tok_s']:.1f} tok/s; TTFT p50 with the cache from round "
        f"{min(2, len(rows))} (the first with a cached history) to round {rows[-1]['round']}: "
        f"x{r['summary']['ttft_growth_from_round_2']:.2f}",
        goal_line(f"TTFT p50 round {rows[-1]['round']} <= {GROWTH_GOAL:g}x round 1 with the cache",
                  goals["ttft_growth"]),
        goal_line(f"round {rows[-1]['round']} speed-up >= {SPEEDUP_GOAL:g}x against no cache",
                  goals["last_round_speedup"]),
    ]
    differ = [row["round"] for row in rows if not row["same_answers"]]
    if differ:
        lines.append(f"! answers with and without the cache differed in round(s) {', '.join(map(str, differ))}")
    if "peer" in r:
        lines += ["", vllm_peer.comparison_text(r["peer"], goals)]
    return "\n".join(lines)


def panels(r: dict[str, Any]) -> list[Panel]:
    rows = r["rounds"]
    x = [row["round"] for row in rows]

    def ms(key: str) -> list[float | None]:
        return [None if row[key] is None else row[key] * 1000 for row in rows]

    return [line_panel("TTFT p50 per round", "round", "ms", [
        Line("stack, with the cache", x, ms("ttft_cache_p50_s")),
        Line("stack, without the cache", x, ms("ttft_no_cache_p50_s")),
        Line("HF over the whole history (1 user)", x, ms("hf_full_ttft_s"), dashed=True),
        Line("in-process cache reuse (1 user)", x, ms("reuse_ttft_s"), dashed=True),
    ]), *(vllm_peer.comparison_panels(r["peer"]) if "peer" in r else [])]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvserve bench multi-turn", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_flags(ap)
    add_record_key_flag(ap)
    ap.add_argument("--users", type=int, default=4, help="(default %(default)s)")
    ap.add_argument("--rounds", type=int, default=10, help="questions per user (default %(default)s)")
    ap.add_argument("--system-tokens", type=int, default=1024, help="shared system prompt (default %(default)s)")
    ap.add_argument("--user-tokens", type=int, default=0,
                    help="each user's own context after the system prompt, e.g. a document the questions are "
                         "about (LMCache's user history; default %(default)s)")
    ap.add_argument("--question-tokens", type=int, default=64, help="(default %(default)s)")
    ap.add_argument("--answer-tokens", type=int, default=32, help="max tokens of each answer (default %(default)s)")
    ap.add_argument("--rate", type=float, default=1.0,
                    help="users start 1/RATE seconds apart; 0 starts them all at once (default %(default)s)")
    ap.add_argument("--baseline-repeats", type=int, default=3, help="median of this many (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="of the random prompts (default %(default)s)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="more than 1: that many nodes behind `kvserve router`, the session run once per --policy "
                         "and once straight to one node, instead of with and without the cache (default %(default)s)")
    ap.add_argument("--policy", action="append", choices=["prefix", "least-loaded", "round-robin"],
                    help="with --replicas: a router policy to measure; repeatable (default: prefix and round-robin)")
    vllm_peer.add_peer_flags(ap)
    add_output_flags(ap)
    args = ap.parse_args(argv)
    if (min(args.users, args.rounds, args.question_tokens, args.answer_tokens, args.replicas) < 1 or args.rate < 0
            or args.user_tokens < 0):
        ap.error("--users, --rounds, --question-tokens, --answer-tokens and --replicas must be >= 1, "
                 "--rate and --user-tokens >= 0")
    vllm_peer.check_peer_args(ap, args)
    if args.peer and args.replicas > 1:
        ap.error("--peer compares one stack with the peer: no --replicas")
    if args.record_key and (args.addr or args.replicas > 1):
        ap.error("--record-key sets the one stack started here: not with --addr or --replicas")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.model = ensure_model(args.model)
    s = Settings(args.users, args.rounds, args.system_tokens, args.question_tokens, args.answer_tokens, args.rate,
                 args.seed, args.user_tokens)
    if args.replicas > 1:
        report = bench_routing.run(args, s)
        emit(args, report, bench_routing.report_text(report), lambda: bench_routing.panels(report),
             "kvserve bench multi-turn, routed")
        return 0
    report = run(args, s)
    emit(args, report, report_text(report), lambda: panels(report), "kvserve bench multi-turn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
