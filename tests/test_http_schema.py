"""The HTTP API's parts without a stack: OpenAI bodies checked field by field into the GenerateRequest the
gRPC client would send, gRPC statuses as HTTP ones, and the command's flags; a body's bytes bounded before they
are parsed, and the front (a process, over the fake decode) against a corpus of malformed bodies."""

from __future__ import annotations

import contextlib
import http.client
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from client.client import build_request
from kvserve.http.app import from_grpc
from kvserve.http.body import MAX_DEPTH, loads, nesting_depth
from kvserve.http.schema import BadRequest, ChatCompletionRequest, CompletionRequest, parse, short
from tests.fake_decode import FakeServer

MESSAGES = [{"role": "user", "content": "hi"}]
MODEL = "m"


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
    run = subprocess.run([sys.executable, "-m", "kvserve.http", "--model-name", "m", "--listen", "127.0.0.1:0"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--insecure" in run.stderr and "Traceback" not in run.stderr


# --- bodies as bytes: bounds before parsing, then the front against a corpus of malformed ones

def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **fields}


def nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


@pytest.mark.parametrize(("text", "depth"), [
    ("1", 0),
    ('{"a": [1, {"b": []}]}', 4),
    (nested(65), 65),
    ('["[[[[", "\\\\", {"k\\"[": "]]]]"}]', 2),  # brackets in strings, escaped quotes and backslashes
    ('"\\\\" [[ "\\\\\\" ]]"', 2),  # an even run of backslashes ends in the string's quote, an odd one not
    ('"[[[" ]]] [', 0),  # closing brackets too many: invalid, and shallow
])
def test_nesting_is_counted_on_the_raw_bytes_outside_strings(text: str, depth: int) -> None:
    assert nesting_depth(text.encode()) == depth


def test_counting_stops_soon_after_the_bound() -> None:
    assert MAX_DEPTH < nesting_depth(b"[" * 1_000_000) < 100_000


@pytest.mark.parametrize(("body", "match"), [
    (b"", "empty"),
    (nested(MAX_DEPTH + 1).encode(), f"more than {MAX_DEPTH} levels deep"),
    (b'{"a": ' * 100_000, f"more than {MAX_DEPTH} levels deep"),
    (b'{"model": "\xff"}', "not UTF-8, as JSON must be .RFC 8259.: byte 0xff at offset 11"),
    (b'{"model": "\xed\xa0\x80"}', "not UTF-8"),  # a surrogate, encoded
    (b'{"t": NaN}', "NaN is not a JSON number"),
    (b'{"t": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"t": ' + b"9" * 5000 + b"}", "an integer of more than .* digits"),
    (b'{"model": "a", "model": "b"}', "the key 'model' appears more than once"),
    (b'{"m": [{"role": "user", "role": "user"}]}', "the key 'role' appears more than once"),
    (b'{"model": "\\ud800"}', "lone UTF-16 surrogate"),
    (b'{"\\udc00\\ud800": 1}', "lone UTF-16 surrogate"),  # the wrong order is no pair
    (b'{"model": }', "not valid JSON"),
])
def test_a_body_out_of_bounds_is_refused_before_or_while_it_is_parsed(body: bytes, match: str) -> None:
    with pytest.raises(BadRequest, match=match) as refused:
        loads(body)
    assert refused.value.code == "invalid_json"


def test_a_body_within_bounds_parses_as_json_does() -> None:
    body = {"a": json.loads(nested(MAX_DEPTH - 1)), "b": "\U0001f600 [{\"\\", "c": [1.5, -0.0, 2**63, None, True]}
    for text in (json.dumps(body), json.dumps(body, ensure_ascii=False)):  # a pair of escapes is one character
        assert loads(text.encode()) == body
    assert loads(nested(MAX_DEPTH).encode()) == json.loads(nested(MAX_DEPTH))
    assert loads(b"\xef\xbb\xbf" + b'{"a": 1}') == {"a": 1}  # a UTF-8 byte order mark, ignored


def malformed_bodies() -> dict[str, bytes]:
    """Bodies no endpoint may serve, by name: each must be a 4xx with OpenAI's error object, none a 5xx."""
    bodies = {**_not_json_bodies(), **_too_deep_bodies(), **_lone_surrogate_bodies(), **_bad_number_bodies(),
              **_wrong_field_bodies()}
    return {f"chat: {name}": body for name, body in bodies.items()}


def _not_json_bodies() -> dict[str, bytes]:
    """Not JSON, not an object, not UTF-8, too large, or a key given twice."""
    return {
        "empty": b"", "blank": b" \r\n\t", "text": b"hello", "xml": b"<model>m</model>", "form": b"model=m&max_tokens=2",
        "truncated": b'{"model": "m", "messages": [', "trailing data": b'{"model": "m"} x', "two objects": b"{}{}",
        "comment": b'{"model": "m" /* x */}', "single quotes": b"{'model': 'm'}", "trailing comma": b'{"model": "m",}',
        "utf-16": json.dumps(chat_body()).encode("utf-16"), "utf-32": json.dumps(chat_body()).encode("utf-32"),
        "nul": b"\x00" * 16, "number": b"1", "string": b'"m"', "null": b"null", "true": b"true", "array": b"[]",
        "array of the body": json.dumps([chat_body()]).encode(),
        "invalid utf-8": b'{"model": "m\xff"}', "overlong utf-8": b'{"model": "\xc0\xaf"}',
        "encoded surrogate": b'{"model": "\xed\xa0\x80"}', "cut utf-8": b'{"model": "\xe2\x82"}',
        "5 MiB": json.dumps(chat_body(messages=[{"role": "user", "content": "x" * (5 << 20)}])).encode(),
        "key of 1 MiB": json.dumps(chat_body(**{"k" * (1 << 20): 1})).encode(),
        "key of 1 MiB in a message": json.dumps(chat_body(messages=[{"role": "user", "content": "x",
                                                                     "k" * (1 << 20): 1}])).encode(),
        "duplicated model": b'{"model": "other", "model": "' + MODEL.encode() + b'", "messages": [{"role": "user", '
                            b'"content": "hi"}]}',
        "duplicated role": b'{"model": "m", "messages": [{"role": "user", "role": "user", "content": "hi"}]}',
    }


def _too_deep_bodies() -> dict[str, bytes]:
    bodies: dict[str, bytes] = {}
    for name, leaf in [("arrays", "[]"), ("objects", "{}")]:
        for depth in (MAX_DEPTH + 1, 100, 100_000):
            bodies[f"{depth} {name} deep"] = (leaf[0] * depth + leaf[1] * depth).encode()
    bodies["100000 deep, unclosed"] = b'{"a": [' * 50_000
    for depth in (50, 100_000):  # within the bound, the schema's refusal; past it, the scan's
        bodies[f"content parts {depth} deep"] = json.dumps(chat_body()).replace(
            '"hi"', nested(depth, '{"type": "text", "text": "hi"}')).encode()
        bodies[f"stop {depth} deep"] = json.dumps(chat_body()).replace("}", ', "stop": ' + nested(depth, '"x"') + "}",
                                                                       1).encode()
    return bodies


def _lone_surrogate_bodies() -> dict[str, bytes]:
    bodies: dict[str, bytes] = {}
    for where, template in [("content", '"content": "{}"'), ("key", '"{}": 1, "content": "hi"'),
                            ("role", '"role": "{}", "content": "hi"')]:
        for escape in ("\\ud800", "\\udfff", "\\udc00\\ud800", "x\\ud83d"):
            message = "{" + ('"role": "user", ' if where != "role" else "") + template.format(escape) + "}"
            bodies[f"lone surrogate {escape} in {where}"] = (
                f'{{"model": "m", "messages": [{message}]}}'.encode())
    bodies["lone surrogate in model"] = b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}'
    return bodies


def _bad_number_bodies() -> dict[str, bytes]:
    bodies: dict[str, bytes] = {}
    for number in ["NaN", "Infinity", "-Infinity", "1e999999", "-1e999999", "9" * 5000, "1" + "0" * 100, "01",
                   "0x10", "+1", ".5", "1.", "1e", "--1"]:
        bodies[f"temperature {number[:12]}"] = json.dumps(chat_body(temperature=0)).replace(
            '"temperature": 0', f'"temperature": {number}').encode()
    return bodies


def _wrong_field_bodies() -> dict[str, bytes]:
    """Each field with values it must refuse, and fields that disagree."""
    bodies: dict[str, bytes] = {}
    wrong: dict[str, list[Any]] = {  # each field, values it must refuse
        "model": [None, 1, [], {}, "", "x" * 300, "gpt-4o"],
        "messages": [None, "hi", {}, [], [1], [None], [{}], [{"role": "user"}], [{"content": "hi"}],
                     [{"role": 1, "content": "hi"}], [{"role": "user", "content": 1}],
                     [{"role": "user", "content": None}], [{"role": "user", "content": [1]}],
                     [{"role": "user", "content": [{"type": "text"}]}],
                     [{"role": "user", "content": [{"type": "text", "text": 1}]}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                     [{"role": "tool", "content": "hi"}], [{"role": "user", "content": "hi", "name": "n"}]],
        "max_tokens": [0, -1, 2**32, 2**64, 10**30, 1.5, 1e-999, "5", True, [], {}],
        "max_completion_tokens": [0, -1, 2**32, "5", 1.0],
        "temperature": [-0.1, 2.1, 1e308, "1", True, [], {}],
        "top_p": [0, -1, 1.01, "1", False],
        "top_k": [-1, 2**32, 1.5, "1"],
        "seed": [-1, 2**64, 1.5, "1"],
        "stop": [1, [1], [""], ["x" * 300], ["a"] * 17, {}, [None]],
        "n": [2, 128, 0, -1, "1", True, 1.0],
        "user": [1, "x" * 300, []],
        "stream": ["true", 1, None, []],
        "stream_options": [{"include_usage": True}, "yes", 1],
        "ignore_eos": ["yes", 1, None],
        "frequency_penalty": [0.5, -2, "0"], "presence_penalty": [1, "0"],
        "logprobs": [True, 1, "false"], "top_logprobs": [1],
        "tools": [[]], "functions": [[]], "response_format": [{"type": "json_object"}], "suffix": ["x"],
    }
    for field, values in wrong.items():
        for value in values:
            bodies[f"{field}={short(repr(value), 100)}"] = json.dumps(chat_body(**{field: value})).encode()
    bodies["stream_options without stream"] = json.dumps(chat_body(stream_options={"include_usage": True})).encode()
    bodies["max_tokens and max_completion_tokens disagree"] = json.dumps(
        chat_body(max_completion_tokens=3)).encode()
    return bodies


def malformed_completions() -> dict[str, bytes]:
    prompts: list[Any] = [None, 1, [], [[]], [-1], [2**32], [1.5], ["a", 1], [[1], "a"], {}, ["a", "b"], [[1], [2]],
                          [True], "\ud800"]
    bodies = {f"prompt={short(repr(p), 24)}": json.dumps({"model": MODEL, "prompt": p}).encode() for p in prompts}
    for field, value in [("logprobs", 1), ("echo", True), ("best_of", 2), ("suffix", "x"), ("suffix", "x" * (1 << 20)),
                         ("messages", MESSAGES), ("max_tokens", 0)]:
        bodies[f"{field}={short(repr(value), 100)}"] = json.dumps({"model": MODEL, "prompt": "hi", field: value}).encode()
    bodies["missing prompt"] = json.dumps({"model": MODEL}).encode()
    bodies["100000 arrays deep"] = b"[" * 100_000 + b"]" * 100_000
    bodies["NaN"] = b'{"model": "m", "prompt": "hi", "max_tokens": NaN}'
    return {f"completions: {name}": body for name, body in bodies.items()}


WELL_FORMED: dict[str, list[Any]] = {  # the same front serves these: the corpus's refusals are about the bodies
    "/v1/chat/completions": [
        chat_body(),
        chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]),
        chat_body(messages=[{"role": "user", "content": '[[[{{{ \\" \U0001f600 ]]]'}] * 100),  # over 64 brackets
        chat_body(n=1, logprobs=False, presence_penalty=0, frequency_penalty=0.0, stop=["x"] * 16, seed=2**64 - 1),
    ],
    "/v1/completions": [{"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}, {"model": MODEL, "prompt": "hi"},
                        b"\xef\xbb\xbf" + json.dumps({"model": MODEL, "prompt": "hi"}).encode()],  # with a BOM
}


@contextlib.contextmanager
def http_front(upstream: str, *flags: str) -> Iterator[tuple[str, int]]:
    """`kvserve http --insecure` (a process) in front of `upstream`, serving MODEL; its host and port."""
    process = subprocess.Popen([sys.executable, "-m", "kvserve.http", "--insecure", "--listen", "127.0.0.1:0",
                                "--upstream", upstream, "--model-name", MODEL, *flags], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        yield "127.0.0.1", int(process.stdout.readline().split()[1])
    finally:
        process.terminate()
        process.wait(timeout=30)


def post(front: tuple[str, int], path: str, body: bytes | dict[str, Any]) -> tuple[int, Any]:
    """The status and the decoded answer (None when it is not JSON) of POST `body` (bytes as they are)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()  # a character past U+FFFF: two escapes
    connection = http.client.HTTPConnection(*front, timeout=60)
    try:
        connection.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        reply = connection.getresponse()
        answer = reply.read()
    finally:
        connection.close()
    with contextlib.suppress(ValueError):
        return reply.status, json.loads(answer)
    return reply.status, None


def test_every_malformed_body_is_a_4xx_with_a_message_and_never_reaches_decode() -> None:
    corpus = {**{(name, "/v1/chat/completions"): body for name, body in malformed_bodies().items()},
              **{(name, "/v1/completions"): body for name, body in malformed_completions().items()}}
    with FakeServer() as fake, http_front(fake.addr) as front:
        statuses: Counter[int] = Counter()
        wrong = []
        for (name, path), body in corpus.items():
            status, answer = post(front, path, body)
            statuses[status] += 1
            error = answer.get("error") if isinstance(answer, dict) else None
            if not (400 <= status < 500 and error and error.get("message") and len(error["message"]) < 400
                    and len(error.get("param") or "") <= 80):
                wrong.append((name, status, short(repr(answer), 200)))
        assert fake.servicer.requests == []  # refused by the front itself, before any gRPC call
        for path, bodies in WELL_FORMED.items():
            for body in bodies:
                assert post(front, path, body)[0] == 200, body
    print(f"\n{len(corpus)} malformed bodies: {dict(sorted(statuses.items()))}")
    assert wrong == [] and len(corpus) >= 190
