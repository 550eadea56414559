"""`kvserve bench multi-turn --replicas N`: the multi-turn session through `kvserve router` in front of N
nodes (each its own store, prefill and decode; no shared tier, so a turn finds its history only on the
node that served the turn before; each node's services get an equal share of this machine's cores as
torch threads, as if each were a machine of its own), once per `--policy`, and once straight to one node (a single
replica: the hit rate routing should keep). Each session runs under a fresh cache salt, so every one
starts cold. Per policy: TTFT, inter-token and end-to-end latency p50/p90/p99, throughput, hit rate and
computed prompt tokens, and the replicas' share of the requests.

Goals printed as met or not: TTFT p50 with prefix routing <= 0.7x round robin's; its hit rate >= 0.9x a
single replica's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from client.client import Client
from kvserve.bench.report import (
    Column,
    Line,
    Panel,
    Progress,
    format_table,
    goal,
    goal_line,
    line_panel,
    percentiles_s,
)
from kvserve.bench.sessions import Settings, random_tokens, run_session
from kvserve.bench.streams import StreamTrace, timed_stream
from kvserve.bench.target import delta, free_port, local_stack, scrape
from kvserve.stack.stack import Stack, start_service, stop_service

TTFT_GOAL = 0.7  # TTFT p50, prefix routing / round robin
HIT_GOAL = 0.9  # hit rate, prefix routing / one replica


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """os.environ with `values` set (the processes started inside inherit them), as it was afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def nodes_and_routers(args: argparse.Namespace, policies: list[str]) -> Iterator[tuple[list[Stack], dict[str, str],
                                                                                      dict[str, str]]]:
    """N local stacks and a router per policy in front of their decode services: (nodes, router address by
    policy, router metrics URL by policy)."""
    threads = str(max(1, (os.cpu_count() or 1) // args.replicas))
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-routing-") as tmp, contextlib.ExitStack() as stack, \
            environ(OMP_NUM_THREADS=threads):
        logs = args.log_dir or Path(tmp)
        nodes = [stack.enter_context(local_stack(args.model, Path(tmp), f"node-{i}", args.log_dir))
                 for i in range(args.replicas)]
        decode = ",".join(n.addr for n in nodes)
        addrs, metrics = {}, {}
        for policy in policies:
            port = free_port()
            router = start_service(f"router-{policy}", "kvserve.router", [
                "--listen", "127.0.0.1:0", "--insecure", "--decode", decode, "--policy", policy, "--metrics-port",
                str(port)],
                logs / f"router-{policy}.log")
            stack.callback(stop_service, router)
            addrs[policy], metrics[policy] = router.addr, f"http://127.0.0.1:{port}/metrics"
        yield nodes, addrs, metrics


def session_row(name: str, traces: list[list[StreamTrace]], routed: dict[str, float]) -> dict[str, Any]:
    flat = [t for user in traces for t in user]
    later = [t for user in traces for t in user[1:]]  # rounds with a history of their own
    prompt = sum(t.usage.prompt_tokens for t in flat)
    hits = sum(t.usage.cached_tokens for t in flat)
    span = max(t.end for t in flat) - min(t.sent for t in flat)
    shares = sorted((v for k, v in routed.items() if k.startswith("kvserve_router_requests_total")), reverse=True)
    return {
        "session": name,
        "hit_rate": hits / prompt,
        "computed_tokens": prompt - hits,
        **percentiles_s("ttft", [t.ttft_s for t in flat]),
        **percentiles_s("ttft_later_rounds", [t.ttft_s for t in later]),
        **percentiles_s("itl", [gap for t in flat for gap in t.itl_s()]),
        **percentiles_s("e2e", [t.e2e_s for t in flat]),
        "throughput_tok_s": sum(len(t.token_ids) for t in flat) / span,
        "requests_per_replica": shares,
        "ttft_p50_by_round_s": [percentiles_s("r", [u[r].ttft_s for u in traces])["r_p50_s"]
                                for r in range(len(traces[0]))],
        "token_ids": [[list(t.token_ids) for t in user] for user in traces],
    }


def run(args: argparse.Namespace, s: Settings) -> dict[str, Any]:
    policies = list(dict.fromkeys(args.policy or ["prefix", "round-robin"]))
    with Progress(2 + (1 + len(policies)) * s.users * s.rounds, "multi-turn: starting the nodes",
                  quiet=args.quiet) as progress, nodes_and_routers(args, policies) as (nodes, routers, metrics):
        progress.step(label="multi-turn: warm-up")
        warm = random_tokens(random.Random(-1), s.prompt_tokens(s.rounds))
        for addr in [n.addr for n in nodes] + list(routers.values()):
            with Client(addr, timeout_s=600) as c:
                timed_stream(c, token_ids=warm, max_tokens=s.answer_tokens, ignore_eos=True,
                             cache_salt=f"warm-up-{uuid.uuid4().hex}")
        rows = []
        sessions = [("one replica", nodes[0].addr, None)] + [(p, routers[p], metrics[p]) for p in policies]
        for name, addr, url in sessions:
            progress.phase(f"multi-turn: {name}")
            before = scrape([url]) if url else {}
            with Client(addr, timeout_s=600) as client:
                traces = run_session(client, s, progress, cache_salt=f"routing-{uuid.uuid4().hex}")
            rows.append(session_row(name, traces, delta(before, scrape([url])) if url else {}))
    by = {row["session"]: row for row in rows}
    same = all(row["token_ids"] == rows[0]["token_ids"] for row in rows)
    for row in rows:
        del row["token_ids"]
    report: dict[str, Any] = {"bench": "multi-turn", "settings": {**asdict(s), "model": str(args.model),
                                                                  "replicas": args.replicas, "policies": policies},
                              "sessions": rows, "same_answers": same, "goals": {}}
    if "prefix" in by and "round-robin" in by:
        report["goals"]["ttft_p50_prefix_vs_round_robin"] = goal(
            by["prefix"]["ttft_p50_s"] / by["round-robin"]["ttft_p50_s"], TTFT_GOAL, at_most=True)
    if "prefix" in by:
        report["goals"]["hit_rate_prefix_vs_one_replica"] = goal(
            by["prefix"]["hit_rate"] / by["one replica"]["hit_rate"], HIT_GOAL, at_most=False)
    return report


COLUMNS = [
    Column("session", "session", "{}", left=True),
    Column("hit_rate", "hit %", "{:.0f}", 100),
    Column("computed_tokens", "computed", "{:d}"),
    Column("ttft_p50_s", "TTFT p50", "{:.1f}", 1000),
    Column("ttft_p90_s", "p90", "{:.1f}", 1000),
    Column("ttft_p99_s", "p99", "{:.1f}", 1000),
    Column("ttft_later_rounds_p50_s", "rounds 2+ p50", "{:.1f}", 1000),
    Column("itl_p50_s", "ITL p50", "{:.1f}", 1000),
    Column("itl_p99_s", "p99", "{:.1f}", 1000),
    Column("e2e_p50_s", "e2e p50", "{:.1f}", 1000),
    Column("e2e_p99_s", "p99", "{:.1f}", 1000),
    Column("throughput_tok_s", "tok/s", "{:.1f}"),
    Column("requests_per_replica", "requests per replica", "{}"),
]


def report_text(r: dict[str, Any]) -> str:
    s, goals = r["settings"], r["goals"]
    rate = f"{s['rate']:g} users/s" if s["rate"] else "all at once"
    lines = [
        f"multi-turn through the router: {s['replicas']} nodes (store, prefill, decode each; no shared tier), "
        f"{s['users']} users ({rate}), {s['rounds']} rounds, system prompt {s['system_tokens']} tokens, each user's "
        f"own context {s['user_tokens']}, questions "
        f"{s['question_tokens']}, answers {s['answer_tokens']} tokens; model {s['model']}",
        "latencies in ms as the client sees them; one replica: the same session straight to one node",
        format_table(COLUMNS, r["sessions"]),
    ]
    if "ttft_p50_prefix_vs_round_robin" in goals:
        lines.append(goal_line(f"TTFT p50 with prefix routing <= {TTFT_GOAL:g}x round robin's",
                               goals["ttft_p50_prefix_vs_round_robin"]))
    if "hit_rate_prefix_vs_one_replica" in goals:
        lines.append(goal_line(f"hit rate with prefix routing >= {HIT_GOAL:g}x one replica's",
                               goals["hit_rate_prefix_vs_one_replica"]))
    if not r["same_answers"]:
        lines.append("! the sessions' answers differed")
    return "\n".join(lines)


def panels(r: dict[str, Any]) -> list[Panel]:
    lines = []
    for row in r["sessions"]:
        y = [None if v is None else v * 1000 for v in row["ttft_p50_by_round_s"]]
        lines.append(Line(row["session"], list(range(1, len(y) + 1)), y, dashed=row["session"] == "one replica"))
    return [line_panel("TTFT p50 per round", "round", "ms", lines)]
