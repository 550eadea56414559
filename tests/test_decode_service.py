"""The decode service (the front door) in process, with a real prefill server and an in-memory
store: tokens against the HF oracle, the hand-off and its failures, stop conditions, the reply's
blocks reused by the next turn, concurrent streams, cancellation, statuses and metrics."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import pytest

from client import Client
from client.client import Chunk, KVServeError, Result, build_request
from kvserve.engine.hashing import prefix_hashes
from kvserve.handoff.requests import PrefillHandle
from kvserve.rpc.errors import Unavailable
from prefill_service.client import PrefillClient, PrefillReplicas
from prefill_service.service import PrefillJob
from protos.kvserve.v1 import decode_pb2_grpc
from tests.model_faults import FaultyForward, at_position, never
from tests.polling import wait_until
from tests.stack_fixtures import (
    BLOCK_SIZE,
    LocalStack,
    assert_greedy_matches,
    greedy,
    oracle,
    stack_fixture,
    tokens,
)

ARCH = "qwen2"


stack = stack_fixture(LocalStack, ARCH)


@pytest.fixture(scope="module")
def client(stack: LocalStack) -> Iterator[Client]:
    with Client(stack.addr, timeout_s=60) as c:
        yield c


def test_cold_and_warm_match_the_oracle(stack: LocalStack, client: Client) -> None:
    ids = tokens(3 * BLOCK_SIZE + 5, seed=11)
    want, logits = oracle(ARCH, ids, 24)
    cold = greedy(client, ids, 24)
    assert_greedy_matches(cold.token_ids, want, logits)
    assert cold.finish_reason == "length" and cold.prompt_token_ids == tuple(ids)
    assert (cold.usage.prompt_tokens, cold.usage.cached_tokens, cold.usage.completion_tokens) == (len(ids), 0, 24)
    warm = greedy(client, ids, 24)
    assert warm.token_ids == cold.token_ids and warm.usage.cached_tokens == 3 * BLOCK_SIZE
    t = warm.timings
    assert 0 < t.ttft_s <= t.total_s and t.prefill_s <= t.ttft_s and t.decode_s <= t.total_s


def test_stream_chunks_add_up_to_the_result(client: Client) -> None:
    items = list(client.stream(token_ids=tokens(40, seed=12), max_tokens=30, ignore_eos=True))
    chunks, result = items[:-1], items[-1]
    assert isinstance(result, Result) and all(isinstance(c, Chunk) for c in chunks)
    assert tuple(c.token_id for c in chunks) == result.token_ids  # type: ignore[union-attr]
    assert "".join(c.text for c in chunks) == result.text  # type: ignore[union-attr]


def test_reply_blocks_are_stored_for_the_next_turn(stack: LocalStack, client: Client) -> None:
    turn1 = tokens(2 * BLOCK_SIZE + 3, seed=13)
    r1 = greedy(client, turn1, 40)
    turn2 = [*turn1, *r1.token_ids, *tokens(10, seed=14)]
    root = stack.decode.engine.namespace().root()
    stored = prefix_hashes([*turn1, *r1.token_ids], BLOCK_SIZE, root)
    assert set(stored[: (len(turn1) + 39) // BLOCK_SIZE]) <= stack.store.persistent_keys()
    r2 = greedy(client, turn2, 8)
    assert r2.usage.cached_tokens >= len(turn1) + len(r1.token_ids) - 2 * BLOCK_SIZE
    want, logits = oracle(ARCH, turn2, 8)
    assert_greedy_matches(r2.token_ids, want, logits)


def test_missing_and_corrupt_blocks_are_recomputed_by_decode(stack: LocalStack, client: Client) -> None:
    ids = tokens(4 * BLOCK_SIZE + 9, seed=15)
    want, logits = oracle(ARCH, ids, 12)
    before = stack.decode_metric("kvserve_decode_recomputed_tokens_total")
    real_get = stack.store.get

    def damaged_get(hashes: Sequence[bytes]) -> list[bytes | None]:
        if len(hashes) == 5:  # decode's fetch: 4 blocks + tail
            stack.store.corrupt(hashes[1])  # its bytes fail their checksum: the client reports a miss
            stack.store.blocks.pop(hashes[4], None)
        return real_get(hashes)

    stack.store.get = damaged_get  # type: ignore[method-assign,assignment]
    try:
        r = greedy(client, ids, 12)
    finally:
        stack.store.get = real_get  # type: ignore[method-assign]
    assert_greedy_matches(r.token_ids, want, logits)
    assert stack.decode_metric("kvserve_decode_recomputed_tokens_total") - before == len(ids) - BLOCK_SIZE
    assert stack.store.checksum_failures >= 1


def test_prefill_failing_after_the_first_token_leaves_decode_to_compute_the_prompt(
    stack: LocalStack, client: Client, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The first token has gone to the client before prefill has stored the prompt's KV; if prefill then
    # fails, the answer still completes, decode computing what it cannot fetch.
    ids = tokens(3 * BLOCK_SIZE + 6, seed=17)
    want, logits = oracle(ARCH, ids, 10)

    prefill_stream = stack.prefill.prefill_stream

    def fails_after_the_first_token(job: PrefillJob) -> Iterator[PrefillHandle]:
        handles = prefill_stream(job)
        yield next(handles)  # the first token, its KV not yet in the store
        handles.close()
        raise Unavailable("the prefill service lost its store")

    monkeypatch.setattr(stack.prefill, "prefill_stream", fails_after_the_first_token)
    assert_greedy_matches(greedy(client, ids, 10, cache_salt="after-first-token").token_ids, want, logits)
    assert "prefill failed after the first token" in caplog.text


def test_an_unavailable_prefill_replica_is_skipped(stack: LocalStack, client: Client,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica where nothing listens (a prefill service restarting) answers UNAVAILABLE: it is marked
    down and the request asked of the next one; later requests skip it while it is down."""
    ids = tokens(2 * BLOCK_SIZE + 3, seed=19)
    want, logits = oracle(ARCH, ids, 6)
    real = stack.decode.prefill.clients[0]
    dead = PrefillClient("127.0.0.1:1", timeout_s=5)
    replicas = PrefillReplicas([dead, real], down_s=60)
    started = {dead.addr: 0, real.addr: 0}
    for c in (dead, real):
        monkeypatch.setattr(c, "start", counted(c.start, started, c.addr))
    monkeypatch.setattr(stack.decode, "prefill", replicas)
    try:
        for _ in range(3):
            assert_greedy_matches(greedy(client, ids, 6).token_ids, want, logits)
    finally:
        dead.close()
    assert started == {dead.addr: 1, real.addr: 3}


def test_the_only_prefill_is_asked_once_more_when_unavailable(stack: LocalStack, client: Client,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    ids = tokens(2 * BLOCK_SIZE + 3, seed=20)
    want, logits = oracle(ARCH, ids, 6)
    real = stack.decode.prefill.clients[0]
    dead = PrefillClient("127.0.0.1:1", timeout_s=5)
    calls: list[str] = []
    real_start = real.start

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls.append("call")
        return (dead.start if len(calls) == 1 else real_start)(*args, **kwargs)

    monkeypatch.setattr(stack.decode, "prefill", PrefillReplicas([real]))
    monkeypatch.setattr(real, "start", flaky)
    try:
        assert_greedy_matches(greedy(client, ids, 6).token_ids, want, logits)
    finally:
        dead.close()
    assert len(calls) == 2


def counted(fn: Any, counts: dict[str, int], key: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        counts[key] += 1
        return fn(*args, **kwargs)
    return call


def test_store_down_still_answers(stack: LocalStack, client: Client) -> None:
    seen, fresh = tokens(2 * BLOCK_SIZE + 2, seed=16), tokens(2 * BLOCK_SIZE + 2, seed=160)
    greedy(client, seen, 4)
    stack.store.down = True
    try:
        again, first = greedy(client, seen, 10), greedy(client, fresh, 10)
    finally:
        stack.store.down = False
    assert again.usage.cached_tokens == 2 * BLOCK_SIZE  # from prefill's own KV pool: no store needed
    assert first.usage.cached_tokens == 0
    assert_greedy_matches(again.token_ids, *oracle(ARCH, seen, 10))
    assert_greedy_matches(first.token_ids, *oracle(ARCH, fresh, 10))
    # Decode's lookup fails and ends the store's part in its request (no Get to wait out); prefill, told the
    # store holds nothing, looks nothing up: its put fails.
    assert stack.decode_metric("kvserve_decode_store_failures_total", op="lookup") >= 2
    assert stack.prefill_metric("kvserve_prefill_store_failures_total", op="put") >= 1


def test_prefix_cache_off_computes_everything_and_stores_nothing_shared(stack: LocalStack, client: Client) -> None:
    ids = tokens(3 * BLOCK_SIZE, seed=17)
    before = stack.store.persistent_keys()
    r = greedy(client, ids, 20, prefix_cache=False)
    assert r.usage.cached_tokens == 0 and stack.store.persistent_keys() == before
    assert_greedy_matches(r.token_ids, *oracle(ARCH, ids, 20))
    assert greedy(client, ids, 20, prefix_cache=False).usage.cached_tokens == 0


def test_stop_strings_and_max_tokens(client: Client) -> None:
    ids = tokens(30, seed=18)
    full = greedy(client, ids, 30)
    text = full.text
    cut = next(i for i in range(3, len(text)) if text[i - 1 : i + 1].isprintable())
    stop = text[cut - 1 : cut + 1]
    first = text.find(stop)
    r = greedy(client, ids, 30, stop=(stop,))
    assert r.finish_reason == "stop" and r.text == text[:first]
    assert r.token_ids == full.token_ids[: len(r.token_ids)]
    one = greedy(client, ids, 1)
    assert one.token_ids == full.token_ids[:1] and one.finish_reason == "length"


def test_seeded_sampling_is_reproducible(client: Client) -> None:
    ids = tokens(20, seed=19)
    a = client.generate(token_ids=ids, max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
    b = client.generate(token_ids=ids, max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
    assert a.token_ids == b.token_ids


def test_concurrent_streams_give_the_tokens_of_sequential_ones(stack: LocalStack, client: Client) -> None:
    prompts = [tokens(10 + 13 * i, seed=100 + i) for i in range(6)]
    alone = [greedy(client, p, 20 + i).token_ids for i, p in enumerate(prompts)]
    together: list[tuple[int, ...] | None] = [None] * len(prompts)

    def run(i: int) -> None:
        together[i] = greedy(client, prompts[i], 20 + i).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert together == alone
    assert stack.decode_metric("kvserve_decode_engine_batch_sequences_bucket", le="1.0") < stack.decode_metric(
        "kvserve_decode_engine_batch_sequences_count"
    )  # some forwards ran several sequences


def test_a_cancelled_stream_stops_its_work(stack: LocalStack) -> None:
    before = stack.decode_metric("kvserve_decode_requests_total", outcome="cancelled")
    with grpc.insecure_channel(stack.addr) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        call = stub.Generate(build_request(token_ids=tokens(20, seed=20), max_tokens=3000, ignore_eos=True))
        for i, _ in enumerate(call):
            if i == 5:
                call.cancel()
                break
    # The handler counts the request; the decode loop drops the sequence at its next step.
    wait_until(lambda: stack.decode_metric("kvserve_decode_requests_total", outcome="cancelled") != before
               and stack.decode_metric("kvserve_decode_running_requests") == 0,
               interval_s=0.02, message="the cancelled request never ended")
    assert stack.decode_metric("kvserve_decode_waiting_requests") == 0
    assert stack.decode_metric("kvserve_decode_generated_tokens_total") < 3000


def test_hanging_up_after_the_result_is_not_a_cancellation(stack: LocalStack) -> None:
    ok = stack.decode_metric("kvserve_decode_requests_total", outcome="ok")
    cancelled = stack.decode_metric("kvserve_decode_requests_total", outcome="cancelled")
    with grpc.insecure_channel(stack.addr) as channel:
        call = decode_pb2_grpc.DecodeStub(channel).Generate(build_request(token_ids=tokens(20, seed=21), max_tokens=3))
        for msg in call:
            if msg.WhichOneof("kind") == "result":
                call.cancel()  # hang up right after the result, before the stream's end
                break
    wait_until(lambda: stack.decode_metric("kvserve_decode_requests_total", outcome="ok") != ok,
               interval_s=0.02, message="the request was not counted as ok")
    assert stack.decode_metric("kvserve_decode_requests_total", outcome="cancelled") == cancelled


def test_bad_input_gets_a_precise_status(client: Client) -> None:
    from client.client import InvalidArgumentError, OutOfRangeError

    with pytest.raises(InvalidArgumentError, match="temperature"):
        client.generate("hi", temperature=-2.0)
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        client.generate(token_ids=[1, 10**6])
    with pytest.raises(OutOfRangeError, match="4096 positions"):
        client.generate("hi", max_tokens=5000)
    with pytest.raises(OutOfRangeError, match="shorter than 4096 tokens"):
        client.generate(token_ids=[1] * 5000)
    with pytest.raises(InvalidArgumentError, match="unknown chat role"):
        client.chat([{"role": "robot", "content": "hi"}])


def test_a_request_refused_for_bad_input_is_counted(stack: LocalStack, client: Client) -> None:
    from client.client import InvalidArgumentError

    def refused() -> float:
        return stack.decode_metric("kvserve_decode_requests_total", outcome="invalid_argument")

    before = refused()
    with pytest.raises(InvalidArgumentError, match="temperature"):  # refused before the service takes it
        client.generate("hi", temperature=-2.0)
    with pytest.raises(InvalidArgumentError, match="unknown chat role"):
        client.chat([{"role": "robot", "content": "hi"}])
    assert refused() - before == 2


def test_a_request_arriving_past_the_waiting_bound_is_refused_and_counted(stack: LocalStack) -> None:
    """Decode's admission bound is checked as a Generate call arrives (decode_service.server.add_to_server): the
    call is refused with a hint and counted, and served once the waiting work drops."""
    from client.client import ResourceExhaustedError

    admission = stack.decode.admission
    saved = admission.max_seqs
    before = stack.decode_metric("kvserve_decode_requests_total", outcome="resource_exhausted")
    admission.max_seqs = 1
    ticket = admission.admit(10)  # one request waits: the bound of one is reached
    try:
        with Client(stack.addr, timeout_s=60, busy_retries=0) as c:
            with pytest.raises(ResourceExhaustedError, match="--max-waiting-seqs"):
                greedy(c, tokens(20, seed=41), 2)
            assert stack.decode_metric("kvserve_decode_requests_total", outcome="resource_exhausted") == before + 1
            ticket.release()
            assert len(greedy(c, tokens(20, seed=41), 2).token_ids) == 2
    finally:
        ticket.release()
        admission.max_seqs = saved


def test_a_prefill_past_its_waiting_bound_refuses_as_the_call_arrives_and_decode_computes_the_prompt(
        stack: LocalStack, client: Client) -> None:
    """Prefill's admission bound is checked as its calls arrive (prefill_service.server.add_to_server): decode's
    call is refused and counted there, and decode computes the prompt itself, with the oracle's tokens."""
    admission = stack.prefill.admission
    saved = admission.max_seqs
    refused = stack.prefill_metric("kvserve_prefill_requests_total", outcome="resource_exhausted")
    overloaded = stack.decode_metric("kvserve_decode_prefill_fallbacks_total", reason="overloaded")
    admission.max_seqs = 1
    ticket = admission.admit(10)
    try:
        ids = tokens(2 * BLOCK_SIZE + 7, seed=42)
        want, logits = oracle(ARCH, ids, 6)
        assert_greedy_matches(greedy(client, ids, 6).token_ids, want, logits)
        assert stack.prefill_metric("kvserve_prefill_requests_total", outcome="resource_exhausted") > refused
        assert stack.decode_metric("kvserve_decode_prefill_fallbacks_total", reason="overloaded") == overloaded + 1
    finally:
        ticket.release()
        admission.max_seqs = saved


ISSUE_METRICS = (  # issue 4, item 7; then the engine's (issue 8, item 9)
    "requests_total", "prompt_tokens_total", "cached_tokens_total", "computed_tokens_total",
    "generated_tokens_total", "ttft_seconds_bucket", "running_requests", "waiting_requests",
    "engine_batch_sequences_bucket", "engine_batch_tokens_bucket", "engine_kv_blocks", "engine_preemptions_total",
    "engine_pool_hit_tokens_total", "engine_queue_wait_seconds_bucket", "engine_running_sequences",
    "engine_waiting_sequences", "engine_forward_seconds_total", "engine_forward_off_core_seconds_total",
)


def test_metrics_are_served(stack: LocalStack) -> None:
    for server, prefix, extra in ((stack.decode_server, "kvserve_decode_", ("inter_token_latency_seconds_bucket",)),
                                  (stack.prefill_server, "kvserve_prefill_", ())):
        url = f"http://127.0.0.1:{server.bound_metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")}
        missing = {prefix + name for name in (*ISSUE_METRICS, *extra)} - names
        assert not missing, f"{url} lacks {sorted(missing)}"
    assert stack.decode_metric("kvserve_decode_inter_token_latency_seconds_count") > 0
    assert stack.decode_metric("kvserve_decode_generated_tokens_total") > 0


def test_health_and_reflection_on_both_services(stack: LocalStack) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for addr, service in ((stack.addr, "kvserve.v1.Decode"), (stack.prefill_addr, "kvserve.v1.Prefill")):
        with grpc.insecure_channel(addr) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", service):
                reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            [answer] = list(reflection.ServerReflectionInfo(iter([ask]), timeout=5))
            listed = {s.name for s in answer.list_services_response.service}
            assert {service, "grpc.health.v1.Health"} <= listed


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_client_that_goes_away_during_prefill_stops_the_prefill(how: str) -> None:
    gate, held = threading.Event(), threading.Event()

    def hold(positions: object) -> bool:  # prefill's forwards wait at the gate until it opens
        held.set()
        gate.wait(30)
        return False

    stack = LocalStack(ARCH, wrap_prefill_model=FaultyForward(hold).around)
    answers: list[Result] = []
    blocker = threading.Thread(target=lambda: answers.append(Client(stack.addr, timeout_s=60).generate(
        token_ids=tokens(20, seed=22), max_tokens=2)))
    try:
        blocker.start()
        wait_until(held.is_set, interval_s=0.02, message="no forward holds prefill's engine")
        with grpc.insecure_channel(stack.addr) as channel:
            stub = decode_pb2_grpc.DecodeStub(channel)
            request = build_request(token_ids=tokens(50, seed=21), max_tokens=4)
            call = stub.Generate(request, timeout=None if how == "cancel" else 0.5)
            wait_until(lambda: stack.prefill_metric("kvserve_prefill_running_requests") == 2, interval_s=0.02,
                       message="the prefill was never queued")
            if how == "cancel":
                call.cancel()
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() == (  # type: ignore[attr-defined]
                grpc.StatusCode.CANCELLED if how == "cancel" else grpc.StatusCode.DEADLINE_EXCEEDED)
            # It ends before the gate opens: it left the engine's queue. Past the deadline the caller is
            # gone too: either status may come first.
            wait_until(lambda: stack.prefill_metric("kvserve_prefill_requests_total", outcome="cancelled")
                       + stack.prefill_metric("kvserve_prefill_requests_total", outcome="deadline_exceeded") == 1,
                       interval_s=0.02, message="the prefill request never ended")
        gate.set()
        blocker.join(30)
        assert len(answers) == 1  # the request that held the engine was answered
        wait_until(lambda: stack.prefill_metric("kvserve_prefill_running_requests") == 0, interval_s=0.02,
                   message="prefill never went idle")
        assert stack.prefill_metric("kvserve_prefill_computed_tokens_total") == 20  # the blocker's prompt only
        assert stack.decode_metric("kvserve_decode_waiting_requests") == 0
    finally:
        gate.set()
        stack.close()


def test_an_engine_failure_fails_only_the_affected_request() -> None:
    victim, bystander = tokens(20, seed=22), tokens(50, seed=23)
    want, logits = oracle(ARCH, bystander, 30)
    fault = FaultyForward(at_position(len(victim) + 5))  # the victim's sixth decode step
    s = LocalStack(ARCH, wrap_decode_model=fault.around)
    try:
        with Client(s.addr, timeout_s=60) as client:
            results: dict[str, object] = {}

            def run(name: str, ids: list[int], n: int) -> None:
                try:
                    results[name] = greedy(client, ids, n)
                except KVServeError as exc:
                    results[name] = exc

            threads = [threading.Thread(target=run, args=("victim", victim, 20)),
                       threading.Thread(target=run, args=("bystander", bystander, 30))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            error = results["victim"]
            assert isinstance(error, KVServeError) and error.code == grpc.StatusCode.INTERNAL
            assert "injected fault" in error.details
            survivor = results["bystander"]
            assert isinstance(survivor, Result), f"the bystander failed too: {survivor}"
            assert_greedy_matches(survivor.token_ids, want, logits)

            # A step whose forward fails for every sequence fails every request in it; the loop goes on.
            fault.fails = never
            streams = [client.stream(token_ids=ids, max_tokens=1000, ignore_eos=True) for ids in (victim, bystander)]
            for stream in streams:  # both decoding: prefill's first token, then one of the decode loop's
                assert isinstance(next(stream), Chunk) and isinstance(next(stream), Chunk)
            fault.message, fault.fails = "injected batch fault", lambda positions: True
            for stream in streams:
                with pytest.raises(KVServeError, match="injected batch fault") as info:
                    for _ in stream:
                        pass
                assert info.value.code == grpc.StatusCode.INTERNAL
            fault.fails = never
            assert_greedy_matches(greedy(client, bystander, 30).token_ids, want, logits)
        wait_until(lambda: s.decode_metric("kvserve_decode_running_requests") == 0, interval_s=0.02,
                   message="a request still runs")
        assert s.decode_metric("kvserve_decode_requests_total", outcome="internal") == 3
        assert s.decode_metric("kvserve_decode_requests_total", outcome="ok") == 2
    finally:
        s.close()
