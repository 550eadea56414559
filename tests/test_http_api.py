"""The OpenAI-compatible HTTP API (http_api), driven by the official `openai` SDK against a real, secure stack:
HTTPS with its own certificate, bearer tokens checked by decode, the same tokens as the gRPC path (and so
Hugging Face's greedy output), usage with cached tokens, each error as the SDK's typed exception, and a client
that goes away freeing its sequence."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import Client
from client.local import Layout
from client.metrics import parse_metrics
from kvserve.rpc.server import PROBE_LIMIT
from kvserve.stack.stack import METRICS_OFFSETS, Service, Stack, StackConfig, wait_http_healthy
from tests.polling import wait_until
from tests.processes import free_port_run, free_ports
from tests.stack_fixtures import assert_greedy_matches, model_dir, oracle, tokens

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ARCH = "llama"
MODEL = "model-llama"  # the model folder's name: the stack serves it under that name
SYSTEM = "You answer in one short sentence. " * 12  # several blocks, shared by every chat below
CANCELLED = 'kvserve_decode_requests_total{outcome="cancelled"}'


@dataclass
class HTTPStack:
    stack: Stack
    layout: Layout
    metrics_port: int  # the stack's --metrics-base-port
    token: str

    @property
    def http(self) -> Service:
        return self.stack.service("http")

    def openai(self, token: str | None = None, **kwargs: object) -> openai.OpenAI:
        context = ssl.create_default_context(cafile=str(self.layout.ca))
        return openai.OpenAI(base_url=f"{self.http.url}/v1", api_key=self.token if token is None else token,
                             http_client=openai.DefaultHttpx2Client(verify=context), max_retries=0, **kwargs)

    def grpc_client(self) -> Client:
        return Client(self.stack.addr, token=self.token, tls_ca=self.layout.ca)

    def decode_metrics(self, offset: int = METRICS_OFFSETS["decode"]) -> dict[str, float]:
        """A service's metrics page (decode's unless `offset` says another), asked with the admin's certificate."""
        context = ssl.create_default_context(cafile=str(self.layout.ca))
        context.load_cert_chain(*(str(p) for p in self.layout.admin_cert))
        with urllib.request.urlopen(f"https://127.0.0.1:{self.metrics_port + offset}/metrics", context=context,
                                    timeout=10) as reply:
            return parse_metrics(reply.read().decode())

    def wait_idle(self, timeout_s: float = 30.0, cancelled: float | None = None) -> dict[str, float]:
        """Decode's metrics once no sequence runs or waits in it (a cancelled stream's is freed) and, given
        `cancelled`, that many requests have ended cancelled: decode counts a request's outcome a moment after
        its sequence leaves the running gauge."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.decode_metrics()
            if (m.get("kvserve_decode_running_requests", 0) == 0 and m.get("kvserve_decode_waiting_requests", 0) == 0
                    and cancelled in (None, m.get(CANCELLED, 0))):
                return m
            assert time.monotonic() < deadline, {k: v for k, v in m.items()
                                                 if "running" in k or "waiting" in k or k == CANCELLED}
            time.sleep(0.1)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HTTPStack]:
    tmp = tmp_path_factory.mktemp("http")
    base = free_port_run(4)
    stack = Stack(StackConfig(model_dir=model_dir(ARCH), data_dir=tmp, decode_port=0, prefill_port=0, store_port=0,
                              host_capacity="64MiB", disk_capacity="0", metrics_base_port=base, http_port=0),
                  log_dir=tmp / "logs")
    with stack:
        assert stack.layout is not None
        yield HTTPStack(stack, stack.layout, base, stack.layout.admin_token.read_text().strip())


def chat(system: str, *turns: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return messages


def test_chat_equals_the_grpc_path_and_streams_the_same_text(served: HTTPStack) -> None:
    messages = chat(SYSTEM, "What is a KV cache?")
    client = served.openai()
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,  # type: ignore[arg-type]
                                           extra_body={"ignore_eos": True})
    with served.grpc_client() as c:
        want = c.chat(messages, max_tokens=12, ignore_eos=True)
    assert whole.choices[0].message.content == want.text
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert whole.object == "chat.completion" and whole.model == MODEL
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (want.usage.prompt_tokens, 12)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    # The second time, the whole prompt but its last token was cached.
    assert last.usage.prompt_tokens_details is not None
    assert last.usage.prompt_tokens_details.cached_tokens >= last.usage.prompt_tokens - 16


def test_completions_from_token_ids_equal_hugging_face(served: HTTPStack) -> None:
    prompt = tokens(40, seed=7)
    want, logits = oracle(ARCH, prompt, 16)
    client = served.openai()
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
    with served.grpc_client() as c:
        grpc_result = c.generate(token_ids=prompt, max_tokens=16, ignore_eos=True)
    assert_greedy_matches(list(grpc_result.token_ids), want, logits)
    assert whole.choices[0].text == grpc_result.text
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == grpc_result.text


def test_a_text_prompt_and_a_seed_give_the_same_tokens_as_grpc(served: HTTPStack) -> None:
    client = served.openai()
    http = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0.8,
                                     top_p=0.9, seed=1234, extra_body={"top_k": 40, "ignore_eos": True})
    with served.grpc_client() as c:
        want = c.generate("Once upon a time", max_tokens=10, temperature=0.8, top_p=0.9, seed=1234, top_k=40,
                          ignore_eos=True)
    assert http.choices[0].text == want.text


def test_the_second_turn_of_a_chat_reports_its_cached_tokens(served: HTTPStack) -> None:
    client = served.openai()
    first = client.chat.completions.create(model=MODEL, messages=chat("Be brief. " * 20, "Hello there"),  # type: ignore[arg-type]
                                           max_tokens=8, temperature=0)
    answer = first.choices[0].message.content or ""
    second = client.chat.completions.create(
        model=MODEL, messages=chat("Be brief. " * 20, "Hello there", answer, "And then?"),  # type: ignore[arg-type]
        max_tokens=8, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 16, (cached, first.usage.prompt_tokens)


def test_stop_strings_and_max_completion_tokens_are_honoured(served: HTTPStack) -> None:
    client = served.openai()
    prompt = tokens(30, seed=11)
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next(ch for ch in free[4:] if ch.isprintable() and not ch.isspace())
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True}).choices[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text and free.startswith(stopped.text)
    short = client.chat.completions.create(model=MODEL, messages=chat(SYSTEM, "Hi"), max_completion_tokens=3,  # type: ignore[arg-type]
                                           temperature=0, extra_body={"ignore_eos": True})
    assert short.usage is not None and short.usage.completion_tokens == 3


def test_errors_are_the_sdks_typed_exceptions(served: HTTPStack) -> None:
    messages = chat(SYSTEM, "Hi")
    with pytest.raises(openai.AuthenticationError, match="token"):
        served.openai(token="not-a-token").chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
    client = served.openai()
    with pytest.raises(openai.NotFoundError, match="'gpt-4o' does not exist") as missing:
        client.chat.completions.create(model="gpt-4o", messages=messages)  # type: ignore[arg-type]
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    with pytest.raises(openai.BadRequestError, match="n=2") as many:
        client.chat.completions.create(model=MODEL, messages=messages, n=2)  # type: ignore[arg-type]
    assert many.value.param == "n"
    with pytest.raises(openai.BadRequestError, match="'response_format'"):
        client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                       response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.chat.completions.create(model=MODEL, messages=messages, logprobs=True)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=messages, temperature=3)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="token id"):  # decode's own check, through gRPC
        client.completions.create(model=MODEL, prompt=[10**9], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context|positions"):
        client.completions.create(model=MODEL, prompt=tokens(5000, seed=1), max_tokens=2)
    with pytest.raises(openai.APIStatusError, match="larger than") as large:
        client.completions.create(model=MODEL, prompt="x" * (5 << 20), max_tokens=2)
    assert large.value.status_code == 413
    # Streaming too: the refusal is a status code, before any event.
    with pytest.raises(openai.AuthenticationError):
        served.openai(token="wrong").chat.completions.create(model=MODEL, messages=messages, stream=True)  # type: ignore[arg-type]
    # No Authorization header at all (not the SDK: it always sends one).
    request = urllib.request.Request(f"{served.http.url}/v1/completions", method="POST",
                                     data=json.dumps({"model": MODEL, "prompt": "hi"}).encode())
    with pytest.raises(urllib.error.HTTPError) as anonymous:
        urllib.request.urlopen(request, context=ssl.create_default_context(cafile=str(served.layout.ca)), timeout=30)
    assert anonymous.value.code == 401
    assert json.loads(anonymous.value.read())["error"]["type"] == "authentication_error"


def test_a_client_that_gives_up_frees_its_sequence(served: HTTPStack) -> None:
    client = served.openai()
    before = served.wait_idle()
    stream = client.chat.completions.create(model=MODEL, messages=chat(SYSTEM, "Tell me everything."),  # type: ignore[arg-type]
                                            max_tokens=3000, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    for _ in range(3):
        next(iter(stream))
    assert served.decode_metrics()["kvserve_decode_running_requests"] == 1
    stream.close()
    served.wait_idle(cancelled=before.get(CANCELLED, 0) + 1)
    # Not streaming: the SDK's own timeout, then its connection closed.
    with pytest.raises(openai.APITimeoutError):
        served.openai(timeout=1.0).completions.create(model=MODEL, prompt=tokens(20, seed=3), max_tokens=3000,
                                                       extra_body={"ignore_eos": True})
    served.wait_idle(cancelled=before.get(CANCELLED, 0) + 2)


def test_models_health_and_metrics_on_their_own_port(served: HTTPStack) -> None:
    client = served.openai()
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "kvserve"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    context = ssl.create_default_context(cafile=str(served.layout.ca))
    with urllib.request.urlopen(f"{served.http.url}/health", context=context, timeout=10) as reply:
        assert json.loads(reply.read()) == {"status": "ok"}
    # Its upstream's health checks all held by callers that never send theirs (rpc.server.PROBE_LIMIT): the
    # upstream refuses the front's as busy, and busy is not down.
    never = threading.Event()
    creds = grpc.ssl_channel_credentials(root_certificates=served.layout.ca.read_bytes())
    with grpc.secure_channel(served.stack.addr, creds) as channel:
        def silent() -> Iterator[bytes]:
            never.wait()
            yield b""

        calls = [channel.stream_stream("/grpc.health.v1.Health/Check")(silent(), timeout=30)
                 for _ in range(PROBE_LIMIT + 2)]
        try:
            wait_until(lambda: refused_as_busy(channel), message="the probe slots were never all taken")
            with urllib.request.urlopen(f"{served.http.url}/health", context=context, timeout=10) as reply:
                assert json.loads(reply.read()) == {"status": "ok"}
        finally:
            never.set()
            for call in calls:
                call.cancel()
    page = served.decode_metrics(METRICS_OFFSETS["http"])  # on its metrics port, as every service's
    assert page['kvserve_http_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert page["kvserve_http_ttft_seconds_count"] >= 1
    with pytest.raises(urllib.error.HTTPError) as public:  # not on the public port
        urllib.request.urlopen(f"{served.http.url}/metrics", context=context, timeout=10)
    assert public.value.code == 404


def refused_as_busy(channel: grpc.Channel) -> bool:
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError as exc:
        return bool(exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED)  # type: ignore[attr-defined]
    return False


@pytest.fixture()
def second_front(served: HTTPStack, request: pytest.FixtureRequest) -> Iterator[str]:
    """The base URL of another HTTP front on the same decode (or on `upstream`), with the flags the test gives."""
    upstream, *flags = request.param
    cert, key = served.layout.cert("http")
    process = subprocess.Popen([
        sys.executable, "-m", "kvserve.http", "--listen", "127.0.0.1:0", "--upstream", upstream or served.stack.addr,
        "--model-name", MODEL, "--tls-ca", str(served.layout.ca), "--tls-cert", str(cert), "--tls-key", str(key),
        *flags], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        url = f"https://127.0.0.1:{process.stdout.readline().split()[1]}"
        if not upstream:
            wait_http_healthy(f"{url}/health", 60, process, str(served.layout.ca))
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.parametrize("second_front", [("", "--client-timeout-s", "1")], indirect=True)
def test_slow_and_idle_connections_are_closed_and_hold_nothing(served: HTTPStack, second_front: str) -> None:
    """A body that trickles in is 408 after --client-timeout-s (1 s here); connections that send nothing after
    their TLS handshake, or half a request head, are closed after it; while they are open, and more that never
    start their handshake (asyncio closes those after 60 s), requests are served."""
    context = ssl.create_default_context(cafile=str(served.layout.ca))
    port = int(second_front.rpartition(":")[2])

    def connect() -> socket.socket:
        return context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=30),
                                   server_hostname="127.0.0.1")

    silent = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(100)]
    idle, half = [connect() for _ in range(50)], [connect() for _ in range(5)]
    for s in half:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: kvserve\r\n")
    try:
        with connect() as tls:
            tls.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kvserve\r\nContent-Length: 100\r\n\r\n{")
            front = served.openai().with_options(base_url=f"{second_front}/v1")
            assert [m.id for m in front.models.list()] == [MODEL]  # served meanwhile
            answer = b""
            while b"}}" not in answer and (more := tls.recv(4096)):
                answer += more
        assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer, answer

        def closed(s: socket.socket) -> bool:
            try:
                return s.recv(1) == b""
            except TimeoutError:
                return False
            except OSError:  # reset, or TLS ended without its close_notify
                return True

        for s in [*idle, *half]:
            s.settimeout(5)
        assert all(closed(s) for s in [*idle, *half])
    finally:
        for s in [*silent, *idle, *half]:
            s.close()


@pytest.mark.parametrize("second_front", [("", "--max-connections", "1", "--timeout-s", "2")], indirect=True)
def test_a_busy_front_is_429_with_a_retry_hint_and_a_slow_answer_504(served: HTTPStack, second_front: str) -> None:
    client = served.openai().with_options(base_url=f"{second_front}/v1")
    with pytest.raises(openai.APITimeoutError):  # the SDK's timeout; the front's --timeout-s is 2 s
        client.with_options(timeout=0.5).completions.create(model=MODEL, prompt=tokens(20, seed=5), max_tokens=3000,
                                                            extra_body={"ignore_eos": True})
    served.wait_idle()  # the front saw its client go and cancelled the call, which freed its sequence
    # The front frees its slot as it sees the disconnect, a moment apart from this next request: a client that
    # honours the 429's retry hint (as the SDK does by default) gets in.
    stream = client.with_options(max_retries=3).completions.create(
        model=MODEL, prompt=tokens(20, seed=4), max_tokens=3000, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    with pytest.raises(openai.RateLimitError, match="--max-connections") as busy:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert busy.value.response.headers["retry-after-ms"] == "250"
    stream.close()
    served.wait_idle()
    with pytest.raises(openai.APIStatusError, match="--timeout-s") as slow:
        client.completions.create(model=MODEL, prompt=tokens(20, seed=6), max_tokens=3000,
                                  extra_body={"ignore_eos": True})
    assert slow.value.status_code == 504


@pytest.mark.parametrize("second_front", [(f"127.0.0.1:{free_ports(1)[0]}",)], indirect=True)
def test_a_front_door_that_is_down_is_503(served: HTTPStack, second_front: str) -> None:
    client = served.openai().with_options(base_url=f"{second_front}/v1")
    with pytest.raises(openai.InternalServerError) as down:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert down.value.status_code == 503
    context = ssl.create_default_context(cafile=str(served.layout.ca))
    with pytest.raises(urllib.error.HTTPError) as health:
        urllib.request.urlopen(f"{second_front}/health", context=context, timeout=10)
    assert health.value.code == 503
