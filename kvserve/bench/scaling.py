"""`kvserve bench scaling`: how output tokens per second grow from one user chatting to `--users` users, on
one stack in one run, and on vLLM's CPU build in the same run with --peer vllm.

The session is multi-turn's (bench.sessions): users chatting in rounds over a shared system prompt, each round
the history and a new question, greedy answers with EOS ignored; by default the chat workload of BENCHMARKS.md's
goals (4 rounds, a 2,300-token system prompt, 200-token questions, 32-token answers, 16 users starting 4 a
second).
Each repeat runs three sessions one after the other on the same stack: one user, `--users` users, one user
again. Each session has token ids of its own (its own seed) and a fresh cache salt, so that each starts cold,
as a run of its own would. A session's throughput is its tokens generated over its span (first request sent
to last result); the repeat's ratio is the `--users` session's throughput over the mean of the two one-user
sessions around it, so that the machine's drift over the repeat weighs on both sides (the one-user figure
moved from 23.5 to 30.4 tok/s between sessions minutes apart on the same stack).

Goal printed as met or not: the ratio >= 3x in every repeat. With --peer vllm, vLLM serves the same
sessions (the same token ids, in the same order) before the stack starts, its server stopped before, twice
(bench.vllm_peer): with its default threads and with every core bound, each on a server of its own; each
setting's ratios are reported beside kvserve's, and which is faster (the higher output tok/s over its
sessions), the one the panels show.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import uuid
from typing import Any

from client.client import Client
from kvserve.bench import vllm_peer
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
)
from kvserve.bench.sessions import Settings, random_tokens, run_session, throughput_tok_s
from kvserve.bench.streams import StreamTrace, timed_stream
from kvserve.bench.target import add_record_key_flag, add_target_flags, ensure_model, open_target

GOAL = 3.0  # throughput of --users users >= 3x one user's, in every repeat


def tok_s(traces: list[list[StreamTrace]]) -> float:
    """A session's throughput_tok_s, which has a span: every request is sent before its result comes."""
    value = throughput_tok_s(traces)
    assert value is not None, "a session that took no time"
    return value


def sessions(args: argparse.Namespace) -> list[Settings]:
    """Each repeat's sessions in order, one user, --users, one user, each with a seed of its own."""
    plan = []
    for i in range(args.repeats * 3):
        users = args.users if i % 3 == 1 else 1
        plan.append(Settings(users, args.rounds, args.system_tokens, args.question_tokens, args.answer_tokens,
                             args.rate if users > 1 else 0.0, args.seed + i))
    return plan


def repeats(figures: list[float]) -> list[dict[str, float]]:
    """Per repeat, from the sessions' tok/s in order: the one-user figures, the many-user one, the ratio."""
    rows = []
    for i in range(0, len(figures), 3):
        before, many, after = figures[i : i + 3]
        one = (before + after) / 2
        rows.append({"one_user_before_tok_s": before, "one_user_after_tok_s": after, "users_tok_s": many,
                     "ratio": many / one})
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = sessions(args)
    requests = sum(s.users * s.rounds for s in plan)
    peer_steps = vllm_peer.progress_steps(plan) if args.peer else 0
    with Progress(2 + requests + peer_steps, "scaling", quiet=args.quiet) as progress:
        # The peer before the stack starts, its server stopped before: one side on the cores at a time.
        peer, peer_runs = vllm_peer.run_vllm(args, plan, progress, "scaling") if args.peer else (None, {})
        progress.step(label="scaling: starting the stack")
        with open_target(args, "scaling") as target, Client(target.addr, timeout_s=600) as client:
            progress.step(label="scaling: warm-up")
            longest = max(s.prompt_tokens(s.rounds) for s in plan)
            # Untimed: a fresh stack's one-time costs (first forwards, memory) on a prompt of the longest length.
            timed_stream(client, token_ids=random_tokens(random.Random(-1), longest), max_tokens=args.answer_tokens,
                         ignore_eos=True, cache_salt=f"warm-up-{uuid.uuid4().hex}")
            progress.phase("scaling: sessions")
            figures = [tok_s(run_session(client, s, progress, cache_salt=f"scaling-{uuid.uuid4().hex}"))
                       for s in plan]
    rows = repeats(figures)
    worst = min(r["ratio"] for r in rows)
    report: dict[str, Any] = {
        "bench": "scaling",
        "settings": {"users": args.users, "rate": args.rate, "rounds": args.rounds,
                     "system_tokens": args.system_tokens, "question_tokens": args.question_tokens,
                     "answer_tokens": args.answer_tokens, "repeats": args.repeats, "seed": args.seed,
                     "model": str(args.model), "peer": args.peer},
        "repeats": rows,
        "goals": {"ratio_every_repeat": goal(worst, GOAL, at_most=False)},
    }
    if peer is not None:
        for setting in peer["threads"]:
            if setting["name"] in peer_runs:
                setting["repeats"] = repeats([tok_s(traces) for traces in peer_runs[setting["name"]]])
        report["peer"] = peer
    return report


COLUMNS = [
    Column("repeat", "repeat", "{:d}"),
    Column("one_user_before_tok_s", "1 user tok/s", "{:.1f}"),
    Column("users_tok_s", "N users tok/s", "{:.1f}"),
    Column("one_user_after_tok_s", "1 user again", "{:.1f}"),
    Column("ratio", "N / 1", "{:.2f}"),
]


def table(rows: list[dict[str, float]]) -> str:
    return format_table(COLUMNS, [{"repeat": i + 1, **r} for i, r in enumerate(rows)])


def report_text(r: dict[str, Any]) -> str:
    s = r["settings"]
    lines = [
        f"scaling: 1 user, then {s['users']} users ({s['rate']:g} users/s), then 1 user, per repeat on one stack; "
        f"{s['rounds']} rounds, system prompt {s['system_tokens']} tokens, questions {s['question_tokens']}, "
        f"answers {s['answer_tokens']}; model {s['model']}",
        "output tok/s of each session (tokens generated / first request sent to last result); N / 1: the "
        f"{s['users']}-user figure over the mean of the 1-user figures around it",
        "kvserve:",
        table(r["repeats"]),
    ]
    peer = r.get("peer")
    if peer is not None:
        if peer.get("skipped"):
            lines.append(f"vLLM: skipped: {peer['skipped']}")
        else:
            lines += vllm_peer.peer_lines(peer, "the same sessions", s["rounds"])
            for setting in peer["threads"]:
                if "repeats" in setting:
                    lines += [f"vLLM, {setting['name']}:", table(setting["repeats"])]
    lines.append(goal_line(f"kvserve's {s['users']} users >= {GOAL:g}x 1 user's tok/s in every repeat (the worst)",
                           r["goals"]["ratio_every_repeat"]))
    return "\n".join(lines)


def panels(r: dict[str, Any]) -> list[Panel]:
    sides = {"kvserve": r["repeats"]}
    best = vllm_peer.faster(r["peer"]) if r.get("peer") else None
    if best is not None:
        sides[f"vLLM {best['name']}"] = best["repeats"]
    ratios = {name: [x["ratio"] for x in rows] for name, rows in sides.items()}
    users = r["settings"]["users"]
    rates = {f"{name}, {label}": [(x[a] + x[b]) / 2 if b else x[a] for x in rows]
             for name, rows in sides.items()
             for label, a, b in (("1 user", "one_user_before_tok_s", "one_user_after_tok_s"),
                                 (f"{users} users", "users_tok_s", None))}
    return [bar_panel("output tok/s (median, min-max of repeats)", "tok/s",
                      {k: statistics.median(v) for k, v in rates.items()},
                      spread={k: (min(v), max(v)) for k, v in rates.items()}),
            bar_panel(f"{r['settings']['users']} users' tok/s over 1 user's (median, min-max of repeats)", "x",
                      {name: statistics.median(v) for name, v in ratios.items()},
                      spread={name: (min(v), max(v)) for name, v in ratios.items()}, ref=(f"goal {GOAL:g}x", GOAL))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvserve bench scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_flags(ap)
    add_record_key_flag(ap)
    ap.add_argument("--users", type=int, default=16, help="users of the many-user session (default %(default)s)")
    ap.add_argument("--rate", type=float, default=4.0,
                    help="they start 1/RATE seconds apart; 0 starts them all at once (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=4, help="questions per user (default %(default)s)")
    ap.add_argument("--system-tokens", type=int, default=2300, help="shared system prompt (default %(default)s)")
    ap.add_argument("--question-tokens", type=int, default=200, help="(default %(default)s)")
    ap.add_argument("--answer-tokens", type=int, default=32, help="max tokens of each answer (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="of 1 user, N users, 1 user (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="of the first session's random prompts (default %(default)s)")
    vllm_peer.add_peer_flags(ap)
    add_output_flags(ap)
    args = ap.parse_args(argv)
    if min(args.users, args.rounds, args.question_tokens, args.answer_tokens, args.repeats) < 1 or args.rate < 0:
        ap.error("--users, --rounds, --question-tokens, --answer-tokens and --repeats must be >= 1, --rate >= 0")
    vllm_peer.check_peer_args(ap, args)
    if args.record_key and args.addr:
        ap.error("--record-key sets the stack started here: not with --addr")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.model = ensure_model(args.model)
    report = run(args)
    emit(args, report, report_text(report), lambda: panels(report), "kvserve bench scaling")
    return 0


if __name__ == "__main__":
    sys.exit(main())
