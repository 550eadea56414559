"""`kvserve bench decode`: decode throughput by concurrency, and what a long prompt does to running streams.

Part 1, throughput. The three services run as real processes on loopback. For each concurrency N of
`--streams`, N requests are streamed at once, each a distinct prompt of `--prompt-tokens` token ids
(no tokenizer) generating exactly `--new-tokens` tokens (greedy, EOS ignored), under a cache salt of
their own so that nothing is reused from an earlier level, after one untimed warm-up round at the
largest N (as HF runs each batch once untimed first). Measured: the stack's tokens/s = the
tokens the client received, summed over the N streams, / the wall time from just before the first
request is sent to when the last stream's final result arrived (the prompts' prefill is inside it).
Each level runs `--repeats` times, the levels in turn, and its row is the median run; the streams go out on
one asyncio loop (bench.streams.StreamLoop), whose CPU shares the stack's cores.
Beside it, in the same run, the same prompts go through Hugging Face `generate` as one padded batch
(`python -m bench.hf_batch` in a subprocess, before the stack starts: the same model, greedy,
EOS ignored, the same number of new tokens, the wall time of the `generate` call). Printed: tokens/s
per N, its ratio to one stream, the same for HF, and the stack's tokens/s over HF's at each N.

Part 2, chunked prefill (`--skip-itl` skips it). A `--long-prompt-tokens` prompt that decode has to
compute itself arrives while `--itl-streams` streams decode. So that decode finds none of its blocks
in the store while prefill does not compete for the cores, prefill's `--kvstore` points at a dead
loopback port (a bound socket that does not listen: every store call fails at once) and decode uses
the real store. Before the streams start, the long prompt goes through the Prefill RPC alone, so it
sits in prefill's own KV pool (a second call checks that prefill now finds it there), and a Lookup
in the real store checks that none of its blocks are there. Then the streams start, each generating
`--itl-new-tokens` tokens, and the client records when each token arrives. Once every stream has
received 2 tokens (the second comes from decode, so all prompts are computed), the streams' inter-token
gaps are "before" until each has received `--baseline-tokens` more; then the long request is sent
(prefill answers from its pool; decode computes the whole prompt), and every gap of the streams that
overlaps [long request sent, its second token received] is "during". The ratio is ITL p99 during
over ITL p99 before, once with decode's default `--max-num-batched-tokens` (chunks) and once with
`--unchunked-budget` (the whole prompt in one forward), each on a stack of its own.

`--device` and `--dtype` apply to the services, to HF's baseline and to the engine run beside it.

Goals printed as met or not: 16 streams >= 4x one stream; the stack >= 0.7x HF's tokens/s at 16
streams; ITL p99 raised at most 3x with chunks (and at least 20x in one forward, the contrast).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from client.client import Client, build_request
from kvserve.bench.isolated import run_module
from kvserve.bench.report import (
    Line,
    Panel,
    Progress,
    add_output_flags,
    bar_panel,
    line_panel,
    percentile,
    save_plot,
    write_json,
)
from kvserve.bench.streams import StreamLoop, Streams, StreamTrace, stream_into
from kvserve.bench.target import (
    MODEL_HELP,
    add_device_flags,
    device_flags,
    ensure_model,
    local_stack,
    store_device_flags,
)
from protos.kvserve.v1 import kvstore_pb2, kvstore_pb2_grpc, prefill_pb2, prefill_pb2_grpc

SCALING_GOAL = 4.0  # 16 streams >= 4x one stream
VS_HF_GOAL = 0.7  # >= 0.7x HF's padded batch at 16 streams
GOAL_STREAMS = 16
ITL_GOAL = 3.0  # chunked: ITL p99 raised at most 3x
ITL_CONTRAST = 20.0  # one forward: raised 20x or more
WARM_UP_TOKENS = 8


def make_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """`count` distinct prompts of `length` random byte token ids (valid ids in every byte-level vocabulary)."""
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(count)]


def check_tokens(traces: list[StreamTrace], new_tokens: int) -> int:
    """Tokens received in all; each stream must have received exactly `new_tokens`, as its result says."""
    for i, t in enumerate(traces):
        assert t.result is not None
        if not len(t.token_ids) == t.result.usage.completion_tokens == new_tokens:
            raise RuntimeError(f"stream {i} received {len(t.token_ids)} tokens, its result says "
                               f"{t.result.usage.completion_tokens}, {new_tokens} were asked for")
    return sum(len(t.token_ids) for t in traces)


# ---- part 1: throughput -----------------------------------------------------------------------


def hf_baseline(model: Path, prompts: list[list[int]], levels: list[int], new_tokens: int,
                engine_args: list[str]) -> dict[str, Any]:
    """Runs `python -m bench.hf_batch` on these prompts, alone: before the stack starts."""
    from kvserve.bench import hf_batch

    return run_module(hf_batch.__name__, ["--model", str(model), "--prompts", "-", "--streams",
                                          ",".join(map(str, levels)), "--new-tokens", str(new_tokens),
                                          *engine_args], stdin=json.dumps(prompts))


def stack_throughput(loop: StreamLoop, prompts: list[list[int]], levels: list[int], new_tokens: int, repeats: int,
                     progress: Progress) -> list[dict[str, Any]]:
    """A row per level: its median run of `repeats` (the levels taken in turn, each run under a salt of its own),
    with every run's seconds."""
    run = uuid.uuid4().hex[:8]
    # Warm-up, untimed: the largest concurrency once (the channel, the first large forwards' memory).
    Streams(loop, [dict(token_ids=p, max_tokens=WARM_UP_TOKENS, ignore_eos=True, cache_salt=f"warm-{run}")
                   for p in prompts[: max(levels)]]).run()
    progress.step()
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in levels}
    for repeat in range(repeats):
        for n in levels:
            streams = Streams(loop, [dict(token_ids=p, max_tokens=new_tokens, ignore_eos=True,
                                          cache_salt=f"decode-bench-{run}-{n}-{repeat}") for p in prompts[:n]])
            t0, traces = streams.run()
            seconds = max(t.end for t in traces) - t0
            tokens = check_tokens(traces, new_tokens)
            runs[n].append({"streams": n, "generated_tokens": tokens, "s": seconds, "tok_s": tokens / seconds,
                            "last_first_token_s": max(t.arrivals[0] for t in traces) - t0,
                            "itl_median_s": percentile([b - a for t in traces for a, b in t.gaps()], 50),
                            "token_ids": [t.token_ids for t in traces]})
            progress.step()
    return [{**sorted(rs, key=lambda r: r["s"])[(len(rs) - 1) // 2], "runs_s": [r["s"] for r in rs]}
            for rs in runs.values()]


def throughput_report(stack: list[dict[str, Any]], hf: dict[str, Any]) -> dict[str, Any]:
    base, hf_base = stack[0], hf["runs"][0]
    rows = []
    for s, h in zip(stack, hf["runs"], strict=True):
        assert s["streams"] == h["streams"]
        rows.append({
            "streams": s["streams"],
            "generated_tokens": s["generated_tokens"],
            "stack_s": s["s"],
            "stack_runs_s": s["runs_s"],
            "stack_tok_s": s["tok_s"],
            "stack_ratio": s["tok_s"] / base["tok_s"],
            "stack_last_first_token_s": s["last_first_token_s"],  # every prompt prefilled by then
            "stack_itl_median_s": s["itl_median_s"],
            "hf_generated_tokens": h["generated_tokens"],
            "hf_s": h["s"],
            "hf_tok_s": h["tok_s"],
            "hf_ratio": h["tok_s"] / hf_base["tok_s"],
            "stack_vs_hf": s["tok_s"] / h["tok_s"],
            "engine_tok_s": h["engine_tok_s"],  # kvserve's engine alone, in HF's process
            "engine_vs_hf": h["engine_tok_s"] / h["tok_s"],
            "same_tokens_as_hf": sum(a == b for a, b in zip(s["token_ids"], h["token_ids"], strict=True)),
        })
    by_n = {r["streams"]: r for r in rows}
    goals: dict[str, Any] = {}
    if base["streams"] == 1 and GOAL_STREAMS in by_n:
        one, top = rows[0], by_n[GOAL_STREAMS]
        value = top["stack_ratio"]
        each = [top["generated_tokens"] / s_top * s_one / one["generated_tokens"]
                for s_one, s_top in zip(one["stack_runs_s"], top["stack_runs_s"], strict=True)]
        goals["scaling"] = {"value": value, "goal": SCALING_GOAL, "met": value >= SCALING_GOAL, "each_repeat": each}
    if GOAL_STREAMS in by_n:
        value = by_n[GOAL_STREAMS]["stack_vs_hf"]
        goals["vs_hf"] = {"value": value, "goal": VS_HF_GOAL, "met": value >= VS_HF_GOAL}
    return {"base_streams": base["streams"], "hf_torch_threads": hf["torch_threads"], "rows": rows, "goals": goals}


# ---- part 2: a long prompt arriving while streams decode --------------------------------------


@contextlib.contextmanager
def dead_address() -> Iterator[str]:
    """A loopback address where nothing listens (the port stays bound, so nothing else takes it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


def warm_prefill_pool(prefill_addr: str, store_addr: str, prompt: list[int], salt: str) -> dict[str, int]:
    """The long prompt through the Prefill RPC alone, twice (the second finds it in prefill's pool), and a
    Lookup of its blocks in the real store (prefill could put none there)."""
    def request() -> prefill_pb2.PrefillRequest:
        g = build_request(token_ids=prompt, max_tokens=2, ignore_eos=True, cache_salt=salt)
        return prefill_pb2.PrefillRequest(request_id=g.request_id, prompt=g.prompt, sampling=g.sampling,
                                          cache=g.cache)

    with grpc.insecure_channel(prefill_addr) as channel:
        stub = prefill_pb2_grpc.PrefillStub(channel)
        cold = stub.Prefill(request(), timeout=600)
        warm = stub.Prefill(request(), timeout=600)
    with grpc.insecure_channel(store_addr) as channel:
        lookup = kvstore_pb2_grpc.KVStoreStub(channel).Lookup(
            kvstore_pb2.LookupRequest(hashes=list(cold.block_hashes)), timeout=10)
    return {"cold_computed_tokens": cold.num_computed_tokens, "warm_cached_tokens": warm.num_cached_tokens,
            "store_hits": lookup.num_hits}


def gaps_within(traces: list[StreamTrace], lo: float, hi: float) -> list[float]:
    return [b - a for t in traces for a, b in t.gaps() if a >= lo and b <= hi]


def gaps_overlapping(traces: list[StreamTrace], lo: float, hi: float) -> list[float]:
    return [b - a for t in traces for a, b in t.gaps() if b > lo and a < hi]


def long_prompt_itl(addr: str, prefill_addr: str, store_addr: str, args: argparse.Namespace) -> dict[str, Any]:
    run = uuid.uuid4().hex[:8]
    long_prompt = make_prompts(1, args.long_prompt_tokens, args.seed + 2)[0]
    prompts = make_prompts(args.itl_streams, args.prompt_tokens, args.seed + 1)
    with Client(addr, timeout_s=600) as client, StreamLoop(addr) as loop:
        client.generate(token_ids=prompts[0], max_tokens=2, ignore_eos=True, cache_salt=f"warm-{run}")
        streams = Streams(loop, [dict(token_ids=p, max_tokens=args.itl_new_tokens, ignore_eos=True,
                                      cache_salt=f"itl-{run}") for p in prompts])
        streams.start()
        streams.wait_for(2, 600)
        steady = max(t.arrivals[1] for t in streams.traces)
        streams.wait_for(2 + args.baseline_tokens, 600)
        baseline_end = time.perf_counter()
        # After the streams' prompts went through prefill: its pool keeps finished prompts only within the
        # memory its running ones needed (engine.block_pool), so theirs would have taken the long prompt's blocks.
        pool = warm_prefill_pool(prefill_addr, store_addr, long_prompt, f"long-{run}")
        long = StreamTrace()
        sent = time.perf_counter()
        stream_into(client, long, token_ids=long_prompt, max_tokens=2, ignore_eos=True, cache_salt=f"long-{run}")
        traces = streams.join()
    check_tokens(traces, args.itl_new_tokens)
    check_tokens([long], 2)
    assert long.result is not None
    second = long.arrivals[1]
    before, during = gaps_within(traces, steady, baseline_end), gaps_overlapping(traces, sent, second)
    p99_before, p99_during = percentile(before, 99), percentile(during, 99)
    return {
        "long_prompt_tokens": long.result.usage.prompt_tokens,
        "long_cached_tokens": long.result.usage.cached_tokens,  # found by prefill in its own pool
        "prefill_pool": pool,
        "long_ttft_s": long.arrivals[0] - sent,
        "long_decode_s": second - long.arrivals[0],  # decode's fetch (all misses) + compute + 1 token
        "streams_decoding_throughout": min(t.arrivals[-1] for t in traces) > second,
        "gaps_before_s": before,
        "gaps_during_s": during,
        "itl_p99_before_s": p99_before,
        "itl_p99_during_s": p99_during,
        "ratio": p99_during / p99_before,
    }


def itl_report(chunked: dict[str, Any], unchunked: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    return {
        "streams": args.itl_streams,
        "stream_new_tokens": args.itl_new_tokens,
        "unchunked_budget": args.unchunked_budget,
        "chunked": chunked,
        "unchunked": unchunked,
        "goals": {
            "chunked": {"value": chunked["ratio"], "goal": ITL_GOAL, "met": chunked["ratio"] <= ITL_GOAL},
            "unchunked_contrast": {"value": unchunked["ratio"], "goal": ITL_CONTRAST,
                                   "met": unchunked["ratio"] >= ITL_CONTRAST},
        },
    }


# ---- the command ------------------------------------------------------------------------------


def run(args: argparse.Namespace, levels: list[int], progress: Progress) -> dict[str, Any]:
    prompts = make_prompts(max(levels), args.prompt_tokens, args.seed)
    hf = hf_baseline(args.model, prompts, levels, args.new_tokens, device_flags(args))
    progress.step(label="decode: starting the stack")
    report: dict[str, Any] = {"bench": "decode", "model": str(args.model), "prompt_tokens": args.prompt_tokens,
                              "new_tokens": args.new_tokens,
                              "settings": {k: getattr(args, k) for k in SETTINGS} | {"model": str(args.model)}}
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-decode-") as tmp_name:
        tmp = Path(tmp_name)
        with local_stack(args.model, tmp, "throughput", args.log_dir, engine_args=device_flags(args),
                         store_args=store_device_flags(args)) as s, StreamLoop(s.addr) as loop:
            progress.step(label="decode: throughput")
            report["throughput"] = throughput_report(
                stack_throughput(loop, prompts, levels, args.new_tokens, args.repeats, progress), hf)
        if not args.skip_itl:
            results = {}
            # --local-prefill-tokens 0: prefill answers the long prompt first (from its pool), then decode, whose
            # store has none of it, computes it all among the streams; whatever its length.
            for name, decode_args in (("chunked", ["--local-prefill-tokens", "0"]),
                                      ("unchunked", ["--local-prefill-tokens", "0",
                                                     "--max-num-batched-tokens", str(args.unchunked_budget)])):
                progress.phase(f"decode: a long prompt among streams, {name}")
                with dead_address() as dead, local_stack(args.model, tmp, name, args.log_dir,
                                                         prefill_args=["--kvstore", dead],
                                                         decode_args=decode_args,
                                                         engine_args=device_flags(args)) as s:
                    progress.step()
                    results[name] = long_prompt_itl(s.addr, s.service("prefill").addr, s.service("kvstore").addr,
                                                    args)
                progress.step()
            report["itl"] = itl_report(results["chunked"], results["unchunked"], args)
    return report


SETTINGS = ("streams", "repeats", "prompt_tokens", "new_tokens", "seed", "skip_itl", "itl_streams", "itl_new_tokens",
            "baseline_tokens", "long_prompt_tokens", "unchunked_budget", "device", "dtype")


def progress_steps(args: argparse.Namespace, levels: list[int]) -> int:
    """HF's baseline, the stack's start, its warm-up, each level; each part-2 stack's start and run."""
    return 3 + len(levels) * args.repeats + (0 if args.skip_itl else 4)


def _met(goal: dict[str, Any]) -> str:
    return "met" if goal["met"] else "NOT met"


def print_report(r: dict[str, Any]) -> None:
    t = r["throughput"]
    base = t["base_streams"]
    print(f"model {r['model']}: prompts of {r['prompt_tokens']} token ids (distinct per stream), "
          f"{r['new_tokens']} new tokens each, greedy, EOS ignored")
    print("stack: tok/s = generated tokens / (first request sent -> last stream's result received); "
          f"HF: one padded `generate` batch, torch threads {t['hf_torch_threads']}")
    print(f"{'streams':>7s} {'tokens':>7s} {'stack s':>8s} {'stack tok/s':>11s} {f'x{base} stream':>10s} "
          f"{'last TTFT':>9s} {'ITL med':>8s} {'HF s':>7s} {'HF tok/s':>9s} {f'HF x{base}':>7s} {'stack/HF':>8s} "
          f"{'same as HF':>10s} {'engine/HF':>9s}")
    for row in t["rows"]:
        print(f"{row['streams']:7d} {row['generated_tokens']:7d} {row['stack_s']:8.2f} {row['stack_tok_s']:11.1f} "
              f"{row['stack_ratio']:9.2f}x {row['stack_last_first_token_s']:8.2f}s "
              f"{row['stack_itl_median_s'] * 1000:5.1f} ms {row['hf_s']:7.2f} {row['hf_tok_s']:9.1f} "
              f"{row['hf_ratio']:6.2f}x {row['stack_vs_hf']:7.2f}x {row['same_tokens_as_hf']:5d}/{row['streams']}"
              f"{row['engine_vs_hf']:9.2f}x")
    print("(stack: the median of each level's runs, the levels taken in turn; last TTFT: from the first request "
          "sent until every stream had its first token; ITL med: median gap between a stream's tokens; engine/HF: "
          "kvserve's engine alone, in HF's process, on the same prompts)")
    print("stack s, each run: " + "; ".join(f"{row['streams']}: " + ", ".join(f"{x:.2f}" for x in row["stack_runs_s"])
                                            for row in t["rows"]))
    goals = t["goals"]
    if "scaling" in goals:
        g = goals["scaling"]
        each = ", ".join(f"{x:.2f}" for x in g["each_repeat"])
        print(f"goal: {GOAL_STREAMS} streams >= {SCALING_GOAL:g}x one stream: {_met(g)} (x{g['value']:.2f}; "
              f"each repeat x{each})")
    if "vs_hf" in goals:
        g = goals["vs_hf"]
        print(f"goal: {GOAL_STREAMS} streams >= {VS_HF_GOAL:g}x HF's padded batch: {_met(g)} (x{g['value']:.2f})")
    if "itl" not in r:
        return
    itl = r["itl"]
    first = itl["chunked"]
    print(f"\nchunked prefill: a {first['long_prompt_tokens']}-token prompt that decode computes itself "
          f"(store hits {first['prefill_pool']['store_hits']}; prefill found {first['long_cached_tokens']} "
          f"tokens in its pool) arrives while {itl['streams']} streams decode")
    print(f"{'decode --max-num-batched-tokens':32s} {'ITL p99 before':>14s} {'ITL p99 during':>14s} {'ratio':>7s} "
          f"{'gaps before/during':>18s} {'long prompt in decode':>21s}")
    for name, label in (("chunked", "default (chunks)"),
                        ("unchunked", f"{itl['unchunked_budget']} (one forward)")):
        x = itl[name]
        gaps = f"{len(x['gaps_before_s'])}/{len(x['gaps_during_s'])}"
        print(f"{label:32s} {x['itl_p99_before_s'] * 1000:11.1f} ms {x['itl_p99_during_s'] * 1000:11.1f} ms "
              f"{x['ratio']:6.1f}x {gaps:>18s} {x['long_decode_s']:19.2f} s")
        if not x["streams_decoding_throughout"]:
            print(f"  ! a stream ended before the long prompt's second token ({name}): raise --itl-new-tokens")
    g = itl["goals"]
    print(f"goal: ITL p99 raised <= {ITL_GOAL:g}x with chunks: {_met(g['chunked'])} (x{g['chunked']['value']:.1f})")
    print(f"contrast: ITL p99 raised >= {ITL_CONTRAST:g}x in one forward: {_met(g['unchunked_contrast'])} "
          f"(x{g['unchunked_contrast']['value']:.1f})")


def panels(r: dict[str, Any]) -> list[Panel]:
    rows = r["throughput"]["rows"]
    x = [row["streams"] for row in rows]
    out = [line_panel("decode throughput", "concurrent streams", "tokens/s", [
        Line("stack", x, [row["stack_tok_s"] for row in rows]),
        Line("HF generate, padded batch", x, [row["hf_tok_s"] for row in rows], dashed=True),
        Line("kvserve engine alone, in process", x, [row["engine_tok_s"] for row in rows], dashed=True),
    ])]
    if "itl" in r:
        itl = r["itl"]
        out.append(bar_panel("ITL p99 of decoding streams, a long prompt arriving", "ms", {
            f"{label}, {when}": itl[name][f"itl_p99_{when}_s"] * 1000
            for name, label in (("chunked", "chunks"), ("unchunked", "one forward")) for when in ("before", "during")
        }))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvserve bench decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help=MODEL_HELP)
    ap.add_argument("--streams", default="1,4,16,64", help="concurrencies, comma-separated (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each concurrency, taken in turn; its row is the median one (default %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="per stream (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=64, help="generated per stream (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="of the random prompts (default %(default)s)")
    ap.add_argument("--skip-itl", action="store_true", help="skip part 2 (a long prompt among decoding streams)")
    ap.add_argument("--itl-streams", type=int, default=16, help="streams decoding in part 2 (default %(default)s)")
    ap.add_argument("--itl-new-tokens", type=int, default=200,
                    help="tokens each part-2 stream generates; enough to outlast the long prompt (default %(default)s)")
    ap.add_argument("--baseline-tokens", type=int, default=30,
                    help="tokens each stream receives, all decoding, before the long prompt is sent (default %(default)s)")
    ap.add_argument("--long-prompt-tokens", type=int, default=2000, help="(default %(default)s)")
    ap.add_argument("--unchunked-budget", type=int, default=4096,
                    help="decode's --max-num-batched-tokens for the one-forward run (default %(default)s)")
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="keep the services' logs here, a folder per stack (default: removed with the run)")
    add_device_flags(ap)
    add_output_flags(ap)
    args = ap.parse_args(argv)
    if not args.skip_itl and args.itl_new_tokens <= args.baseline_tokens + 2:
        ap.error("--itl-new-tokens must exceed --baseline-tokens + 2: the streams must still decode when the long "
                 "prompt arrives")
    if not args.skip_itl and args.unchunked_budget < args.long_prompt_tokens + args.itl_streams:
        ap.error(f"--unchunked-budget {args.unchunked_budget} cannot hold the long prompt and the streams' tokens "
                 f"in one forward (needs {args.long_prompt_tokens + args.itl_streams})")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    levels = sorted({int(n) for n in args.streams.split(",")})
    args.model = ensure_model(args.model)
    with Progress(progress_steps(args, levels), "decode: HF baseline", quiet=args.quiet) as progress:
        report = run(args, levels, progress)
    if args.json != "-":
        print_report(report)
    if args.json:
        write_json(args.json, report)
    if args.plot:
        save_plot(args.plot, "kvserve bench decode", panels(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
