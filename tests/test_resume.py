"""A decode replica continues a stream that another one started (GenerateRequest.resume_token_ids): the
client's chunks before the move and after it add up to an uninterrupted run's, ids and texts, greedy and
seeded, with stop strings; the result counts every token; the new replica finds the blocks the first one
saved as they filled; bad resume tokens are INVALID_ARGUMENT."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch

from client.client import build_request
from kvserve.engine.hashing import prefix_hashes
from protos.kvserve.v1 import decode_pb2, decode_pb2_grpc
from tests.model_faults import FaultyForward
from tests.polling import wait_until
from tests.stack_fixtures import BLOCK_SIZE, FakeStore, LocalStack, tokens

ARCH = "qwen2"
PROMPT = tokens(2 * BLOCK_SIZE + 5, seed=81)
N = 40
GREEDY: dict[str, Any] = {}
SEEDED: dict[str, Any] = {"temperature": 0.8, "top_p": 0.9, "seed": 1234}


class Gate:
    """A decode model whose forward computing ``position`` (once armed) waits until released: the replica
    is then mid-stream, as long as the test wants."""

    def __init__(self) -> None:
        self.position = -1
        self.reached = threading.Event()
        self.release = threading.Event()
        self.forward = FaultyForward(self._holds)

    def _holds(self, positions: torch.Tensor) -> bool:
        if self.position in positions.flatten().tolist():
            self.position = -1
            self.reached.set()
            assert self.release.wait(30)
        return False


@dataclass
class Replicas:
    a: LocalStack  # where streams start (its decode model gated)
    b: LocalStack  # where they continue
    store: FakeStore
    gate: Gate


@pytest.fixture(scope="module")
def replicas() -> Iterator[Replicas]:
    store, gate = FakeStore(), Gate()
    a = LocalStack(ARCH, store=store, wrap_decode_model=gate.forward.around)
    b = LocalStack(ARCH, store=store)
    yield Replicas(a, b, store, gate)
    a.close()
    b.close()


@dataclass(frozen=True)
class Run:
    chunks: list[tuple[int, str]]
    result: decode_pb2.GenerateResult | None


def request(max_tokens: int = N, resume: Sequence[int] = (), **kw: Any) -> decode_pb2.GenerateRequest:
    req = build_request(token_ids=PROMPT, max_tokens=max_tokens, ignore_eos=True, **kw)
    req.resume_token_ids.extend(resume)
    return req


def generate(stack: LocalStack, req: decode_pb2.GenerateRequest) -> Run:
    with grpc.insecure_channel(stack.addr) as channel:
        responses = list(decode_pb2_grpc.DecodeStub(channel).Generate(req, timeout=60))
    chunks = [(r.token.token_id, r.token.text) for r in responses if r.HasField("token")]
    results = [r.result for r in responses if r.HasField("result")]
    assert len(results) == 1 and responses[-1].HasField("result")
    return Run(chunks, results[0])


def assert_continues(whole: Run, k: int, rest: Run) -> None:
    """``rest``, resumed after ``whole``'s first ``k`` tokens, is what ``whole`` streamed after them."""
    assert whole.chunks[:k] + rest.chunks == whole.chunks
    a, b = whole.result, rest.result
    assert a is not None and b is not None
    assert (b.token_ids, b.text, b.finish_reason, b.prompt_token_ids) == \
        (a.token_ids, a.text, a.finish_reason, a.prompt_token_ids)
    assert (b.usage.prompt_tokens, b.usage.completion_tokens) == (a.usage.prompt_tokens, a.usage.completion_tokens)
    assert b.text == "".join(text for _, text in whole.chunks)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_stream_continued_anywhere_is_the_uninterrupted_one(replicas: Replicas, sampling: dict[str, Any]) -> None:
    whole = generate(replicas.a, request(**sampling))
    assert len(whole.chunks) == N and whole.result is not None and whole.result.finish_reason == "length"
    assert any(text == "" for _, text in whole.chunks)  # characters split over tokens: some release nothing
    for k in (1, 17, N - 1):
        assert_continues(whole, k, generate(replicas.b, request(resume=whole.result.token_ids[:k], **sampling)))
    assert_continues(whole, 9, generate(replicas.b, request(resume=whole.result.token_ids[:9], prefix_cache=False,
                                                            **sampling)))


def _stop_pair(chunks: list[tuple[int, str]]) -> tuple[str, int]:
    """Two printable ASCII characters that two consecutive tokens (from the 5th on) release, one each, seen
    together nowhere before; and the index of the first token."""
    text = ""
    for j in range(len(chunks) - 1):
        a, b = chunks[j][1], chunks[j + 1][1]
        pair = a + b
        if j >= 4 and len(a) == len(b) == 1 and pair.isascii() and pair.isprintable() and pair not in text + a:
            return pair, j
        text += a
    raise AssertionError(f"no stop string to pick in {chunks}")


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_stream_with_a_stop_string_continued_before_it_or_inside_its_held_back_text(
    replicas: Replicas, sampling: dict[str, Any]
) -> None:
    stop, j = _stop_pair(generate(replicas.a, request(**sampling)).chunks)
    whole = generate(replicas.a, request(stop=[stop], **sampling))
    assert whole.result is not None and whole.result.finish_reason == "stop"
    assert len(whole.chunks) == j + 2 and whole.chunks[j][1] == ""  # token j's character held back: it may be
    for k in (3, j, j + 1):  # ... the start of the stop string, which token j + 1 completes
        assert_continues(whole, k, generate(replicas.b, request(resume=whole.result.token_ids[:k], stop=[stop],
                                                                **sampling)))


def test_resume_tokens_that_end_the_generation_leave_only_the_result(replicas: Replicas) -> None:
    whole = generate(replicas.a, request(max_tokens=6))
    assert whole.result is not None
    assert_continues(whole, 6, generate(replicas.b, request(max_tokens=6, resume=whole.result.token_ids)))
    stop, j = _stop_pair(generate(replicas.a, request()).chunks)
    whole = generate(replicas.a, request(stop=[stop]))
    assert whole.result is not None
    assert_continues(whole, j + 2, generate(replicas.b, request(stop=[stop], resume=whole.result.token_ids)))
    eos = min(replicas.b.decode.engine.model.eos_token_ids)
    req = request(resume=[*whole.result.token_ids[:3], eos])
    req.sampling.ignore_eos = False
    ended = generate(replicas.b, req)
    assert ended.chunks == [] and ended.result is not None
    assert (ended.result.finish_reason, list(ended.result.token_ids), ended.result.usage.completion_tokens) == \
        ("eos", [*whole.result.token_ids[:3], eos], 4)


@pytest.mark.parametrize(("resume", "max_tokens", "message"), [
    (list(range(5)), 4, "resume_token_ids has 5 tokens, more than max_tokens (4)"),
    ([7, 1 << 20], 4, "resume_token_ids[1] = 1048576 is outside the model's vocabulary [0, "),
    ([7, "eos", 8], 4, "resume_token_ids: token 2 of 3 comes after the end of the generation (token 1 ends it: eos)"),
])
def test_bad_resume_tokens_are_invalid_arguments(replicas: Replicas, resume: list[Any], max_tokens: int,
                                                 message: str) -> None:
    eos = min(replicas.b.decode.engine.model.eos_token_ids)
    req = request(max_tokens=max_tokens, resume=[eos if t == "eos" else t for t in resume])
    req.sampling.ignore_eos = False
    with pytest.raises(grpc.RpcError) as raised:
        generate(replicas.b, req)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in raised.value.details()


def test_the_new_replica_finds_the_blocks_the_first_one_saved_mid_stream(replicas: Replicas) -> None:
    # The uninterrupted run, for reference, under another salt: its blocks are not the moved stream's.
    whole = generate(replicas.b, request(max_tokens=3 * N, cache_salt="reference", **SEEDED))
    moved = {"max_tokens": 3 * N, "cache_salt": "moved", **SEEDED}
    gate, position = replicas.gate, len(PROMPT) + 2 * BLOCK_SIZE + 3
    gate.position = position  # replica a stops mid-stream, before computing this token's KV
    k = position + 1 - len(PROMPT)  # the tokens it has sent by then
    root = replicas.a.decode.engine.namespace("moved").root()
    with grpc.insecure_channel(replicas.a.addr) as channel:
        call = decode_pb2_grpc.DecodeStub(channel).Generate(request(**moved), timeout=60)
        try:
            sent = [next(call).token for _ in range(k)]
            assert gate.reached.wait(30)
            keys = prefix_hashes([*PROMPT, *(c.token_id for c in sent)], BLOCK_SIZE, root)[: position // BLOCK_SIZE]
            wait_until(lambda: set(keys) <= set(replicas.store.blocks), message="a's blocks never reached the store")
            assert replicas.a.decode_metric("kvserve_decode_running_requests") == 1  # a is still streaming
        finally:
            call.cancel()  # a "dies": its stream ends without a result, its sequence without a save
            gate.release.set()
    assert [(c.token_id, c.text) for c in sent] == whole.chunks[:k]
    cached = replicas.b.decode_metric("kvserve_decode_cached_tokens_total")
    rest = generate(replicas.b, request(resume=[c.token_id for c in sent], **moved))
    assert_continues(whole, k, rest)
    # b computed only the last resumed token's block: the blocks before it came from the store, a's
    assert replicas.b.decode_metric("kvserve_decode_cached_tokens_total") - cached == position // BLOCK_SIZE * BLOCK_SIZE
