"""`kvserve bench serve`: a load generator for any OpenAI-compatible server, through the official `openai` SDK
(AsyncOpenAI, streamed chat completions), and a side-by-side of kvserve, `transformers serve` and vLLM.

Scenarios (`--scenario`):
- chat: `--users` users chat in `--rounds` rounds under one shared system prompt of `--system-tokens` tokens
  (2300 by default) in the served model's tokenizer: words added until the model folder's tokenizer counts
  that many (about 2,270 words on SmolLM2, 390 on the tiny byte-level llama); `--system-words` gives the
  words instead (with --target, whose tokenizer is not at hand, 400 by default); each turn asks a new
  question (`--question-words`, distinct per user) after the whole conversation so far, the previous answers
  included, for `--answer-tokens` greedy tokens, EOS ignored where the server lets us say so;
- fan-out: `--requests` different questions, each alone after the same long shared prefix.
The system prompt starts with a random session tag, new for each server, so nothing is cached from an
earlier run when round 1 starts.

Load: `--concurrency N`, a closed loop (N sessions at a time, each sending its next turn when the answer
before it is in; default: every user at once in chat, 4 in fan-out), or `--rate R` requests/s, an open
loop: request i (turns in order, users within a turn) is due at the i-th arrival of a Poisson process;
a chat turn due before its previous answer is in goes when it is in (counted as held back).

Figures per server, as the client sees them: TTFT (to the first chunk with content), ITL (gaps between
content chunks), end-to-end latency, each p50/p90/p99; output tokens/s (the completion tokens the usage
reports, or the content chunks where it reports none, over the first request sent to the last answer
in); the cached prompt tokens (usage.prompt_tokens_details.cached_tokens) where the server reports them;
in chat, TTFT p50 over rounds 2+ and per round. One untimed request first (a fresh server's one-time
costs), under another session tag.

`--target URL` drives a server that is already running (`--model`, default the first of its
/v1/models; `--api-key`; `--tls-ca`; `--extra-body` JSON, default {"ignore_eos": true}, dropped with a
note when the server refuses it). `--servers kvserve,transformers,vllm` (the default) instead starts
each in turn on the same model folder (`--model-dir`: the real model where it has been fetched, else the
tiny one), runs the same workload, stops it, then the next, so only one is on the cores at a time, each at
its best:
- kvserve: the store, prefill and decode (bench.target.local_stack, plaintext) behind its HTTP front
  (`kvserve http`), serving the model under its folder's name;
  body: ignore_eos;
- transformers: `transformers serve --continuous-batching --device cpu --host 127.0.0.1 --port P DIR`,
  offline, pinned to the folder, whose absolute path is the model name it wants. It refuses (422) any body
  field it does not know, ignore_eos and top_k among them; its own `generation_config` (a JSON string)
  with eos_token_id -1 is how it generates past EOS. It ignores stream_options but always sends the
  usage at the end, with no cached tokens. Its model's process keeps torch's default intra-op threads on a
  CPU (transformers sets one only on an accelerator), one per physical core: already every core a compute
  thread can use, so it runs once, with them;
- vllm: vLLM's CPU build from its own venv (bench.vllm_peer, `make bench-peers`), twice, as two servers:
  vllm-default, with vLLM's default threads (a core kept for its API server), and vllm-all-cores, every
  core bound to its OpenMP team (VLLM_CPU_OMP_THREADS_BIND=0-<n-1>, VLLM_CPU_NUM_OF_RESERVED_CPU=0); body:
  ignore_eos.
A server that does not start, or whose run fails, is reported with why; the others still run.

The report: one column per server (both vLLM settings), then kvserve's ratios to each other server, to vLLM
at its faster setting (the higher output tok/s, named), with the goals against `transformers serve`: TTFT
p50 (chat: over rounds 2+) <= 0.3x, output tok/s >= 3x.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import random
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from kvserve.bench import vllm_peer
from kvserve.bench.report import (
    Column,
    Line,
    Panel,
    Progress,
    add_output_flags,
    bar_panel,
    emit,
    format_table,
    goal,
    goal_line,
    line_panel,
    percentile,
    percentiles_s,
    ratio,
)
from kvserve.bench.target import MODEL_HELP, ensure_model, free_port, local_stack
from kvserve.stack.stack import StackError

if TYPE_CHECKING:
    from openai import AsyncOpenAI
    from openai.types.chat import ChatCompletionMessageParam

SERVERS = ("kvserve", "transformers", "vllm")
SCENARIOS = ("chat", "fan-out")
BASELINE = "transformers"  # the goals are against `transformers serve`
TTFT_GOAL = 0.3  # kvserve's TTFT p50 (chat: rounds 2+) <= 0.3x transformers serve's
THROUGHPUT_GOAL = 3.0  # kvserve's output tok/s >= 3x transformers serve's
DEFAULT_START_TIMEOUT_S = 300.0
DEFAULT_SYSTEM_TOKENS = 2300  # BENCHMARKS.md's chat workload
TARGET_SYSTEM_WORDS = 400  # with --target, where the served model's tokenizer is not at hand
STOP_TIMEOUT_S = 30.0
DEFAULT_EXTRA_BODY = '{"ignore_eos": true}'
# What each server started here gets besides the standard fields, to generate past EOS.
EXTRA_BODIES: dict[str, dict[str, Any]] = {
    "kvserve": {"ignore_eos": True},
    "transformers": {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})},
    "vllm": {"ignore_eos": True},
}
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
WORDS = (
    "the", "model", "answer", "question", "cache", "token", "request", "server", "memory", "block", "prefix",
    "stream", "latency", "first", "every", "user", "system", "prompt", "history", "store", "compute", "reuse",
    "batch", "engine", "decode", "prefill", "layer", "attention", "kernel", "thread", "core", "budget", "queue",
    "round", "turn", "reply", "message", "context", "window", "length", "limit", "shared", "session", "policy",
    "router", "replica", "health", "status", "deadline", "timeout", "client", "library", "figure", "table",
    "report", "measure", "careful", "quickly", "always", "never", "before", "after", "between", "within",
    "without", "because", "which", "where", "when", "what", "how", "why", "is", "are", "was", "be", "to", "of",
    "and", "in", "on", "for", "with", "as", "by", "at", "from", "a", "an", "this", "that", "it", "we", "you",
)


class ServerSkipped(Exception):
    """Why a server did not start; the bench goes on with the next."""


# ---- the workload -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Workload:
    """`sessions` of `turns` each: chat's users and rounds; fan-out's requests, one turn each."""

    scenario: str
    sessions: int
    turns: int
    system_words: int
    question_words: int
    answer_tokens: int
    seed: int
    system_tokens: int | None = None  # the system prompt's, in the model folder's tokenizer, where counted

    @property
    def requests(self) -> int:
        return self.sessions * self.turns


@dataclass(frozen=True, slots=True)
class Load:
    """A closed loop of `concurrency` sessions at a time, or an open loop of `rate` requests/s (Poisson)."""

    concurrency: int | None = None
    rate: float | None = None

    def describe(self) -> str:
        if self.rate is not None:
            return f"open loop, Poisson arrivals at {self.rate:g} requests/s"
        return f"closed loop, concurrency {self.concurrency}"


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_prompt(w: Workload, tag: str) -> str:
    """The shared system prompt (or fan-out's shared prefix): a session tag, then `system_words` words that
    depend on the seed alone."""
    return f"Session {tag}. " + words(random.Random(w.seed), w.system_words)


def system_words_for(model_dir: Path, tokens: int, seed: int) -> tuple[int, int]:
    """The fewest words whose system prompt (`system_prompt`, its tag included) is at least `tokens` tokens in
    the model folder's tokenizer, and its tokens: (words, tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def count(n: int) -> int:
        prompt = system_prompt(Workload("chat", 1, 1, n, 1, 1, seed), "0" * 8)
        return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])

    lo, hi = 0, 1
    while count(hi) < tokens:
        lo, hi = hi, hi * 2
    while lo < hi:  # the fewest in [lo, hi], where count(hi) >= tokens
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if count(mid) >= tokens else (mid + 1, hi)
    return hi, count(hi)


def questions(w: Workload) -> list[list[str]]:
    """questions[session][turn], each its own words (no two sessions share one)."""
    out = []
    for s in range(w.sessions):
        rng = random.Random(w.seed * 100_003 + s + 1)
        out.append([f"Question {s + 1}.{t + 1}: {words(rng, w.question_words)}?" for t in range(w.turns)])
    return out


def turn_messages(system: str, asked: Sequence[str], answers: Sequence[str]) -> list[dict[str, str]]:
    """A turn's messages: the system prompt, then each question asked so far, each followed by its answer
    (all but the last, which is this turn's)."""
    if len(asked) != len(answers) + 1:
        raise ValueError(f"{len(asked)} questions need {len(asked) - 1} answers, got {len(answers)}")
    messages = [{"role": "system", "content": system}]
    for i, question in enumerate(asked):
        messages.append({"role": "user", "content": question})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def poisson_due(rate: float, n: int, rng: random.Random) -> list[float]:
    """When each of n requests is due, in seconds from the start: the first at 0, then exponential gaps of
    mean 1/rate."""
    due, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        due.append(t)
    return due


# ---- one request, as the client sees it -------------------------------------------------------


@dataclass(slots=True)
class Trace:
    """One streamed request: when it was due and sent, when each chunk with content arrived (perf_counter),
    when the stream ended, and the usage the server reported (None where it reported none)."""

    session: int
    turn: int
    due: float | None = None
    sent: float = 0.0
    arrivals: list[float] = field(default_factory=list)
    end: float = 0.0
    text: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.arrivals[0] - self.sent if self.arrivals else None

    @property
    def e2e_s(self) -> float:
        return self.end - self.sent

    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.arrivals)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the requests go: the /v1 URL, the model name the server wants, the extra body fields it gets,
    and whether to ask for the usage with stream_options."""

    name: str
    base_url: str
    model: str
    extra_body: Mapping[str, Any]
    version: str = ""
    log_path: Path | None = None
    stream_options: bool = True


async def stream_turn(client: AsyncOpenAI, ep: Endpoint, messages: list[dict[str, str]], max_tokens: int,
                      trace: Trace) -> None:
    """Streams one turn into `trace`: greedy, at most max_tokens, the usage at the end."""
    from openai import omit

    trace.sent = time.perf_counter()
    stream = await client.chat.completions.create(
        model=ep.model, messages=cast("list[ChatCompletionMessageParam]", messages), max_tokens=max_tokens,
        temperature=0, stream=True,
        stream_options={"include_usage": True} if ep.stream_options else omit, extra_body=dict(ep.extra_body) or None)
    parts = []
    async for chunk in stream:
        now = time.perf_counter()
        for choice in chunk.choices:
            if choice.delta is not None and choice.delta.content:
                parts.append(choice.delta.content)
                trace.arrivals.append(now)
        if chunk.usage is not None:
            trace.prompt_tokens, trace.completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
            details = chunk.usage.prompt_tokens_details
            trace.cached_tokens = details.cached_tokens if details is not None else None
    trace.end = time.perf_counter()
    trace.text = "".join(parts)


async def run_load(client: AsyncOpenAI, ep: Endpoint, w: Workload, load: Load, system: str,
                   progress: Progress) -> list[list[Trace]]:
    """The workload against one server under `load`: traces[session][turn]."""
    asked = questions(w)
    traces = [[Trace(s, t) for t in range(w.turns)] for s in range(w.sessions)]
    due = poisson_due(load.rate, w.requests, random.Random(w.seed)) if load.rate is not None else None
    t0 = time.perf_counter()

    async def session(s: int) -> None:
        answers: list[str] = []
        for t, trace in enumerate(traces[s]):
            if due is not None:
                trace.due = t0 + due[t * w.sessions + s]
                await asyncio.sleep(max(0.0, trace.due - time.perf_counter()))
            await stream_turn(client, ep, turn_messages(system, asked[s][:t + 1], answers), w.answer_tokens, trace)
            answers.append(trace.text)
            progress.step()

    async def worker(sessions: Iterator[int]) -> None:
        for s in sessions:  # shared by the workers: each takes the next session when its own is done
            await session(s)

    if due is not None:
        coros = [session(s) for s in range(w.sessions)]
    else:
        shared = iter(range(w.sessions))
        coros = [worker(shared) for _ in range(min(load.concurrency or w.sessions, w.sessions))]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return traces


def open_client(ep: Endpoint, api_key: str, timeout_s: float, tls_ca: Path | None) -> AsyncOpenAI:
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    http = DefaultAsyncHttpxClient(verify=ssl.create_default_context(cafile=str(tls_ca))) if tls_ca else None
    return AsyncOpenAI(base_url=ep.base_url, api_key=api_key, timeout=timeout_s, max_retries=0, http_client=http)


async def drive(ep: Endpoint, w: Workload, load: Load, progress: Progress, *, api_key: str = "none",
                timeout_s: float = 600.0, tls_ca: Path | None = None) -> tuple[Endpoint, list[list[Trace]], list[str]]:
    """The untimed warm-up, then the workload: (the endpoint as used, traces[session][turn], notes). With no
    model name, the first of the server's /v1/models; extra body fields the warm-up has refused (400 or
    422) are dropped, with a note."""
    from openai import BadRequestError, UnprocessableEntityError

    notes = []
    async with open_client(ep, api_key, timeout_s, tls_ca) as client:
        if not ep.model:
            models = [m.id async for m in client.models.list()]
            if not models:
                raise RuntimeError(f"{ep.base_url}/models lists no model: give --model")
            ep = dataclasses.replace(ep, model=models[0])
        warm = Workload(w.scenario, 1, 1, w.system_words, w.question_words, w.answer_tokens, w.seed + 1)
        warm_messages = turn_messages(system_prompt(warm, uuid.uuid4().hex[:8]), questions(warm)[0], [])
        try:
            await stream_turn(client, ep, warm_messages, w.answer_tokens, Trace(0, 0))
        except (BadRequestError, UnprocessableEntityError) as e:
            if not ep.extra_body:
                raise
            notes.append(f"refused the extra body {json.dumps(dict(ep.extra_body))} ({e.status_code}): sent none")
            ep = dataclasses.replace(ep, extra_body={})
            await stream_turn(client, ep, warm_messages, w.answer_tokens, Trace(0, 0))
        progress.step(label=f"serve: {ep.name}")
        traces = await run_load(client, ep, w, load, system_prompt(w, uuid.uuid4().hex[:8]), progress)
    return ep, traces, notes


# ---- figures ----------------------------------------------------------------------------------


def figures(traces: Sequence[Sequence[Trace]]) -> dict[str, Any]:
    """Over every request of one server (traces[session][turn])."""
    every = [t for s in traces for t in s]
    span = max(t.end for t in every) - min(t.sent for t in every)
    ttfts = [t.ttft_s for t in every if t.ttft_s is not None]
    later = [t.ttft_s for s in traces for t in s[1:] if t.ttft_s is not None]
    prompt = None if any(t.prompt_tokens is None for t in every) else sum(t.prompt_tokens or 0 for t in every)
    cached = None if any(t.cached_tokens is None for t in every) else sum(t.cached_tokens or 0 for t in every)
    output = sum(t.output_tokens for t in every)
    return {
        "requests": len(every),
        "prompt_tokens_mean": prompt / len(every) if prompt is not None else None,
        "cached_tokens": cached,
        "hit_rate": ratio(cached, prompt),
        **percentiles_s("ttft", ttfts),
        "ttft_p50_rounds_2_plus_s": percentile(later, 50) if later else None,
        **percentiles_s("itl", [gap for t in every for gap in t.itl_s()]),
        **percentiles_s("e2e", [t.e2e_s for t in every]),
        "output_tokens": output,
        "output_tok_s": output / span if span > 0 else None,
        "tokens_from": "usage" if all(t.completion_tokens is not None for t in every) else "chunks",
        "no_content": sum(not t.arrivals for t in every),
        "held_back": sum(t.due is not None and t.sent - t.due > 0.01 for t in every),
    }


def round_rows(traces: Sequence[Sequence[Trace]]) -> list[dict[str, Any]]:
    """Chat, per round over the users: TTFT and ITL p50, the cache hit rate where reported."""
    rows = []
    for r in range(len(traces[0])):
        turn = [s[r] for s in traces]
        prompt = sum(t.prompt_tokens or 0 for t in turn)
        cached = None if any(t.cached_tokens is None for t in turn) else sum(t.cached_tokens or 0 for t in turn)
        ttfts = [t.ttft_s for t in turn if t.ttft_s is not None]
        rows.append({"round": r + 1, "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
                     "itl_p50_s": percentile([g for t in turn for g in t.itl_s()], 50) if turn else None,
                     "hit_rate": ratio(cached, prompt)})
    return rows


def compared_ttft(fig: Mapping[str, Any]) -> float | None:
    """The TTFT the goals compare: p50 over rounds 2+ in chat, over every request otherwise."""
    later = fig.get("ttft_p50_rounds_2_plus_s")
    return later if later is not None else fig.get("ttft_p50_s")


def comparison(sections: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """kvserve / each other server that ran, at its faster setting where it has several (vllm: the higher
    output tok/s of those that ran, named as "against"): TTFT (compared_ttft) and output tok/s ratios; the
    goals against transformers serve, where both ran."""
    best: dict[str, Mapping[str, Any]] = {}
    for s in sections:
        server = s.get("server", s["name"])
        if "figures" in s and (server not in best or (s["figures"]["output_tok_s"] or 0.0)
                               > (best[server]["figures"]["output_tok_s"] or 0.0)):
            best[server] = s
    ratios: dict[str, Any] = {}
    goals: dict[str, Any] = {}
    if "kvserve" not in best:
        return ratios, goals
    kv = best.pop("kvserve")["figures"]
    for name, section in best.items():
        fig = section["figures"]
        ttft = ratio(compared_ttft(kv), compared_ttft(fig))
        tok_s = ratio(kv["output_tok_s"], fig["output_tok_s"])
        ratios[name] = {"ttft_ratio": ttft, "tok_s_ratio": tok_s}
        if section["name"] != name:
            ratios[name]["against"] = section["name"]
        if name == BASELINE:
            if ttft is not None:
                goals["ttft_vs_transformers"] = goal(ttft, TTFT_GOAL, at_most=True)
            if tok_s is not None:
                goals["throughput_vs_transformers"] = goal(tok_s, THROUGHPUT_GOAL, at_most=False)
    return ratios, goals


# ---- report -----------------------------------------------------------------------------------

METRICS = [
    Column("requests", "requests", "{:d}"),
    Column("prompt_tokens_mean", "prompt tokens, mean", "{:.0f}"),
    Column("cached_tokens", "cached prompt tokens", "{:d}"),
    Column("hit_rate", "cached %", "{:.0f}", 100),
    Column("ttft_p50_s", "TTFT p50 ms", "{:.1f}", 1000),
    Column("ttft_p90_s", "TTFT p90 ms", "{:.1f}", 1000),
    Column("ttft_p99_s", "TTFT p99 ms", "{:.1f}", 1000),
    Column("ttft_p50_rounds_2_plus_s", "TTFT p50 rounds 2+ ms", "{:.1f}", 1000),
    Column("itl_p50_s", "ITL p50 ms", "{:.1f}", 1000),
    Column("itl_p90_s", "ITL p90 ms", "{:.1f}", 1000),
    Column("itl_p99_s", "ITL p99 ms", "{:.1f}", 1000),
    Column("e2e_p50_s", "e2e p50 ms", "{:.1f}", 1000),
    Column("e2e_p90_s", "e2e p90 ms", "{:.1f}", 1000),
    Column("e2e_p99_s", "e2e p99 ms", "{:.1f}", 1000),
    Column("output_tokens", "output tokens", "{:d}"),
    Column("output_tok_s", "output tok/s", "{:.1f}"),
    Column("startup_s", "ready in s", "{:.1f}"),
]


def side_by_side(sections: Sequence[Mapping[str, Any]], chat: bool) -> str:
    """One row per figure, one column per server ("-": not reported, or the server did not run)."""
    shown = [c for c in METRICS if chat or c.key != "ttft_p50_rounds_2_plus_s"]
    rows = []
    for metric in shown:
        row = {"metric": metric.header}
        for s in sections:
            values = {**s.get("figures", {}), "startup_s": s.get("startup_s")}
            row[s["name"]] = metric.cell(values.get(metric.key)) if "figures" in s else "-"
        rows.append(row)
    columns = [Column("metric", "", "{}", left=True), *(Column(s["name"], s["name"], "{}") for s in sections)]
    return format_table(columns, rows)


def report_text(r: Mapping[str, Any]) -> str:
    s, sections = r["settings"], r["servers"]
    chat = s["scenario"] == "chat"
    shape = (f"{s['sessions']} users x {s['turns']} rounds" if chat
             else f"{s['sessions']} questions after one shared prefix")
    tokens = f"{s['system_tokens']} tokens in the model's tokenizer, " if s.get("system_tokens") is not None else ""
    lines = [f"serve, {s['scenario']}: {shape}, system prompt {tokens}{s['system_words']} words, questions "
             f"{s['question_words']} words, answers {s['answer_tokens']} tokens (greedy); {s['load']}; "
             f"model {s['model']}" + (f" in {s['dtype']}" if s.get("dtype", "auto") != "auto" else ""),
             "TTFT to the first chunk with content, ITL between content chunks, as the client sees them"]
    for sec in sections:
        if "skipped" in sec or "failed" in sec:
            what = "skipped" if "skipped" in sec else "failed"
            lines.append(f"  {sec['name']}: {what}: {sec.get('skipped') or sec.get('failed')}")
            continue
        fig = sec["figures"]
        extra = json.dumps(sec["extra_body"]) if sec["extra_body"] else "nothing"
        notes = "".join(f"; {n}" for n in sec.get("notes", []))
        counted = "" if fig["tokens_from"] == "usage" else "; no usage: output tokens are content chunks"
        cached = "" if fig["cached_tokens"] is not None else "; reports no cached tokens"
        held = f"; {fig['held_back']} turns held back for their previous answer" if fig["held_back"] else ""
        version = f" {sec['version']}" if sec.get("version") else ""
        threads = f", {vllm_peer.Threads(sec['threads'], sec['env']).describe()}" if "threads" in sec else ""
        lines.append(f"  {sec['name']}{version} at {sec['url']}, model {sec['model']!r}{threads}: extra body "
                     f"{extra}{notes}{counted}{cached}{held}")
    if not any("figures" in sec for sec in sections):
        return "\n".join([*lines, "no server ran"])
    lines += ["", side_by_side(sections, chat)]
    later = "TTFT p50 over rounds 2+" if chat and s["turns"] > 1 else "TTFT p50"
    for name, x in r["ratios"].items():
        ttft = "-" if x["ttft_ratio"] is None else f"x{x['ttft_ratio']:.2f}"
        tok_s = "-" if x["tok_s_ratio"] is None else f"x{x['tok_s_ratio']:.2f}"
        against = (f" at {x['against']}, the faster of its settings that ran (the higher output tok/s)"
                   if "against" in x else "")
        lines.append(f"kvserve / {name}{against}: {later} {ttft}, output tok/s {tok_s}")
    goals = r["goals"]
    if "ttft_vs_transformers" in goals:
        lines.append(goal_line(f"kvserve {later} <= {TTFT_GOAL:g}x transformers serve's", goals["ttft_vs_transformers"]))
    if "throughput_vs_transformers" in goals:
        lines.append(goal_line(f"kvserve output tok/s >= {THROUGHPUT_GOAL:g}x transformers serve's",
                               goals["throughput_vs_transformers"]))
    return "\n".join(lines)


def panels(r: Mapping[str, Any]) -> list[Panel]:
    ran = [s for s in r["servers"] if "figures" in s]
    if not ran:
        return []
    chat = r["settings"]["scenario"] == "chat"
    label = "TTFT p50, rounds 2+" if chat and r["settings"]["turns"] > 1 else "TTFT p50"
    out = [bar_panel(label, "ms", {s["name"]: (compared_ttft(s["figures"]) or 0.0) * 1000 for s in ran}),
           bar_panel("output tokens/s", "tok/s", {s["name"]: s["figures"]["output_tok_s"] or 0.0 for s in ran})]
    if chat:
        out.append(line_panel("TTFT p50 per round", "round", "ms", [
            Line(s["name"], [row["round"] for row in s["rounds"]],
                 [None if row["ttft_p50_s"] is None else row["ttft_p50_s"] * 1000 for row in s["rounds"]])
            for s in ran]))
    return out


# ---- the servers started here -----------------------------------------------------------------


def offline_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    for key, value in OFFLINE.items():
        env.setdefault(key, value)
    return env


def log_tail(path: Path | None) -> str:
    return vllm_peer.log_tail(path) if path is not None else "(no log)"


def wait_http_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float, log_path: Path, what: str) -> None:
    """Until GET url answers 200; ServerSkipped, with the log's tail, when the process exits first or
    timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ServerSkipped(f"{what} exited ({proc.returncode}) before it was ready; its log ends:\n"
                                f"{log_tail(log_path)}")
        with contextlib.suppress(urllib.error.URLError, OSError), urllib.request.urlopen(url, timeout=5) as resp:
            if resp.status == 200:
                return
        if time.monotonic() > deadline:
            raise ServerSkipped(f"{what} was not ready in {timeout_s:g} s; its log ends:\n{log_tail(log_path)}")
        time.sleep(0.5)


@contextlib.contextmanager
def process(command: Sequence[str], log_path: Path, env: Mapping[str, str], what: str
            ) -> Iterator[subprocess.Popen[bytes]]:
    """A server in a process group of its own, its output in log_path; the whole group stopped on exit, also
    on Ctrl-C, SIGTERM or SIGHUP."""
    with vllm_peer.exit_on_signals():
        try:
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(list(command), stdin=subprocess.DEVNULL,
                                        stdout=log, stderr=log, env=dict(env),
                                        start_new_session=True)
        except OSError as e:
            raise ServerSkipped(f"{what} did not start: {e}") from e
        try:
            yield proc
        finally:
            vllm_peer.stop_group(proc, STOP_TIMEOUT_S)


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


@contextlib.contextmanager
def kvserve_server(args: argparse.Namespace, logs: Path, tmp: Path) -> Iterator[Endpoint]:
    """The three services (plaintext) with the HTTP API in front of decode."""
    try:
        dtype = [] if args.dtype == "auto" else ["--dtype", args.dtype]
        with local_stack(args.model_dir, tmp, "kvserve", logs, engine_args=dtype, http=True) as s:
            http = s.service("http")
            yield Endpoint("kvserve", f"{http.url}/v1", args.model_dir.name, EXTRA_BODIES["kvserve"],
                           package_version("kvserve"), http.log_path)
    except StackError as e:
        raise ServerSkipped(f"the stack did not start: {e}") from e


def transformers_command(model: Path, port: int) -> list[str]:
    """`transformers serve` pinned to the folder (its absolute path is the model name it answers to), on the
    CPU as the others run, with its continuous batching (paged attention)."""
    return [sys.executable, "-m", "transformers.cli.transformers", "serve", "--continuous-batching",
            "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), str(model.resolve())]


@contextlib.contextmanager
def transformers_server(args: argparse.Namespace, logs: Path) -> Iterator[Endpoint]:
    missing = [m for m in ("fastapi", "uvicorn", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ServerSkipped(f"`transformers serve` needs {', '.join(missing)}: pip install 'transformers[serving]'")
    port = free_port()
    log_path = logs / "transformers.log"
    with process(transformers_command(args.model_dir, port), log_path, offline_env(), "transformers serve") as proc:
        wait_http_ready(proc, f"http://127.0.0.1:{port}/health", args.start_timeout, log_path, "transformers serve")
        yield Endpoint("transformers", f"http://127.0.0.1:{port}/v1", str(args.model_dir.resolve()),
                       EXTRA_BODIES["transformers"], package_version("transformers"), log_path,
                       stream_options=False)  # ignored (with a warning): it always sends the usage


@contextlib.contextmanager
def vllm_server(args: argparse.Namespace, logs: Path, threads: vllm_peer.Threads) -> Iterator[Endpoint]:
    name = f"vllm-{threads.name}"
    log_path = logs / f"{name}.log"
    try:
        version = vllm_peer.vllm_version(args.vllm_python)
        with vllm_peer.vllm_server(args.vllm_python, args.model_dir, kv_space_gib=args.vllm_kv_space,
                                   threads=threads, start_timeout_s=args.vllm_start_timeout, log_path=log_path,
                                   dtype=None if args.dtype == "auto" else args.dtype) as url:
            yield Endpoint(name, url, vllm_peer.SERVED_MODEL, EXTRA_BODIES["vllm"], version, log_path)
    except vllm_peer.PeerSkipped as e:
        raise ServerSkipped(str(e)) from e


@dataclass(frozen=True, slots=True)
class ServerRun:
    """One server started here (`server`, one of SERVERS), under `threads` for vllm: its report column `name`."""

    server: str
    threads: vllm_peer.Threads | None = None

    @property
    def name(self) -> str:
        return f"{self.server}-{self.threads.name}" if self.threads else self.server


def server_runs(servers: Sequence[str]) -> list[ServerRun]:
    """The servers to start, in order: vllm once for each of its thread settings."""
    return [ServerRun(s, t) for s in servers
            for t in (vllm_peer.thread_settings() if s == "vllm" else (None,))]


def open_server(run: ServerRun, args: argparse.Namespace, logs: Path, tmp: Path
                ) -> contextlib.AbstractContextManager[Endpoint]:
    if run.server == "kvserve":
        return kvserve_server(args, logs, tmp)
    if run.server == "transformers":
        return transformers_server(args, logs)
    assert run.threads is not None
    return vllm_server(args, logs, run.threads)


def target_endpoint(args: argparse.Namespace) -> Endpoint:
    return Endpoint("target", base_url(args.target), args.model or "", args.extra_body)


def base_url(url: str) -> str:
    """The SDK's base URL: the server's, ending in /v1."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


# ---- the run ----------------------------------------------------------------------------------


def run_one(ep: Endpoint, args: argparse.Namespace, w: Workload, load: Load, progress: Progress,
            section: dict[str, Any]) -> None:
    """The workload against one endpoint, into its report section (its figures, or why it failed)."""
    from openai import OpenAIError

    try:
        used, traces, notes = asyncio.run(drive(ep, w, load, progress, api_key=args.api_key,
                                                timeout_s=args.request_timeout, tls_ca=args.tls_ca))
    except (OpenAIError, OSError, RuntimeError, ValueError) as e:
        tail = f"; its log ends:\n{log_tail(ep.log_path)}" if ep.log_path else ""
        section["failed"] = f"{type(e).__name__}: {e}{tail}"
        return
    section.update(url=used.base_url, model=used.model, extra_body=dict(used.extra_body), version=used.version,
                   notes=notes, figures=figures(traces))
    if w.scenario == "chat":
        section["rounds"] = round_rows(traces)


def run(args: argparse.Namespace, w: Workload, load: Load) -> dict[str, Any]:
    names = ["target"] if args.target else args.servers
    runs = [ServerRun("target")] if args.target else server_runs(args.servers)
    per_server = 2 + w.requests  # start, warm-up, each request
    sections: list[dict[str, Any]] = []
    with Progress(per_server * len(runs), "serve", quiet=args.quiet) as progress, \
            tempfile.TemporaryDirectory(prefix="kvserve-bench-serve-") as tmp:
        logs = args.log_dir or Path(tmp) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for i, server in enumerate(runs):
            name = server.name
            section: dict[str, Any] = {"name": name, "server": server.server}
            if server.threads is not None:
                section.update(threads=server.threads.name, env=dict(server.threads.env))
            sections.append(section)
            progress.phase(f"serve: starting {name}")
            t0 = time.monotonic()
            try:
                if args.target:
                    progress.step(label=f"serve: {name}, warm-up")
                    run_one(target_endpoint(args), args, w, load, progress, section)
                else:
                    with open_server(server, args, logs, Path(tmp)) as ep:
                        section["startup_s"] = time.monotonic() - t0
                        progress.step(label=f"serve: {name}, warm-up")
                        run_one(ep, args, w, load, progress, section)
            except ServerSkipped as e:
                section["skipped"] = str(e)
            progress.step(max(0, per_server * (i + 1) - progress.done))  # past what did not run
    ratios, goals = comparison(sections)
    settings = {**dataclasses.asdict(w), "load": load.describe(), "concurrency": load.concurrency, "rate": load.rate,
                "model": args.target or str(args.model_dir), "dtype": args.dtype, "servers": names}
    return {"bench": "serve", "settings": settings, "servers": sections, "ratios": ratios, "goals": goals}


# ---- flags ------------------------------------------------------------------------------------


def server_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SERVERS]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a comma-separated list of distinct names among {', '.join(SERVERS)}"
                                         f", got {text!r}")
    return names


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvserve bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_server_flags(ap)
    _add_workload_flags(ap)
    add_output_flags(ap)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked, with the defaults that depend on --target or --servers filled in."""
    ap = parser()
    args = ap.parse_args(argv)
    _settle_servers(ap, args)
    _check_workload(ap, args)
    return args


def _add_server_flags(ap: argparse.ArgumentParser) -> None:
    where = ap.add_argument_group("servers")
    where.add_argument("--target", metavar="URL", default=None,
                       help="a running OpenAI-compatible server, e.g. http://127.0.0.1:8000 (/v1 is added)")
    where.add_argument("--servers", type=server_list, default=None, metavar="LIST",
                       help=f"start these one after the other on --model-dir (default {','.join(SERVERS)})")
    where.add_argument("--model", default=None, help="with --target: the model name (default: its first /v1/models)")
    where.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or "none",
                       help="with --target (default: $OPENAI_API_KEY, else none)")
    where.add_argument("--tls-ca", type=Path, default=None, metavar="PEM", help="with --target: trust this CA")
    where.add_argument("--extra-body", type=json_object, default=None, metavar="JSON",
                       help=f"with --target: fields added to each request's body (default {DEFAULT_EXTRA_BODY}; "
                            "dropped when the server refuses them)")
    where.add_argument("--model-dir", type=Path, default=None,
                       help=f"with --servers: the {MODEL_HELP.replace('folder', 'folder every server loads')}")
    where.add_argument("--start-timeout", type=float, default=DEFAULT_START_TIMEOUT_S, metavar="S",
                       help="how long kvserve or transformers serve may take to get ready (default %(default)g)")
    where.add_argument("--vllm-python", type=Path, default=vllm_peer.DEFAULT_VLLM_PYTHON, metavar="PATH",
                       help="the Python of vLLM's venv (default %(default)s; `make bench-peers` makes it)")
    where.add_argument("--vllm-kv-space", type=int, default=vllm_peer.DEFAULT_KV_SPACE_GIB, metavar="GIB",
                       help="vLLM's KV cache, VLLM_CPU_KVCACHE_SPACE (default %(default)s)")
    where.add_argument("--vllm-start-timeout", type=float, default=vllm_peer.DEFAULT_START_TIMEOUT_S, metavar="S",
                       help="how long vLLM may take to get ready (default %(default)g)")
    where.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                       help="with --servers: kvserve's and vLLM's weights and KV cache (default: what the model's "
                            "config names)")
    where.add_argument("--log-dir", type=Path, default=None, help="keep the servers' logs here")


def _add_workload_flags(ap: argparse.ArgumentParser) -> None:
    work = ap.add_argument_group("workload")
    work.add_argument("--scenario", choices=SCENARIOS, default="chat", help="(default %(default)s)")
    work.add_argument("--users", type=int, default=None, help="chat: users (default 4)")
    work.add_argument("--rounds", type=int, default=None, help="chat: questions per user (default 4)")
    work.add_argument("--requests", type=int, default=None, help="fan-out: questions (default 16)")
    size = work.add_mutually_exclusive_group()
    size.add_argument("--system-tokens", type=int, default=None,
                      help=f"with --servers: the shared prefix, in tokens of --model-dir's tokenizer (default "
                           f"{DEFAULT_SYSTEM_TOKENS})")
    size.add_argument("--system-words", type=int, default=None,
                      help=f"the shared prefix in words instead (default with --target: {TARGET_SYSTEM_WORDS})")
    work.add_argument("--question-words", type=int, default=30, help="(default %(default)s)")
    work.add_argument("--answer-tokens", type=int, default=32, help="max tokens of each answer (default %(default)s)")
    work.add_argument("--seed", type=int, default=0, help="of the words (default %(default)s)")
    work.add_argument("--request-timeout", type=float, default=600.0, metavar="S", help="(default %(default)g)")
    load = work.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None,
                      help="closed loop: sessions at a time (default: every chat user; 4 in fan-out)")
    load.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals, requests/s")


def _settle_servers(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--target or --servers, with the flags that go with each; fills in the defaults that depend on which."""
    if args.target and args.servers:
        ap.error("--target drives a running server, --servers starts servers: one or the other")
    if not args.target:
        if args.model or args.extra_body is not None or args.tls_ca:
            ap.error("--model, --extra-body and --tls-ca go with --target")
        args.servers = args.servers or list(SERVERS)
        if args.system_words is None:
            args.system_tokens = args.system_tokens if args.system_tokens is not None else DEFAULT_SYSTEM_TOKENS
    elif args.model_dir or args.system_tokens is not None:
        ap.error("--model-dir and --system-tokens go with --servers (a --target serves its own model; size its "
                 "prompt with --system-words)")
    elif args.system_words is None:
        args.system_words = TARGET_SYSTEM_WORDS
    if args.target and args.extra_body is None:
        args.extra_body = json.loads(DEFAULT_EXTRA_BODY)


def _check_workload(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.scenario == "chat" and args.requests is not None:
        ap.error("--requests is fan-out's; chat has --users and --rounds")
    if args.scenario == "fan-out" and (args.users is not None or args.rounds is not None):
        ap.error("--users and --rounds are chat's; fan-out has --requests")
    sizes = [args.users, args.rounds, args.requests, args.concurrency]
    if min([v for v in sizes if v is not None] + [args.question_words, args.answer_tokens]) < 1 \
            or min(args.system_words or 0, args.system_tokens or 0) < 0:
        ap.error("--users, --rounds, --requests, --concurrency, --question-words and --answer-tokens must be >= 1, "
                 "--system-words and --system-tokens >= 0")
    if args.rate is not None and args.rate <= 0:
        ap.error("--rate must be > 0")
    if min(args.start_timeout, args.vllm_start_timeout, args.request_timeout) <= 0 or args.vllm_kv_space < 1:
        ap.error("the timeouts must be > 0 and --vllm-kv-space >= 1")


def workload(args: argparse.Namespace) -> tuple[Workload, Load]:
    """The workload and load of the flags; a system prompt of --system-tokens is sized in --model-dir's
    tokenizer (`system_words_for`), so the folder must be resolved (`ensure_model`) by then."""
    chat = args.scenario == "chat"
    sessions = (args.users or 4) if chat else (args.requests or 16)
    words, tokens = (args.system_words, None) if args.system_words is not None else \
        system_words_for(args.model_dir, args.system_tokens, args.seed)
    w = Workload(args.scenario, sessions, (args.rounds or 4) if chat else 1, words,
                 args.question_words, args.answer_tokens, args.seed, tokens)
    if args.rate is not None:
        return w, Load(rate=args.rate)
    return w, Load(concurrency=min(args.concurrency or (sessions if chat else 4), sessions))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.target:
        os.environ.update({k: v for k, v in OFFLINE.items() if k not in os.environ})  # the servers download nothing
        args.model_dir = ensure_model(args.model_dir)
    w, load = workload(args)
    report = run(args, w, load)
    emit(args, report, report_text(report), lambda: panels(report), "kvserve bench serve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
