"""A request that can never run is refused as such whatever the load: 400 (OUT_OF_RANGE past the model's
positions) or 413 (RESOURCE_EXHAUSTED without a retry hint past the KV pool), never 429, which a client
retries. Decode in process, made busy by requests holding its admission, behind the HTTP front, gRPC and
the router; before, admission ran first and called such a request busy. At the waiting bound decode refuses
every request before tokenizing it: there, what its size alone tells (token ids counted, a text's bytes over
the most one token covers) is what it checks."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import grpc
import pytest

from client import Client
from client.client import OutOfRangeError, ResourceExhaustedError, build_request
from kvserve.router.router import DECODE_SERVICE, Router
from kvserve.router.server import RouterServicer
from kvserve.rpc.server import Server
from protos.kvserve.v1 import decode_pb2_grpc
from protos.retry import retry_after_s
from tests.polling import wait_until
from tests.stack_fixtures import LocalStack
from tests.test_engine_model import NoTokenizing
from tests.test_http_schema import MODEL, http_front, post

ARCH = "qwen2"  # 4096 positions
POSITIONS = 4096
POOL_BYTES = 3 << 20  # decode's KV pool: 128 blocks of 16 tokens, 2048 tokens
N = 20  # each request, sent this many times under load

PAST_POSITIONS = [1] * 5000
PAST_POOL = [1] * 3000  # fits the positions, not the pool
HUGE = 100_000
HUGE_IDS = [1] * HUGE
HUGE_TEXT = "hello " * HUGE  # 600 kB: 100k tokens where " hello" is one (SmolLM2's vocabulary), 600k here


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalStack]:
    with LocalStack(ARCH, decode_kv_cache_memory=POOL_BYTES) as s:
        assert (s.decode.engine.pool.num_blocks, s.decode.engine.model.max_positions) == (128, POSITIONS)
        yield s


@pytest.fixture(scope="module")
def front(stack: LocalStack) -> Iterator[tuple[str, int]]:
    with http_front(stack.addr) as f:
        yield f


@pytest.fixture(scope="module")
def routed(stack: LocalStack) -> Iterator[str]:
    """A router in front of the decode replica; its address."""
    router = Router([stack.addr], policy="least-loaded", poll_s=0.1)
    router.start()
    server = Server("127.0.0.1:0")
    server.add(decode_pb2_grpc.add_DecodeServicer_to_server, RouterServicer(router), DECODE_SERVICE)
    port = server.start()
    wait_until(lambda: router.num_healthy >= 1, interval_s=0.02, message="the router never saw its replica healthy")
    yield f"127.0.0.1:{port}"
    server.stop(0)
    router.close()


@contextlib.contextmanager
def busy(stack: LocalStack, how: str) -> Iterator[None]:
    """Decode's admission held by a request that waits, so that it refuses, as busy, any request of more than a
    few tokens ("tokens": the waiting tokens near --max-waiting-tokens) or any with a deadline ("deadline": the
    tokens waiting take longer than it at the measured rate), while calls still arrive and are read."""
    admission = stack.decode.admission
    saved = admission.max_tokens, admission.rate
    admission.max_tokens = 256
    ticket = admission.admit(200)
    if how == "deadline":
        admission.max_tokens, admission.rate = saved[0], 0.1  # 200 tokens ahead: 2,000 s
    try:
        yield
        assert (admission.seqs, admission.tokens) == (1, 200)  # nothing else got in
    finally:
        ticket.release()
        admission.max_tokens, admission.rate = saved


@contextlib.contextmanager
def at_bound(stack: LocalStack) -> Iterator[None]:
    """Decode's waiting tokens at their bound (one request that waits holds them all), so that it refuses any request
    as busy, with a hint, before it tokenizes it: meanwhile the model's tokenizer fails the request that calls it."""
    admission, engine = stack.decode.admission, stack.decode.engine
    saved, model = admission.max_tokens, engine.model
    admission.max_tokens = 200
    ticket = admission.admit(200)
    engine.model = replace(model, tokenizer=NoTokenizing())
    try:
        yield
        assert (admission.seqs, admission.tokens) == (1, 200)  # nothing else got in
    finally:
        engine.model = model
        ticket.release()
        admission.max_tokens = saved


def grpc_refusals(addr: str, request: Any) -> Counter[tuple[str, bool]]:
    """Each status of `request` sent N times to Generate at `addr`, with whether it carried a retry hint."""
    seen: Counter[tuple[str, bool]] = Counter()
    with grpc.insecure_channel(addr) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        for _ in range(N):
            try:
                list(stub.Generate(request, timeout=60))
                seen["OK", False] += 1
            except grpc.RpcError as exc:
                seen[exc.code().name, retry_after_s(exc) is not None] += 1  # type: ignore[attr-defined]
    return seen


def too_long_chat(stack: LocalStack) -> list[dict[str, str]]:
    """A chat message that tokenizes past the positions, yet not so long that decode refuses it from its length
    alone, before it tokenizes."""
    content = "hello " * 5000
    assert len(stack.decode.engine.model.tokenizer(content)["input_ids"]) > POSITIONS
    assert len(content) * 4 < POSITIONS * stack.decode.engine.model.max_token_bytes
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize("how", ["tokens", "deadline"])
def test_a_request_that_never_fits_is_400_or_413_over_http_under_load_never_429(
        stack: LocalStack, front: tuple[str, int], how: str) -> None:
    cases = [  # endpoint, body, status, what the message says
        ("/v1/completions", {"model": MODEL, "prompt": PAST_POSITIONS, "max_tokens": 2}, 400,
         f"the prompt has 5000 tokens; the model takes at most {POSITIONS} positions"),
        ("/v1/completions", {"model": MODEL, "prompt": [1] * 100, "max_tokens": 4090}, 400,
         "prompt (100 tokens) + max_tokens (4090) = 4190 exceeds the model's 4096 positions: ask for at most 3996"),
        ("/v1/chat/completions", {"model": MODEL, "messages": too_long_chat(stack), "max_tokens": 2}, 400,
         f"the model takes at most {POSITIONS} positions"),
        ("/v1/completions", {"model": MODEL, "prompt": PAST_POOL, "max_tokens": 16}, 413,
         "3000 prompt tokens + 16 to generate need 189 KV blocks of 16 tokens; the KV pool holds 128"),
    ]
    fits = {"model": MODEL, "prompt": [1] * 100, "max_tokens": 2}
    with busy(stack, how):
        status, answer = post(front, "/v1/completions", fits)
        assert status == 429 and "busy" in answer["error"]["message"]  # the load is real
        for path, body, want, message in cases:
            seen: Counter[int] = Counter()
            for _ in range(N):
                status, answer = post(front, path, body)
                seen[status] += 1
                assert message in answer["error"]["message"]
            assert seen == {want: N}, (path, message, seen)
    assert post(front, "/v1/completions", fits)[0] == 200


def test_a_request_that_never_fits_is_refused_for_good_over_grpc_and_the_router_under_load(
        stack: LocalStack, routed: str) -> None:
    past_positions = build_request(token_ids=PAST_POSITIONS, max_tokens=2)
    past_pool = build_request(token_ids=PAST_POOL, max_tokens=16)
    resumed = build_request(token_ids=PAST_POSITIONS, max_tokens=2)
    resumed.resume_token_ids.extend([5, 6])  # a stream a router moves here
    resumed_past_max = build_request(token_ids=[1] * 10, max_tokens=2)
    resumed_past_max.resume_token_ids.extend([5, 6, 7])
    with busy(stack, "tokens"):
        for addr in (stack.addr, routed):
            assert grpc_refusals(addr, past_positions) == {("OUT_OF_RANGE", False): N}
            assert grpc_refusals(addr, past_pool) == {("RESOURCE_EXHAUSTED", False): N}
            assert grpc_refusals(addr, resumed) == {("OUT_OF_RANGE", False): N}
            assert grpc_refusals(addr, resumed_past_max) == {("INVALID_ARGUMENT", False): N}
        with Client(routed, timeout_s=60) as client:  # retries a busy refusal, not these
            with pytest.raises(OutOfRangeError, match="5000 tokens"):
                client.generate(token_ids=PAST_POSITIONS, max_tokens=2)
            with pytest.raises(ResourceExhaustedError, match="the KV pool holds 128"):
                client.generate(token_ids=PAST_POOL, max_tokens=16)


def tokens_at_least(stack: LocalStack, num_bytes: int) -> int:
    """The fewest tokens a text of `num_bytes` can take for decode's model: no token covers more of it."""
    return -(-num_bytes // stack.decode.engine.model.max_token_bytes)


def test_a_prompt_that_can_never_fit_is_400_at_the_waiting_bound_never_429(
        stack: LocalStack, front: tuple[str, int]) -> None:
    text, content = len(HUGE_TEXT), len(HUGE_TEXT.strip())  # a message's bytes as a template may trim it
    assert tokens_at_least(stack, content) > POSITIONS  # its bytes alone tell
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": HUGE_TEXT}]
    cases = [  # endpoint, body, what the message says
        ("/v1/completions", {"model": MODEL, "prompt": HUGE_IDS, "max_tokens": 2},
         f"the prompt has {HUGE} tokens; the model takes at most {POSITIONS} positions"),
        ("/v1/completions", {"model": MODEL, "prompt": HUGE_TEXT},
         f"the prompt is {text} bytes, at least {tokens_at_least(stack, text)} tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": chat, "max_tokens": 2},
         f"the user messages are {content} bytes, at least {tokens_at_least(stack, content)} tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "a" * HUGE, "max_tokens": 3000},  # too long with max_tokens
         f"+ max_tokens (3000) = at least {tokens_at_least(stack, HUGE) + 3000}, past the model's {POSITIONS} "
         "positions"),
    ]
    fits = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    with at_bound(stack):
        status, answer = post(front, "/v1/completions", fits)
        assert status == 429 and "--max-waiting-tokens" in answer["error"]["message"], answer  # not tokenized
        for path, body, message in cases:
            seen: Counter[int] = Counter()
            for _ in range(N):
                status, answer = post(front, path, body)
                seen[status] += 1
                assert message in answer["error"]["message"], answer
            assert seen == {400: N}, (path, message, seen)
    assert post(front, "/v1/completions", fits)[0] == 200


def test_a_prompt_that_can_never_fit_is_out_of_range_over_grpc_and_the_router_at_the_waiting_bound(
        stack: LocalStack, routed: str) -> None:
    chat = [{"role": "user", "content": HUGE_TEXT}]
    never = {"token ids": build_request(token_ids=HUGE_IDS, max_tokens=2),
             "text": build_request(HUGE_TEXT, max_tokens=2), "chat": build_request(messages=chat, max_tokens=2)}
    with at_bound(stack):
        assert grpc_refusals(stack.addr, build_request("hello", max_tokens=2)) == {("RESOURCE_EXHAUSTED", True): N}
        for addr in (stack.addr, routed):
            for kind, request in never.items():
                assert grpc_refusals(addr, request) == {("OUT_OF_RANGE", False): N}, (addr, kind)
        with Client(routed, timeout_s=60) as client, pytest.raises(OutOfRangeError, match=f"{POSITIONS} positions"):
            client.chat(chat, max_tokens=2)  # a busy refusal it retries, not this


def test_a_text_past_the_positions_by_less_than_its_bytes_tell_is_400_at_the_waiting_bound_too(
        stack: LocalStack, front: tuple[str, int]) -> None:
    """At the bound, a text long enough that it may not fit is tokenized (as below it), and a short one is not."""
    model = stack.decode.engine.model
    text = "hello " * 1000  # 6,000 tokens here
    assert tokens_at_least(stack, len(text)) < POSITIONS  # its bytes alone do not tell
    with at_bound(stack):
        stack.decode.engine.model = model  # the real tokenizer, for the long text
        seen = Counter(post(front, "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 2})[0]
                       for _ in range(N))
        stack.decode.engine.model = replace(model, tokenizer=NoTokenizing())
        status, answer = post(front, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 2})
    assert seen == {400: N} and status == 429, (seen, answer)
