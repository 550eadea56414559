"""The public Python client of kvserve's front door (the decode service).

    from client import Client

    with Client("127.0.0.1:50051") as c:
        r = c.generate("Hello", max_tokens=32)
        print(r.text, r.usage.cached_tokens, r.timings.ttft_s)

This module imports no torch: a caller needs only grpcio and protobuf.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from collections.abc import AsyncIterator, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from client import local
from protos.kvserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from protos.retry import Backoff, retry_after_s

DEFAULT_ADDR = "127.0.0.1:50051"
TOKEN_ENV = "KVSERVE_TOKEN"
_MAX_MESSAGE = 8 * 1024 * 1024
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE),
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
]

Message = Mapping[str, str]
BUSY_BACKOFF_S = 0.05  # the first wait for a busy server that hints less, doubling each time
BUSY_RETRIES = 8  # times a request refused by a busy server (RESOURCE_EXHAUSTED with a hint) is sent again
# How long a call that failed UNAVAILABLE waits, once, for the server to answer again (gRPC connects again after
# about a second): a service that `kvserve up` starts again has a placeholder on its port within a fraction of one,
# which answers UNAVAILABLE with why, and a retry hint (kvserve/stack/placeholder.py).
RECONNECT_S = 2.0
SERVER_SAYS = "; the server now says: "  # before the reason a server gives for a stream that broke
_HEALTH_CHECK = "/grpc.health.v1.Health/Check"  # called with the empty request's bytes: no grpc_health here


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request: `cached_tokens` of the prompt were reused, not computed."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Timings:
    """Seconds: time to first token, prefill, decode and the whole request (server side); where the prompt
    was computed: "local" (by the decode service that answered) or "disaggregated" (by the prefill service)."""

    ttft_s: float
    prefill_s: float
    decode_s: float
    total_s: float
    prefill_path: str = ""


@dataclass(frozen=True, slots=True)
class Chunk:
    """One generated token and the text it completes (empty while a character is incomplete)."""

    token_id: int
    text: str


@dataclass(frozen=True, slots=True)
class Result:
    """A finished generation. `finish_reason` is "length", "stop" or "eos"."""

    text: str
    token_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    timings: Timings

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": list(self.token_ids),
            "prompt_token_ids": list(self.prompt_token_ids),
            "finish_reason": self.finish_reason,
            "usage": {
                "prompt_tokens": self.usage.prompt_tokens,
                "cached_tokens": self.usage.cached_tokens,
                "completion_tokens": self.usage.completion_tokens,
            },
            "timings": {
                "ttft_s": self.timings.ttft_s,
                "prefill_s": self.timings.prefill_s,
                "decode_s": self.timings.decode_s,
                "total_s": self.timings.total_s,
                "prefill_path": self.timings.prefill_path,
            },
        }


class KVServeError(Exception):
    """A failed call; `code` is the gRPC status code, `details` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidArgumentError(KVServeError):
    """The request is malformed (empty prompt, bad sampling value, unknown token id...)."""


class OutOfRangeError(KVServeError):
    """The request does not fit (prompt plus max_tokens beyond the model's context)."""


class UnavailableError(KVServeError):
    """A service is down or unreachable; retrying later may succeed."""


class DeadlineExceededError(KVServeError):
    """The call did not finish within its timeout."""


class FailedPreconditionError(KVServeError):
    """The deployment is misconfigured (prefill and decode serve different models or block sizes)."""


class ResourceExhaustedError(KVServeError):
    """The server is out of capacity for this request."""


class UnauthenticatedError(KVServeError):
    """The front door requires a bearer token and got none, or one it does not know (`token=`)."""


_ERRORS: dict[grpc.StatusCode, type[KVServeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: OutOfRangeError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
}


def _error(exc: grpc.RpcError, server_says: str | None = None) -> KVServeError:
    code = exc.code()  # type: ignore[attr-defined]
    details = (exc.details() or "") + ("" if server_says is None else SERVER_SAYS + server_says)  # type: ignore[attr-defined]
    return _ERRORS.get(code, KVServeError)(code, details)


_UINT32 = 2**32
_UINT64 = 2**64


def _check_int(name: str, value: int, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not 0 <= value < limit:
        raise ValueError(f"{name} must be in [0, {limit}), got {value}")
    return value


def _check_messages(messages: Iterable[Message]) -> list[tuple[str, str]]:
    if isinstance(messages, (str, bytes, Mapping)):
        raise ValueError('messages must be a list of {"role": ..., "content": ...} objects, '
                         f"got a {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f'message {i} must be an object with "role" and "content", got {m!r}')
        missing = [k for k in ("role", "content") if k not in m]
        if missing:
            raise ValueError(f"message {i} has no {' and no '.join(repr(k) for k in missing)}: {dict(m)!r}")
        role, content = m["role"], m["content"]
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(f'message {i}: "role" and "content" must be strings, got {dict(m)!r}')
        out.append((role, content))
    return out


def build_request(
    prompt: str | None = None,
    *,
    messages: Iterable[Message] | None = None,
    token_ids: Sequence[int] | None = None,
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    prefix_cache: bool = True,
    cache_salt: str | None = None,
    request_id: str | None = None,
) -> decode_pb2.GenerateRequest:
    """The GenerateRequest for these arguments; exactly one of prompt, messages, token_ids.

    Raises ValueError, before anything is sent, for arguments that cannot be put on the wire
    (a negative max_tokens, top_k, seed or token id, a message without "role" or "content"...);
    the server checks the rest (ranges of temperature and top_p, the vocabulary, the context).
    """
    given = [x is not None for x in (prompt, messages, token_ids)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, messages or token_ids")
    if isinstance(stop, str):
        stop = (stop,)
    _check_int("max_tokens", max_tokens, _UINT32)
    _check_int("top_k", top_k, _UINT32)
    if seed is not None:
        _check_int("seed", seed, _UINT64)
    p = common_pb2.Prompt()
    if prompt is not None:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got a {type(prompt).__name__}")
        p.text = prompt
    elif messages is not None:
        p.messages.CopyFrom(
            common_pb2.ChatMessages(
                messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in _check_messages(messages)]
            )
        )
    else:
        ids = list(token_ids or [])
        if not (all(type(t) is int for t in ids) and min(ids, default=0) >= 0 and max(ids, default=0) < _UINT32):
            for t in ids:  # which one, and why (a check per id costs 0.3 ms for 2k ids, the batch above 0.05)
                _check_int("a token id", t, _UINT32)
        p.token_ids.CopyFrom(common_pb2.TokenIds(ids=ids))
    sampling = common_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        stop=list(stop), ignore_eos=ignore_eos,
    )
    if seed is not None:
        sampling.seed = seed
    return decode_pb2.GenerateRequest(
        request_id=request_id or uuid.uuid4().hex,
        prompt=p,
        sampling=sampling,
        cache=common_pb2.CacheOptions(prefix_cache=prefix_cache, cache_salt=cache_salt or ""),
    )


def result_from_proto(r: decode_pb2.GenerateResult) -> Result:
    """The `Result` of a GenerateResult message."""
    return Result(
        text=r.text,
        token_ids=tuple(r.token_ids),
        prompt_token_ids=tuple(r.prompt_token_ids),
        finish_reason=r.finish_reason,
        usage=Usage(r.usage.prompt_tokens, r.usage.cached_tokens, r.usage.completion_tokens),
        timings=Timings(r.timings.ttft_s, r.timings.prefill_s, r.timings.decode_s, r.timings.total_s,
                        r.timings.prefill_path),
    )


def _auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """`authorization: Bearer <token>` for every call; `token` None reads $KVSERVE_TOKEN, "" sends none."""
    if token is None:
        token = os.environ.get(TOKEN_ENV, "")
    if not token:
        return ()
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise ValueError("the token must be printable ASCII without spaces, as `kvserve token` prints it")
    return (("authorization", f"Bearer {token}"),)


def _credentials(tls_ca: str | os.PathLike[str] | None) -> grpc.ChannelCredentials | None:
    """TLS towards a front door that serves it, trusting the CA in the PEM file `tls_ca`."""
    if tls_ca is None:
        return None
    try:
        with open(tls_ca, "rb") as f:
            return grpc.ssl_channel_credentials(root_certificates=f.read())
    except OSError as exc:
        raise ValueError(f"cannot read the CA file {tls_ca}: {exc.strerror or exc}") from None


def _connection(addr: str, token: str | None, tls_ca: str | os.PathLike[str] | None
                ) -> tuple[tuple[tuple[str, str], ...], grpc.ChannelCredentials | None]:
    """The metadata and channel credentials of a client of `addr` (see `Client`)."""
    found = local.find(addr)
    if found is not None:
        if tls_ca is None:
            tls_ca = found.ca
        if token is None and not os.environ.get(TOKEN_ENV):
            try:
                token = found.admin_token.read_text(encoding="utf-8").strip()
            except OSError:  # another user's `up`: its token is not ours to read
                token = None
    return _auth_metadata(token), _credentials(tls_ca)


def _busy_wait(exc: grpc.RpcError, attempt: int, retries: int, deadline: float, backoff: Backoff) -> float | None:
    """How long to wait before sending again a request that failed with `exc` before any answer, or None to
    give up: only a busy server's RESOURCE_EXHAUSTED, which carries a hint (protos.retry), is retried, at
    most `retries` times, and never past the deadline. The wait is the hint (or `backoff`'s step, if longer)
    stretched by up to 2x at random, so that clients refused together do not come back together."""
    if attempt >= retries or not isinstance(exc, grpc.Call) or exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    hint = retry_after_s(exc)
    if hint is None:
        return None
    wait = random.uniform(1, 2) * max(hint, backoff.delay())
    return wait if time.monotonic() + wait < deadline else None


def _code(exc: grpc.RpcError) -> grpc.StatusCode | None:
    code = getattr(exc, "code", None)  # a grpc.Call's, or an AioRpcError's (which is no grpc.Call)
    return code() if callable(code) else None


def _unavailable(exc: grpc.RpcError) -> bool:
    return _code(exc) == grpc.StatusCode.UNAVAILABLE


def _probed(exc: grpc.RpcError | None) -> tuple[bool, str | None] | None:
    """What a health check (waiting for a connection) that ended with `exc` (None: it was answered) says: whether
    the server answers, and its reason when it says it is unavailable; None to check again. A server's own
    UNAVAILABLE comes with a retry hint; gRPC's own (a connection that broke as the check went out) without."""
    if exc is None or not _unavailable(exc):
        return exc is None or _code(exc) != grpc.StatusCode.DEADLINE_EXCEEDED, None
    return (True, exc.details()) if retry_after_s(exc) is not None else None  # type: ignore[attr-defined]


def _item(msg: decode_pb2.GenerateResponse) -> Chunk | Result:
    if msg.WhichOneof("kind") == "token":
        return Chunk(msg.token.token_id, msg.token.text)
    return result_from_proto(msg.result)


class Client:
    """A connection to the decode service (the front door).

    `generate`, `stream` and `chat` take the same request options:
    max_tokens, temperature (0 = greedy), top_k (0 = off), top_p (1 = off), seed, stop (strings),
    ignore_eos, prefix_cache (False skips the cache, for A/B comparisons) and cache_salt
    (requests with different salts never share KV). Failures raise a `KVServeError` subclass
    carrying the gRPC status code.

    `token`: the bearer token of a front door that requires one (`kvserve token` issues them), sent as
    metadata `authorization: Bearer <token>` on every call; default $KVSERVE_TOKEN. `tls_ca`: a PEM
    file of the CA that signed a TLS front door's certificate. Given neither, a client of a `kvserve up`
    on this host uses the CA and the admin token that `up` made in its data dir (client/local.py), as
    a local client finds a server's socket; elsewhere it dials plaintext with no token.
    """

    def __init__(self, addr: str = DEFAULT_ADDR, timeout_s: float = 300.0, *, token: str | None = None,
                 tls_ca: str | os.PathLike[str] | None = None, busy_retries: int = BUSY_RETRIES) -> None:
        self.addr = addr
        self.timeout_s = timeout_s
        self.busy_retries = busy_retries
        self._metadata, credentials = _connection(addr, token, tls_ca)
        self._channel = (grpc.insecure_channel(addr, options=_CHANNEL_OPTIONS) if credentials is None
                         else grpc.secure_channel(addr, credentials, options=_CHANNEL_OPTIONS))
        self._stub = decode_pb2_grpc.DecodeStub(self._channel)

    def stream(self, prompt: str | None = None, **kwargs: Any) -> Generator[Chunk | Result, None, None]:
        """Yields a `Chunk` per generated token, then the final `Result`.

        Closing the iterator early cancels the request on the server. A request that a busy server refuses
        (RESOURCE_EXHAUSTED with a retry hint) is sent again after the hint, with jitter, at most
        `busy_retries` times within `timeout_s`. After the first UNAVAILABLE (the server died, or is being
        started again), the client waits for the server's hint, if any, then up to RECONNECT_S for the server
        to answer a health check; once it does, a request that had no token yet is sent once more, and for one
        that had, the error says what the server now says (a restart's placeholder: "decode restarting
        (killed: out of memory); retry in a few seconds").
        """
        request = build_request(prompt, **kwargs)
        deadline = time.monotonic() + self.timeout_s
        attempt, probed, backoff = 0, False, Backoff(initial_s=BUSY_BACKOFF_S, max_s=30.0)
        while True:
            call = self._stub.Generate(request, timeout=max(0.0, deadline - time.monotonic()),
                                       metadata=self._metadata)
            answered = False
            try:
                for msg in call:
                    item = _item(msg)
                    if isinstance(item, Result):
                        # Let the call finish before handing the result over: a caller that stops
                        # at the result (as generate does) would otherwise cancel a completed request.
                        for _ in call:
                            pass
                    answered = True
                    yield item
                return
            except grpc.RpcError as exc:
                wait = None if answered else _busy_wait(exc, attempt, self.busy_retries, deadline, backoff)
                if wait is None and _unavailable(exc) and not probed:
                    probed = True
                    hint = retry_after_s(exc) or 0.0
                    if time.monotonic() + hint < deadline:
                        time.sleep(hint)
                        answers, why = self._probe(deadline)
                        if answers and not answered:
                            wait = 0.0
                        elif why is not None:
                            raise _error(exc, why) from None
                if wait is None:
                    raise _error(exc) from None
            finally:
                call.cancel()
            time.sleep(wait)
            attempt += 1

    def _probe(self, deadline: float) -> tuple[bool, str | None]:
        """Whether the server answers a health check within RECONNECT_S (and the deadline), and its reason if it
        says it is unavailable (`_probed`)."""
        until = min(deadline, time.monotonic() + RECONNECT_S)
        check = self._channel.unary_unary(_HEALTH_CHECK)
        while (left := until - time.monotonic()) > 0:
            try:
                check(b"", timeout=left, wait_for_ready=True)
                answer = _probed(None)
            except grpc.RpcError as exc:
                answer = _probed(exc)
            if answer is not None:
                return answer
            time.sleep(0.05)
        return False, None

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Result:
        """Runs one request to the end and returns its `Result`."""
        for item in self.stream(prompt, **kwargs):
            if isinstance(item, Result):
                return item
        raise KVServeError(grpc.StatusCode.INTERNAL, "the stream ended without a result")

    def chat(self, messages: Iterable[Message], **kwargs: Any) -> Result:
        """Generates the assistant's reply to chat messages ({"role": ..., "content": ...})."""
        return self.generate(messages=list(messages), **kwargs)

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """The asyncio twin of `Client`: `await generate(...)`, `async for item in stream(...)`."""

    def __init__(self, addr: str = DEFAULT_ADDR, timeout_s: float = 300.0, *, token: str | None = None,
                 tls_ca: str | os.PathLike[str] | None = None, busy_retries: int = BUSY_RETRIES) -> None:
        self.addr = addr
        self.timeout_s = timeout_s
        self.busy_retries = busy_retries
        self._metadata, credentials = _connection(addr, token, tls_ca)
        self._channel = (grpc.aio.insecure_channel(addr, options=_CHANNEL_OPTIONS) if credentials is None
                         else grpc.aio.secure_channel(addr, credentials, options=_CHANNEL_OPTIONS))
        self._stub = decode_pb2_grpc.DecodeStub(self._channel)

    async def stream(self, prompt: str | None = None, **kwargs: Any) -> AsyncIterator[Chunk | Result]:
        """Yields a `Chunk` per generated token, then the final `Result` (as `Client.stream`, busy retries and
        the one after UNAVAILABLE included).

        Closing the iterator early (`aclose()`) cancels the request on the server.
        """
        request = build_request(prompt, **kwargs)
        deadline = time.monotonic() + self.timeout_s
        attempt, probed, backoff = 0, False, Backoff(initial_s=BUSY_BACKOFF_S, max_s=30.0)
        while True:
            call = self._stub.Generate(request, timeout=max(0.0, deadline - time.monotonic()),
                                       metadata=self._metadata)
            answered = False
            try:
                async for msg in call:
                    item = _item(msg)
                    if isinstance(item, Result):  # finish the call first (see Client.stream)
                        async for _ in call:
                            pass
                    answered = True
                    yield item
                return
            except grpc.RpcError as exc:
                wait = None if answered else _busy_wait(exc, attempt, self.busy_retries, deadline, backoff)
                if wait is None and _unavailable(exc) and not probed:
                    probed = True
                    hint = retry_after_s(exc) or 0.0
                    if time.monotonic() + hint < deadline:
                        await asyncio.sleep(hint)
                        answers, why = await self._probe(deadline)
                        if answers and not answered:
                            wait = 0.0
                        elif why is not None:
                            raise _error(exc, why) from None
                if wait is None:
                    raise _error(exc) from None
            finally:
                call.cancel()
            await asyncio.sleep(wait)
            attempt += 1

    async def _probe(self, deadline: float) -> tuple[bool, str | None]:
        until = min(deadline, time.monotonic() + RECONNECT_S)
        check = self._channel.unary_unary(_HEALTH_CHECK)
        while (left := until - time.monotonic()) > 0:
            try:
                await check(b"", timeout=left, wait_for_ready=True)
                answer = _probed(None)
            except grpc.RpcError as exc:
                answer = _probed(exc)
            if answer is not None:
                return answer
            await asyncio.sleep(0.05)
        return False, None

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> Result:
        """Runs one request to the end and returns its `Result`."""
        async for item in self.stream(prompt, **kwargs):
            if isinstance(item, Result):
                return item
        raise KVServeError(grpc.StatusCode.INTERNAL, "the stream ended without a result")

    async def chat(self, messages: Iterable[Message], **kwargs: Any) -> Result:
        """Generates the assistant's reply to chat messages ({"role": ..., "content": ...})."""
        return await self.generate(messages=list(messages), **kwargs)

    async def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
