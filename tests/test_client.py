"""The client library and CLI, without servers: request building, errors, help, and no torch."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from client import Client, UnavailableError
from client.client import build_request


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


def test_client_and_cli_import_no_torch() -> None:
    code = "import sys, client, client.cli; assert 'torch' not in sys.modules, 'client imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("command", [[], ["up"], ["generate"], ["chat"], ["stats"], ["bench"], ["model"]])
def test_cli_help(command: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", "client.cli", *command, "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "usage: kvserve" in out
