"""The multi-turn session `kvserve bench multi-turn` sends (straight to a stack, or through the router with
--replicas, or to vLLM with --peer vllm): users chatting in rounds over a shared system prompt, each round's
prompt the history before it."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from client.client import Client
from kvserve.bench.report import Progress
from kvserve.bench.streams import StreamTrace, timed_stream


@dataclass(frozen=True, slots=True)
class Settings:
    users: int
    rounds: int
    system_tokens: int
    question_tokens: int
    answer_tokens: int
    rate: float
    seed: int
    user_tokens: int = 0

    def prompt_tokens(self, round_: int) -> int:
        """Prompt length of round `round_` (from 1): the system prompt, the user's own context, the
        questions, the answers before."""
        return (self.system_tokens + self.user_tokens + round_ * self.question_tokens
                + (round_ - 1) * self.answer_tokens)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


# Sends one round's prompt (token ids) for at most `max_tokens` greedy tokens, EOS ignored, at `start_at`
# (perf_counter; now if None or past), and returns what the client saw of it: the session over any server.
Send = Callable[[list[int], int, float | None], StreamTrace]


def client_send(client: Client, **cache: Any) -> Send:
    """`Send` over kvserve's client; `cache` are the request's cache flags (cache_salt, prefix_cache)."""
    def send(prompt: list[int], max_tokens: int, start_at: float | None) -> StreamTrace:
        return timed_stream(client, start_at, token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, **cache)
    return send


def user_session(send: Send, s: Settings, user: int, system: list[int], start_at: float | None,
                 progress: Progress) -> list[StreamTrace]:
    """One user's rounds, each sent when the answer before it is in; a trace per round."""
    rng = random.Random(s.seed * 100_003 + user + 1)  # the same questions with and without the cache
    history, traces = [*system, *random_tokens(rng, s.user_tokens)], []
    for _ in range(s.rounds):
        prompt = history + random_tokens(rng, s.question_tokens)
        trace = send(prompt, s.answer_tokens, start_at)
        traces.append(trace)
        progress.step()
        history, start_at = prompt + trace.token_ids, None
    return traces


def throughput_tok_s(traces: list[list[StreamTrace]]) -> float | None:
    """A session's output tokens per second (traces[user][round]): every token generated over the span from the
    first request sent to the last result; None for an empty span."""
    every = [t for user in traces for t in user]
    span = max(t.end for t in every) - min(t.sent for t in every)
    return sum(len(t.token_ids) for t in every) / span if span > 0 else None


def run_session_with(send: Send, s: Settings, progress: Progress) -> list[list[StreamTrace]]:
    """Every user's session over `send` (any server), the users staggered by 1/rate: traces[user][round]."""
    system = random_tokens(random.Random(s.seed), s.system_tokens)
    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(s.users, thread_name_prefix="bench-user")
    try:
        futures = [pool.submit(user_session, send, s, u, system, t0 + (u / s.rate if s.rate else 0.0), progress)
                   for u in range(s.users)]
        traces = [f.result() for f in futures]
    except BaseException:
        # Ctrl-C or a failed user: no waiting for the other users' rounds; the caller stops the server,
        # which ends their streams.
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return traces


def run_session(client: Client, s: Settings, progress: Progress, **cache: Any) -> list[list[StreamTrace]]:
    """Every user's session on a kvserve stack, the users staggered by 1/rate: traces[user][round]."""
    return run_session_with(client_send(client, **cache), s, progress)
