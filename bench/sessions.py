"""The multi-turn session `kvserve bench multi-turn` sends (straight to a stack, or through the router with
--replicas): users chatting in rounds over a shared system prompt, each round's prompt the history before it."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from bench.report import Progress
from bench.streams import StreamTrace, timed_stream
from client.client import Client


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


def user_session(client: Client, s: Settings, user: int, system: list[int], start_at: float | None,
                 progress: Progress, **cache: Any) -> list[StreamTrace]:
    """One user's rounds, each sent when the answer before it is in; a trace per round."""
    rng = random.Random(s.seed * 100_003 + user + 1)  # the same questions with and without the cache
    history, traces = [*system, *random_tokens(rng, s.user_tokens)], []
    for _ in range(s.rounds):
        prompt = history + random_tokens(rng, s.question_tokens)
        trace = timed_stream(client, start_at, token_ids=prompt, max_tokens=s.answer_tokens, ignore_eos=True, **cache)
        traces.append(trace)
        progress.step()
        history, start_at = prompt + trace.token_ids, None
    return traces


def run_session(client: Client, s: Settings, progress: Progress, **cache: Any) -> list[list[StreamTrace]]:
    """Every user's session, the users staggered by 1/rate: traces[user][round]."""
    system = random_tokens(random.Random(s.seed), s.system_tokens)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(s.users, thread_name_prefix="bench-user") as pool:
        futures = [pool.submit(user_session, client, s, u, system, t0 + (u / s.rate if s.rate else 0.0), progress,
                               **cache) for u in range(s.users)]
        return [f.result() for f in futures]
