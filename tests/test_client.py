"""The client library and CLI, without servers: request building, errors, help, and no torch."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest

from client import AsyncClient, Client, Result, UnavailableError
from client.client import build_request
from client.metrics import parse_metrics
from tests.fake_decode import FakeServer


def test_build_request_carries_every_option() -> None:
    req = build_request(
        token_ids=[1, 2, 3], max_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=11,
        stop="END", ignore_eos=True, prefix_cache=False, cache_salt="tenant-a", request_id="r1",
    )
    assert req.request_id == "r1"
    assert list(req.prompt.token_ids.ids) == [1, 2, 3]
    s = req.sampling
    assert (s.max_tokens, s.top_k, s.seed, list(s.stop), s.ignore_eos) == (7, 3, 11, ["END"], True)
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)
    assert req.cache.prefix_cache is False and req.cache.cache_salt == "tenant-a"


def test_build_request_messages_and_defaults() -> None:
    req = build_request(messages=[{"role": "user", "content": "hi"}])
    assert req.prompt.WhichOneof("kind") == "messages"
    assert req.prompt.messages.messages[0].content == "hi"
    assert req.cache.HasField("prefix_cache") and req.cache.prefix_cache is True
    assert not req.sampling.HasField("seed")


@pytest.mark.parametrize("kwargs", [{}, {"prompt": "a", "token_ids": [1]}])
def test_build_request_needs_exactly_one_prompt(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        build_request(**kwargs)


def test_unreachable_server_raises_typed_error() -> None:
    with Client("127.0.0.1:1", timeout_s=2.0) as c, pytest.raises(UnavailableError) as info:
        c.generate("hello")
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_parse_metrics_names_each_sample_as_the_page_writes_it() -> None:
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    registry = CollectorRegistry()
    Counter("kvserve_router_requests", "", ["policy", "replica"], registry=registry).labels("prefix", 'a"b\\c').inc(3)
    Histogram("kvserve_http_ttft_seconds", "", buckets=[0.5], registry=registry).observe(0.25)
    samples = parse_metrics(generate_latest(registry).decode())
    created = {k for k in samples if "_created" in k}
    assert created == {'kvserve_router_requests_created{policy="prefix",replica="a\\"b\\\\c"}',
                       "kvserve_http_ttft_seconds_created"}
    assert {k: v for k, v in samples.items() if k not in created} == {
        'kvserve_router_requests_total{policy="prefix",replica="a\\"b\\\\c"}': 3.0,
        'kvserve_http_ttft_seconds_bucket{le="0.5"}': 1.0, 'kvserve_http_ttft_seconds_bucket{le="+Inf"}': 1.0,
        "kvserve_http_ttft_seconds_count": 1.0, "kvserve_http_ttft_seconds_sum": 0.25}
    assert parse_metrics("# HELP x nothing\n") == {}
    with pytest.raises(ValueError):
        parse_metrics("kvserve_x not-a-number\n")


def test_client_and_cli_import_no_torch() -> None:
    code = "import sys, client, kvserve.cli.commands; assert 'torch' not in sys.modules, 'client imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("command", [[], ["up"], ["generate"], ["chat"], ["stats"], ["bench"], ["model"]])
def test_cli_help(command: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", "kvserve.cli", *command, "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "usage: kvserve" in out


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"prompt": "a", "max_tokens": -1}, "max_tokens must be in"),
    ({"prompt": "a", "top_k": -3}, "top_k must be in"),
    ({"prompt": "a", "seed": -5}, "seed must be in"),
    ({"prompt": "a", "seed": 2**64}, "seed must be in"),
    ({"prompt": "a", "max_tokens": 1.5}, "max_tokens must be an integer"),
    ({"token_ids": [1, -1]}, "a token id must be in"),
    ({"token_ids": [2**32]}, "a token id must be in"),
    ({"prompt": b"bytes"}, "prompt must be a string"),
    ({"messages": [{"role": "user"}]}, "message 0 has no 'content'"),
    ({"messages": [{"content": "x"}]}, "message 0 has no 'role'"),
    ({"messages": ["hello"]}, "message 0 must be an object"),
    ({"messages": [{"role": "user", "content": 5}]}, "must be strings"),
    ({"messages": {"role": "user", "content": "x"}}, "must be a list"),
])
def test_build_request_refuses_what_cannot_be_sent(kwargs: dict, match: str) -> None:
    """Values protobuf cannot carry fail with a ValueError that says which, not a protobuf error."""
    with pytest.raises(ValueError, match=match):
        build_request(**kwargs)


def test_generate_lets_a_finished_call_end_instead_of_cancelling_it() -> None:
    """The server sees every completed request as completed, not cancelled (its metrics count
    outcomes): the client reads the stream to its end before returning the result."""
    with FakeServer(linger_s=0.2) as fake, Client(fake.addr) as c:
        for _ in range(3):
            assert c.generate("hi", max_tokens=2).text == "xx"
        *_, last = c.stream("hi", max_tokens=2)
        assert isinstance(last, Result)
        assert fake.servicer.wait_outcomes(4) == ["ok"] * 4


def test_async_generate_lets_a_finished_call_end() -> None:
    async def run(addr: str) -> None:
        async with AsyncClient(addr) as c:
            assert (await c.generate("hi", max_tokens=2)).text == "xx"
            assert (await c.chat([{"role": "user", "content": "hi"}], max_tokens=3)).text == "xxx"

    with FakeServer(linger_s=0.2) as fake:
        asyncio.run(run(fake.addr))
        assert fake.servicer.wait_outcomes(2) == ["ok", "ok"]


def test_closing_a_stream_early_still_cancels_it() -> None:
    with FakeServer(delay_s=0.05) as fake, Client(fake.addr) as c:
        stream = c.stream("hi", max_tokens=200)
        next(stream)
        stream.close()
        assert fake.servicer.wait_outcomes(1) == ["cancelled"]
