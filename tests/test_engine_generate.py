"""One sequence through the engine: greedy output equals Hugging Face ``generate`` (the oracle), and the
events a request thread hears: tokens, the reason on the last one, and one Finished, whether the engine
stops the sequence (length, stop token), a client aborts it, or the engine shuts down."""

from __future__ import annotations

import time

import pytest
import torch

from kvserve.engine.engine import Engine
from kvserve.engine.sequence import Event, Finished, Sequence, TokenEvent
from tests.engine_fixtures import (
    ARCHS,
    DictStore,
    GatedSource,
    PrefixSource,
    assert_greedy_matches,
    assert_matches_oracle,
    collect,
    finish,
    make_engine,
    make_seq,
    oracle,
    random_tokens,
    run,
    tiny_model,
)

BLOCK = 8
MAX_NEW_TOKENS = 24
WAIT_S = 30.0


def _events(seq: Sequence) -> list[Event]:
    """Every event of ``seq``, up to its Finished."""
    events: list[Event] = []
    while not events or not isinstance(events[-1], Finished):
        events.append(seq.events.get(timeout=WAIT_S))
    return events


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prompt_len", [1, 5, 40])
def test_greedy_equals_hf_generate(arch: str, prompt_len: int) -> None:
    model = tiny_model(arch)
    seq = make_seq(model, random_tokens(prompt_len, seed=prompt_len), MAX_NEW_TOKENS)
    (outcome,) = run(make_engine(model, BLOCK, 32), [seq])
    assert_matches_oracle(model, seq, outcome)


def test_tokens_stream_with_the_reason_on_the_last() -> None:
    model = tiny_model("llama")
    seq = make_seq(model, random_tokens(13, seed=2), 6)
    engine = make_engine(model, BLOCK, 16)
    engine.add(seq)
    finish(engine, [])
    events = _events(seq)
    assert [type(e) for e in events] == [TokenEvent] * 6 + [Finished]
    assert [e.finish_reason for e in events[:-1]] == [None] * 5 + ["length"]  # type: ignore[union-attr]
    assert events[-1] == Finished("length")
    assert seq.output_token_ids == [e.token_id for e in events[:-1]]  # type: ignore[union-attr]


def test_a_stop_token_ends_the_stream_on_it() -> None:
    model = tiny_model("qwen2")
    prompt = random_tokens(20, seed=3)
    expected, _ = oracle(model, prompt, MAX_NEW_TOKENS)
    stop = expected[5]
    cut = expected.index(stop)  # its first occurrence, at 5 or before
    seq = make_seq(model, prompt, MAX_NEW_TOKENS, stop_token_ids=frozenset({stop, 100_000}))
    engine = make_engine(model, BLOCK, 16)
    engine.add(seq)
    finish(engine, [])
    events = _events(seq)
    assert [e.token_id for e in events[:-1]] == expected[: cut + 1]  # type: ignore[union-attr]
    assert events[-2] == TokenEvent(stop, "stop") and events[-1] == Finished("stop")


def test_abort_ends_a_running_or_waiting_sequence_and_frees_its_blocks() -> None:
    model = tiny_model("llama")
    engine = make_engine(model, BLOCK, 8, max_num_seqs=1)
    source = PrefixSource(DictStore(), engine.namespace())
    running = make_seq(model, random_tokens(20, seed=4), 30, source=source)
    waiting = make_seq(model, random_tokens(9, seed=5), 30)
    engine.add(running)
    engine.add(waiting)
    while running.num_new_tokens < 3:
        engine.step()
    assert engine.scheduler.waiting[0] is waiting
    engine.abort(running, save=True)
    engine.abort(waiting)
    a, b = finish(engine, [running, waiting])
    assert (a.finished, b.finished) == (Finished("aborted"), Finished("aborted"))
    assert len(a.tokens) == 3 and b.tokens == []
    # Saved on the way out: every token with KV (the last sampled one has none yet).
    assert source.saves[-1].num_tokens == running.num_computed_tokens == 22
    assert len(source.store.blocks) == 22 // BLOCK


def test_the_step_thread_serves_request_threads_and_stop_ends_what_is_left() -> None:
    model = tiny_model("gpt2")
    engine = Engine(model, BLOCK, kv_cache_memory=1 << 20)
    engine.start()
    try:
        seqs = [make_seq(model, random_tokens(n, seed=n), 10) for n in (3, 17, 30)]
        for seq in seqs:
            engine.add(seq)
        for seq in seqs:
            assert_matches_oracle(model, seq, collect(seq, WAIT_S))
        endless = make_seq(model, random_tokens(8, seed=6), 1000)
        engine.add(endless)
        assert isinstance(endless.events.get(timeout=WAIT_S), TokenEvent)
    finally:
        engine.stop()
    assert _events(endless)[-1] == Finished("shutdown", "the engine is shutting down")
    engine.pool.check_integrity()
    assert engine.pool.num_used == 0
    with pytest.raises(RuntimeError, match="stopped"):
        engine.add(make_seq(model, [1, 2, 3], 1))


def test_kv_io_threads_run_their_kernels_on_one_core() -> None:
    """Only the step thread may keep an OpenMP team (engine.engine's docstring); the step thread's own
    thread count is left as it was."""
    threads = torch.get_num_threads()
    engine = Engine(tiny_model("llama"), BLOCK, kv_cache_memory=1 << 20)
    try:
        assert engine.connector.io.submit(torch.get_num_threads).result(timeout=WAIT_S) == 1
        assert torch.get_num_threads() == threads
    finally:
        engine.stop()


def test_an_empty_sequence_is_refused() -> None:
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="empty"):
        make_engine(model, BLOCK, 4).add(make_seq(model, [], 1))


def test_near_tie_helper() -> None:
    tie = torch.tensor([1.0, 1.0005, -3.0])
    clear = torch.tensor([1.0, 2.0, -3.0])
    assert_greedy_matches([0, 7], [1, 2], [tie, clear])  # diverged at a near-tie: allowed
    with pytest.raises(AssertionError):
        assert_greedy_matches([0], [1], [clear])
    with pytest.raises(AssertionError):
        assert_greedy_matches([1], [1, 2], [clear, clear])


def test_a_finished_sequence_is_saved_straight_from_its_pool_slots_which_stay_in_use_until_then() -> None:
    model = tiny_model("llama")
    engine = make_engine(model, BLOCK, 16)
    source = GatedSource(DictStore(), engine.namespace())
    prompt = random_tokens(4 * BLOCK + 3, seed=41)
    first = make_seq(model, prompt, 1, source=source)
    engine.add(first)
    while first.num_computed_tokens < len(prompt):
        engine.step()
    assert engine.pool.num_used == 5  # retained for the save: no other sequence can be given them
    other = make_seq(model, random_tokens(10 * BLOCK, seed=42), 2)
    engine.add(other)
    engine.step()
    assert engine.pool.num_used == 5 + 10
    source.gate.set()
    (outcome,) = finish(engine, [other])
    assert collect(first).finished.reason == "length" and engine.pool.num_used == 0
    fresh = make_engine(model, BLOCK, 16)
    alone = PrefixSource(DictStore(), fresh.namespace())
    run(fresh, [make_seq(model, prompt, 1, source=alone)])
    assert torch.equal(source.saves[0].kv, alone.saves[0].kv)  # the slots were not given to `other` meanwhile


def test_saves_in_flight_at_shutdown_leave_no_block_in_use() -> None:
    model = tiny_model("llama")
    engine = make_engine(model, BLOCK, 16)
    source = GatedSource(DictStore(), engine.namespace())
    seq = make_seq(model, random_tokens(2 * BLOCK, seed=43), 1, source=source)
    engine.start()
    engine.add(seq)
    deadline = time.monotonic() + WAIT_S
    while not engine.connector.num_retained and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.connector.num_retained
    engine.stop()
    source.gate.set()
    engine.pool.check_integrity()
    assert engine.pool.num_used == 0
