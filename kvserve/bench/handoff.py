"""`kvserve bench handoff`: TTFT of a prompt whose first `--prefix-tokens` tokens are in the KV store and
in no engine's pool, plus `--new-tokens` new ones, through the stack, against in-process reuse.

How the prefix gets into the store and nowhere else: a second prefill service, the "writer" (another
replica over the same store, started by this command), computes it through its Prefill RPC, which puts
its blocks into the store, and a Lookup checks that the store holds every one. The stack's own prefill
and decode never saw that prompt, so their pools cannot hold it (prefill's pool hits are read off its
metrics and reported): the measured request's prefill fetches the prefix from the store, computes the
new tokens and samples the first token; decode then fetches every prompt block for the second token.
The stack started here runs decode with --local-prefill-tokens 0, so that this path is what is
measured: by default decode would compute so few new tokens itself (docs/DESIGN.md, "Local prefill").
Each measurement has a fresh prefix under a fresh cache salt; `--repeats` of them, after an untimed one.

Baseline, measured in turn with the stack's requests (`python -m bench.prefill baselines --serve`, a
subprocess that stays up beside the stack and computes while the stack is idle): the same model in one
process over a DynamicCache of a prefix of the same length, computing the new tokens and the first token
("in-process reuse"), then one decode step. One round of it just before each of the stack's requests,
after an untimed one, so that the machine's drift over the run (its neighbours come and go within a
minute) weighs on both sides alike; the ratio of each pair is reported beside the ratio of the p50s.

Figures: TTFT p50, min and max of both, and the gap from the first token to the second (the stack's
decode fetching the prompt's blocks, against one decode step); the server's own TTFT and prefill time
(from the results' timings); the mean of every `*_seconds` histogram of prefill and decode over the
measured requests, and the prompt tokens prefill took from its pool (none expected) and the store.
Goal printed as met or not: stack TTFT p50 <= 1.15x in-process p50. With --addr, give the stack's
--kvstore too (the writer is started here against it) and --metrics pages to read. `--device` and
`--dtype` apply to the services started here (the writer's too) and to the baseline; `--record-key on|off`
to the store started here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from client.client import Client, build_request
from kvserve.bench.isolated import BaselineProcess
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
from kvserve.bench.streams import timed_stream
from kvserve.bench.target import (
    Target,
    add_device_flags,
    add_record_key_flag,
    add_target_flags,
    delta,
    device_flags,
    ensure_model,
    histogram_means,
    open_target,
    scrape,
    store_device_flags,
)
from kvserve.stack.stack import start_service, stop_service
from protos.kvserve.v1 import kvstore_pb2, kvstore_pb2_grpc, prefill_pb2, prefill_pb2_grpc

GOAL = 1.15  # stack TTFT p50 <= 1.15x in-process reuse
POOL_HITS = "kvserve_prefill_engine_pool_hit_tokens_total"
PREFILL_CACHED = "kvserve_prefill_cached_tokens_total"


@contextlib.contextmanager
def writer_prefill(target: Target, log_dir: Path, engine_args: list[str]) -> Iterator[str]:
    """A prefill service of its own over the stack's store; yields its address."""
    assert target.store_addr is not None
    service = start_service("prefill-writer", "prefill_service", [
        "--model", str(target.model), "--kvstore", target.store_addr, "--block-size", str(target.block_size),
        "--listen", "127.0.0.1:0", "--insecure", *engine_args], log_dir / "prefill-writer.log")
    try:
        yield service.addr
    finally:
        stop_service(service)


def write_prefix(writer_addr: str, store_addr: str, prompt: list[int], salt: str) -> int:
    """The prompt through the writer's Prefill RPC; returns its full blocks, all checked to be in the store."""
    g = build_request(token_ids=prompt, max_tokens=1, ignore_eos=True, cache_salt=salt)
    with grpc.insecure_channel(writer_addr) as channel:
        reply = prefill_pb2_grpc.PrefillStub(channel).Prefill(
            prefill_pb2.PrefillRequest(request_id=g.request_id, prompt=g.prompt, sampling=g.sampling, cache=g.cache),
            timeout=600)
    hashes = list(reply.block_hashes)
    with grpc.insecure_channel(store_addr) as channel:
        hits = kvstore_pb2_grpc.KVStoreStub(channel).Lookup(kvstore_pb2.LookupRequest(hashes=hashes), timeout=10)
    if hits.num_hits != len(hashes):
        raise RuntimeError(f"the store holds {hits.num_hits} of the prefix's {len(hashes)} blocks after its prefill")
    return len(hashes)


def measure(client: Client, writer: str, target: Target, args: argparse.Namespace, rng: random.Random,
            before: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """One request over a fresh prefix in the store; ``before()``, if given, runs just before it (the baseline's
    round, kept as "baseline")."""
    assert target.store_addr is not None
    salt = f"handoff-{uuid.uuid4().hex}"
    prefix, new = ([rng.randrange(256) for _ in range(n)] for n in (args.prefix_tokens, args.new_tokens))
    stored_blocks = write_prefix(writer, target.store_addr, prefix, salt)
    baseline = before() if before is not None else None
    start = scrape(target.metrics_urls)
    trace = timed_stream(client, token_ids=prefix + new, max_tokens=2, ignore_eos=True, cache_salt=salt)
    assert trace.result is not None
    return {"ttft_s": trace.ttft_s, "second_token_s": trace.arrivals[1] - trace.arrivals[0],
            "server_ttft_s": trace.result.timings.ttft_s, "server_prefill_s": trace.result.timings.prefill_s,
            "cached_tokens": trace.usage.cached_tokens, "stored_blocks": stored_blocks,
            "metrics": delta(start, scrape(target.metrics_urls)),
            **({} if baseline is None else {"baseline": baseline})}


def spread(name: str, values: list[float]) -> dict[str, float]:
    return {f"{name}_p50_s": statistics.median(values), f"{name}_min_s": min(values), f"{name}_max_s": max(values)}


COLUMNS = [
    Column("path", "path", "{}", left=True),
    Column("ttft_p50_s", "TTFT p50 ms", "{:.1f}", 1000),
    Column("ttft_min_s", "min", "{:.1f}", 1000),
    Column("ttft_max_s", "max", "{:.1f}", 1000),
    Column("second_token_p50_s", "1st->2nd token p50 ms", "{:.1f}", 1000),
]
TIMING_COLUMNS = [
    Column("histogram", "service histogram", "{}", left=True),
    Column("count", "observations", "{:.0f}"),
    Column("mean_s", "mean ms", "{:.1f}", 1000),
]


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    with Progress(4 + 1 + args.repeats, "handoff: in-process baseline", quiet=args.quiet) as progress, \
            BaselineProcess(args.model, [(args.prefix_tokens, args.new_tokens)], device=args.device,
                            dtype=args.dtype) as baseline:
        progress.step(label="handoff: starting the stack")
        # The hand-off itself: with the stack's default --local-prefill-tokens, decode would compute these
        # few new tokens itself and prefill would never be asked.
        with open_target(args, "handoff", device_flags(args), store_device_flags(args),
                         decode_args=["--local-prefill-tokens", "0"]) as target, \
                tempfile.TemporaryDirectory(prefix="kvserve-writer-") as tmp, Client(target.addr, timeout_s=600) as client:
            progress.step(label="handoff: starting the writer prefill")
            with writer_prefill(target, args.log_dir or Path(tmp), device_flags(args)) as writer:
                progress.step(label="handoff: measuring")
                measure(client, writer, target, args, rng)  # untimed: one-time costs of a fresh stack
                progress.step()
                runs, rounds = [], []
                for _ in range(args.repeats):
                    # each of the stack's requests right after a round of the baseline's: both in the same second
                    # of the machine's drift, while the other side is idle
                    runs.append(measure(client, writer, target, args, rng, before=baseline.round))
                    rounds.append(runs[-1].pop("baseline"))
                    progress.step()
            metrics = bool(target.metrics_urls)
        progress.step()
    base = {k: [r["turns"][0][k] for r in rounds] for k in ("reuse_s", "decode_step_s")}
    totals: dict[str, float] = {}
    for r in runs:
        for k, v in r.pop("metrics").items():
            totals[k] = totals.get(k, 0.0) + v
    stack: dict[str, Any] = {"path": "stack", **spread("ttft", [r["ttft_s"] for r in runs]),
             **spread("second_token", [r["second_token_s"] for r in runs]),
             **spread("server_ttft", [r["server_ttft_s"] for r in runs]),
             **spread("server_prefill", [r["server_prefill_s"] for r in runs])}
    reuse: dict[str, Any] = {"path": "in-process reuse", **spread("ttft", base["reuse_s"]),
             **spread("second_token", base["decode_step_s"])}
    ratio = stack["ttft_p50_s"] / reuse["ttft_p50_s"]
    cached = sum(r["cached_tokens"] for r in runs)
    pool = totals.get(POOL_HITS) if metrics else None
    return {
        "bench": "handoff",
        "settings": {"prefix_tokens": args.prefix_tokens, "new_tokens": args.new_tokens, "repeats": args.repeats,
                     "seed": args.seed, "model": str(args.model), "device": args.device, "dtype": args.dtype,
                     "record_key": args.record_key, "metrics_read": metrics},
        "baseline_torch_threads": rounds[0]["torch_threads"], "rows": [stack, reuse], "runs": runs,
        "pair_ratios": [r["ttft_s"] / b for r, b in zip(runs, base["reuse_s"], strict=True)],
        "stack_vs_in_process": ratio,
        "cached_tokens_per_request": cached / len(runs),
        "pool_hit_tokens_per_request": None if pool is None else pool / len(runs),
        "store_tokens_per_request": None if pool is None else (cached - pool) / len(runs),
        "service_timings": [{"histogram": k, **v} for k, v in
                            histogram_means(totals, ("kvserve_prefill_", "kvserve_decode_")).items()],
        "goals": {"stack_vs_in_process": goal(ratio, GOAL, at_most=True)},
    }


def report_text(r: dict[str, Any]) -> str:
    s, (stack, _) = r["settings"], r["rows"]
    per_request = f"prompt tokens cached per request: {r['cached_tokens_per_request']:.0f}"
    if r["pool_hit_tokens_per_request"] is not None:
        per_request += (f" (from the store {r['store_tokens_per_request']:.0f}, "
                        f"from prefill's pool {r['pool_hit_tokens_per_request']:.0f})")
    lines = [
        f"handoff: {s['prefix_tokens']} tokens in the store (put there by another prefill) + {s['new_tokens']} new, "
        f"{s['repeats']} repeats; model {s['model']}"
        + (f"; store record key {s['record_key']}" if s.get("record_key") else ""),
        format_table(COLUMNS, r["rows"]),
        f"stack / in-process reuse: x{r['stack_vs_in_process']:.2f} (each request against the baseline's round "
        f"before it: x{min(r['pair_ratios']):.2f}-x{max(r['pair_ratios']):.2f}, median "
        f"x{statistics.median(r['pair_ratios']):.2f}); {per_request}",
        f"server side (p50): TTFT {stack['server_ttft_p50_s'] * 1000:.1f} ms, of which the Prefill call (arrival to handle) "
        f"{stack['server_prefill_p50_s'] * 1000:.1f} ms",
    ]
    if r["service_timings"]:
        lines += ["services' histograms over the measured requests:", format_table(TIMING_COLUMNS,
                                                                                  r["service_timings"])]
    lines.append(goal_line(f"stack TTFT p50 <= {GOAL:g}x in-process reuse", r["goals"]["stack_vs_in_process"]))
    return "\n".join(lines)


def panels(r: dict[str, Any]) -> list[Panel]:
    rows = {row["path"]: row for row in r["rows"]}
    return [
        bar_panel(f"TTFT, {r['settings']['prefix_tokens']} cached + {r['settings']['new_tokens']} new tokens",
                  "ms (p50, min-max)", {k: v["ttft_p50_s"] * 1000 for k, v in rows.items()},
                  spread={k: (v["ttft_min_s"] * 1000, v["ttft_max_s"] * 1000) for k, v in rows.items()}),
        bar_panel("first to second token", "ms (p50, min-max)",
                  {k: v["second_token_p50_s"] * 1000 for k, v in rows.items()},
                  spread={k: (v["second_token_min_s"] * 1000, v["second_token_max_s"] * 1000)
                          for k, v in rows.items()}),
    ]


def max_positions(model: Path) -> int | None:
    """The positions the model takes, as its config.json says (None if it does not say)."""
    path = model / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    value = config.get("max_position_embeddings") or config.get("n_positions")
    return int(value) if value else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvserve bench handoff", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_flags(ap)
    add_device_flags(ap)
    add_record_key_flag(ap)
    ap.add_argument("--prefix-tokens", type=int, default=2048, help="in the store (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=32, help="computed after it (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=15,
                    help="of the stack's request, each after one of the baseline (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="of the random prompts (default %(default)s)")
    add_output_flags(ap)
    args = ap.parse_args(argv)
    if args.addr and not args.kvstore:
        ap.error("with --addr, give the stack's --kvstore too: the writer prefill puts the prefix there")
    if args.addr and args.record_key:
        ap.error("--record-key sets the store started here: not with --addr")
    if min(args.prefix_tokens, args.new_tokens, args.repeats) < 1:
        ap.error("--prefix-tokens, --new-tokens and --repeats must be >= 1")
    args.model = ensure_model(args.model)
    limit = max_positions(args.model)
    if limit is not None and args.prefix_tokens + args.new_tokens + 2 > limit:
        ap.error(f"--prefix-tokens + --new-tokens + the 2 tokens generated = {args.prefix_tokens + args.new_tokens + 2} "
                 f"exceeds the {limit} positions of {args.model}")
    report = run(args)
    emit(args, report, report_text(report), lambda: panels(report), "kvserve bench handoff")
    return 0


if __name__ == "__main__":
    sys.exit(main())
