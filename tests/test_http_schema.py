"""The HTTP API's parts without a stack: OpenAI bodies checked field by field into the GenerateRequest the
gRPC client would send, gRPC statuses as HTTP ones, and the command's flags."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import grpc
import pytest

from client.client import build_request
from http_api.app import from_grpc
from http_api.schema import BadRequest, ChatCompletionRequest, CompletionRequest, parse

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return parse(ChatCompletionRequest, {"model": "m", "messages": MESSAGES, **fields})  # type: ignore[no-any-return]


def test_a_body_gives_the_request_the_grpc_client_sends() -> None:
    body = chat(max_tokens=5, temperature=0.5, top_p=0.9, seed=7, stop="x", top_k=3, ignore_eos=True, user="u",
                n=1, logprobs=False, presence_penalty=0, frequency_penalty=0.0, stream=True,
                stream_options={"include_usage": True})
    want = build_request(messages=MESSAGES, max_tokens=5, temperature=0.5, top_p=0.9, seed=7, stop=["x"], top_k=3,
                         ignore_eos=True, request_id="r")
    assert body.generate_request("r") == want and body.include_usage()
    # OpenAI's defaults where a field is left out: temperature and top_p 1, the service's max_tokens.
    sampling = chat().generate_request("r").sampling
    assert (sampling.temperature, sampling.top_p, sampling.max_tokens) == (1.0, 1.0, 0)
    parts = chat(messages=[{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}])
    assert [(m.role, m.content) for m in parts.generate_request("r").prompt.messages.messages] == [("system", "ab")]


def test_completions_take_text_or_token_ids_one_prompt_at_a_time() -> None:
    text = parse(CompletionRequest, {"model": "m", "prompt": "hi"}).generate_request("r")
    assert text.prompt.text == "hi" and text.sampling.max_tokens == 16  # OpenAI's default for completions
    ids = parse(CompletionRequest, {"model": "m", "prompt": [[1, 2, 3]], "max_tokens": 2}).generate_request("r")
    assert list(ids.prompt.token_ids.ids) == [1, 2, 3]
    with pytest.raises(BadRequest, match="2 prompts"):
        parse(CompletionRequest, {"model": "m", "prompt": ["a", "b"]}).generate_request("r")


@pytest.mark.parametrize(("fields", "param", "match"), [
    ({"tools": []}, "tools", "unsupported field 'tools'"),
    ({"n": 2}, "n", "n=2 is not supported"),
    ({"logprobs": True}, "logprobs", "logprobs=True"),
    ({"presence_penalty": 0.5}, "presence_penalty", "presence_penalty=0.5"),
    ({"temperature": 2.5}, "temperature", "temperature"),
    ({"temperature": "1"}, "temperature", "valid number"),  # strict: no strings for numbers
    ({"max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"seed": -1}, "seed", "seed"),
    ({"stop": [""]}, "stop", "1 to 256 characters"),
    ({"stream_options": {"include_usage": True}}, "stream_options", '"stream": true'),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens", "disagree"),
    ({"messages": []}, "messages", "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role", "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content", "content"),
])
def test_what_kvserve_does_not_implement_is_refused_naming_the_field(fields: dict[str, Any], param: str,
                                                                      match: str) -> None:
    with pytest.raises(BadRequest, match=match) as refused:
        chat(**fields)
    assert (refused.value.param or "").startswith(param), refused.value.param


def test_a_body_that_is_not_an_object_or_lacks_the_model() -> None:
    with pytest.raises(BadRequest, match="JSON object"):
        parse(ChatCompletionRequest, [1])
    with pytest.raises(BadRequest, match="missing required field 'model'"):
        parse(ChatCompletionRequest, {"messages": MESSAGES})


class _Refused(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, hint_ms: str | None = None) -> None:
        trailers = grpc.aio.Metadata(*([("retry-after-ms", hint_ms)] if hint_ms else []))
        super().__init__(code, grpc.aio.Metadata(), trailers, details="why")


@pytest.mark.parametrize(("code", "status"), [
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.OUT_OF_RANGE, 400),
    (grpc.StatusCode.FAILED_PRECONDITION, 400), (grpc.StatusCode.UNAUTHENTICATED, 401),
    (grpc.StatusCode.PERMISSION_DENIED, 403), (grpc.StatusCode.NOT_FOUND, 404),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 413), (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INTERNAL, 500), (grpc.StatusCode.UNKNOWN, 500),
])
def test_each_grpc_status_is_the_http_status_the_sdks_expect(code: grpc.StatusCode, status: int) -> None:
    error = from_grpc(_Refused(code))
    assert error.status == status and error.body()["error"]["code"] == code.name.lower()


def test_a_busy_refusal_is_429_with_its_hint() -> None:
    busy = from_grpc(_Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "1500"))
    assert busy.status == 429 and busy.type == "rate_limit_error"
    headers = busy.response().headers
    assert (headers["retry-after-ms"], headers["retry-after"]) == ("1500", "2")


def test_kvserve_http_refuses_bad_flags_with_one_line() -> None:
    run = subprocess.run([sys.executable, "-m", "http_api", "--model-name", "m", "--listen", "127.0.0.1:0"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--insecure" in run.stderr and "Traceback" not in run.stderr
