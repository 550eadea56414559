"""Tenants bound to credentials at the front door (docs/DESIGN.md, "Tenants and trust"): the tokens file,
its reload, `kvserve token`, the interceptor on a real server, and a real stack with auth on."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.client import Client, UnauthenticatedError
from kvserve.rpc.auth import (
    Auth,
    AuthConfigError,
    Authenticator,
    TenantSalts,
    add_auth_flags,
    auth_from_args,
    current_tenant,
    default_secret_path,
    load_tokens,
    parse_tokens,
)
from kvserve.rpc.auth import main as token_main
from kvserve.rpc.certs import flags, make_certs
from kvserve.rpc.server import Server
from tests.polling import wait_until


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def issue(tokens_file: Path, tenant: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert token_main([tenant, "--tokens-file", str(tokens_file)]) == 0
    return capsys.readouterr().out.strip()


# --- the tokens file --------------------------------------------------------------------------------


def test_a_tokens_file_maps_each_token_to_its_tenant() -> None:
    table = parse_tokens(f"# tenants\n\nacme {sha('a1')}\n  acme {sha('a2').upper()}  # rotated\nglobex {sha('g')}\n")
    assert [t for t, _ in table.entries] == ["acme", "acme", "globex"]
    assert (table.tenant_of("a1"), table.tenant_of("a2"), table.tenant_of("g")) == ("acme", "acme", "globex")
    assert table.tenant_of("nope") is None and table.tenant_of("") is None
    assert table.tenants == {"acme", "globex"}


@pytest.mark.parametrize(("line", "problem"), [
    ("acme", "expected 'TENANT_ID SHA256_HEX_OF_TOKEN', got 1 field"),
    (f"acme {sha('x')} extra", "got 3 field"),
    ("acme plain-token-not-a-hash", "64 hex digits (never the token itself"),
    (f"ac/me {sha('x')}", "tenant id 'ac/me' is not"),
    (f"acme {sha('a1')}", "the same token hash as line 1"),
])
def test_a_bad_tokens_file_says_which_line_and_what_is_wrong(line: str, problem: str) -> None:
    with pytest.raises(AuthConfigError) as info:
        parse_tokens(f"acme {sha('a1')}\n# a comment\n{line}\n", "tokens.txt")
    assert str(info.value).startswith("tokens.txt line 3: ") and problem in str(info.value), info.value


def test_every_entry_is_compared_in_constant_time_whichever_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: Any, b: Any) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    table = parse_tokens("".join(f"t{i} {sha(f'tok{i}')}\n" for i in range(4)))
    assert table.tenant_of("tok0") == "t0"
    assert len(compared) == 4  # no early exit at the first entry's match
    assert all(a == hashlib.sha256(b"tok0").digest() for a, _ in compared)  # the hash is compared, never the token
    compared.clear()
    assert table.tenant_of("unknown") is None and len(compared) == 4


def test_reload_takes_a_good_file_and_keeps_the_old_table_on_a_bad_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"acme {sha('a')}\n")
    auth = Authenticator(path)
    path.write_text(f"acme {sha('a')}\nglobex {sha('g')}\n")
    assert auth.reload() and auth.tenant_of("g") == "globex"
    path.write_text(f"acme {sha('a')}\nglobex not-a-hash\n")
    with caplog.at_level(logging.ERROR, "kvserve.rpc.auth"):
        assert not auth.reload()
    assert (auth.tenant_of("a"), auth.tenant_of("g")) == ("acme", "globex")
    assert "the previous 2 token(s) stay in use" in caplog.text and f"{path} line 2" in caplog.text
    path.unlink()
    assert not auth.reload() and auth.tenant_of("a") == "acme"


def test_a_missing_tokens_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(AuthConfigError, match="cannot read tokens file .*missing"):
        load_tokens(tmp_path / "missing")


# --- `kvserve token` ----------------------------------------------------------------------------------


def test_kvserve_token_appends_the_hash_and_prints_the_token_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvserve.cli.commands import main as kvserve

    tokens_file = tmp_path / "tokens"
    assert kvserve(["token", "acme", "--tokens-file", str(tokens_file)]) == 0
    first = capsys.readouterr().out.strip()
    tokens_file.write_text(tokens_file.read_text().rstrip("\n"))  # an edit that dropped the last newline
    second = issue(tokens_file, "globex", capsys)
    assert first != second and len(first) >= 40
    text = tokens_file.read_text()
    assert first not in text and text == f"acme {sha(first)}\nglobex {sha(second)}\n"
    table = load_tokens(tokens_file)
    assert (table.tenant_of(first), table.tenant_of(second)) == ("acme", "globex")
    secret = default_secret_path(tokens_file)
    for path in (tokens_file, secret):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert len(secret.read_text().strip()) == 64

    assert token_main(["acme", "--tokens-file", str(tokens_file), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tenant"] == "acme" and load_tokens(tokens_file).tenant_of(out["token"]) == "acme"
    assert out["secret_file"] == str(secret)


def test_kvserve_token_leaves_a_broken_tokens_file_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("acme oops\n")
    assert token_main(["acme", "--tokens-file", str(tokens_file)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"{tokens_file} line 1" in captured.err
    assert tokens_file.read_text() == "acme oops\n" and not default_secret_path(tokens_file).exists()
    assert token_main(["bad/tenant", "--tokens-file", str(tmp_path / "other")]) == 2
    assert "tenant id 'bad/tenant'" in capsys.readouterr().err and not (tmp_path / "other").exists()


# --- the namespace salt and the decode flags ---------------------------------------------------------


def test_the_tenant_fixes_the_salt_and_the_client_salt_only_narrows_it() -> None:
    salts = TenantSalts(b"s" * 32)
    acme = salts.salt("acme", "")
    assert acme == hmac.new(b"s" * 32, b"acme", hashlib.sha256).hexdigest() + "\x00"
    assert salts.salt("acme", "x") == acme + "x"
    assert salts.salt("globex", "") != acme
    assert TenantSalts(b"t" * 32).salt("acme", "") != acme  # another secret, other namespaces
    # No client salt reaches another tenant's namespace, nor the salts of a stack without auth.
    assert not salts.salt("globex", acme).startswith(acme) and acme not in ("", "acme")


def _flags(*argv: str) -> Any:
    import argparse

    ap = argparse.ArgumentParser()
    add_auth_flags(ap)
    return ap.parse_args(list(argv))


def test_auth_flags_need_the_secret_and_say_when_auth_is_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(f"acme {sha('a')}\n")
    with pytest.raises(AuthConfigError, match=r"no server secret at .*tokens\.secret.*`kvserve token` creates it"):
        auth_from_args(_flags("--auth-tokens", str(tokens_file)), "decode")
    with pytest.raises(AuthConfigError, match="without --auth-tokens"):
        auth_from_args(_flags("--auth-secret-file", str(tmp_path / "s")), "decode")
    (tmp_path / "short").write_text("too short\n")
    with pytest.raises(AuthConfigError, match="fewer than 32"):
        auth_from_args(_flags("--auth-tokens", str(tokens_file), "--auth-secret-file", str(tmp_path / "short")), "x")
    with caplog.at_level(logging.WARNING, "kvserve.rpc.auth"):
        assert auth_from_args(_flags(), "decode") is None
    assert "auth is off: anyone who reaches the decode service is served, chooses its own cache_salt" in caplog.text
    secret = tmp_path / "secret"
    secret.write_text("k" * 40)
    auth = auth_from_args(_flags("--auth-tokens", str(tokens_file), "--auth-secret-file", str(secret)), "decode")
    assert auth is not None and auth.salts == TenantSalts(b"k" * 40) and auth.authenticator.tenant_of("a") == "acme"


# --- the interceptor on a real server ----------------------------------------------------------------


def _whoami(request: bytes, context: grpc.ServicerContext) -> bytes:
    return (current_tenant() or "-").encode()


def _whoami_stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    for i in range(3):
        yield f"{current_tenant() or '-'}:{i}".encode()


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Server with the auth interceptor and a service that answers its caller's tenant."""
    tokens_file = tmp_path_factory.mktemp("auth") / "tokens"
    tokens_file.write_text(f"acme {sha('a-token')}\nglobex {sha('g-token')}\n")
    auth = Auth(Authenticator(tokens_file), TenantSalts(b"k" * 32))
    server = Server("127.0.0.1:0", max_workers=4, interceptors=auth.interceptors())
    handler = grpc.method_handlers_generic_handler("test.Echo", {
        "Who": grpc.unary_unary_rpc_method_handler(_whoami),
        "WhoStream": grpc.unary_stream_rpc_method_handler(_whoami_stream),
    })
    server.add(lambda _servicer, s: s.add_generic_rpc_handlers((handler,)), None, "test.Echo")
    port = server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def _call(addr: str, method: str, metadata: tuple[tuple[str, str], ...] = ()) -> list[str]:
    with grpc.insecure_channel(addr) as channel:
        if method == "Who":
            return [channel.unary_unary("/test.Echo/Who")(b"", metadata=metadata, timeout=10).decode()]
        return [m.decode() for m in channel.unary_stream("/test.Echo/WhoStream")(b"", metadata=metadata, timeout=10)]


@pytest.mark.parametrize("method", ["Who", "WhoStream"])
def test_the_tenant_of_the_token_reaches_unary_and_streaming_handlers(echo_server: str, method: str) -> None:
    got = _call(echo_server, method, (("authorization", "Bearer a-token"),))
    assert got == (["acme"] if method == "Who" else ["acme:0", "acme:1", "acme:2"])
    got = _call(echo_server, method, (("authorization", "bearer   g-token"),))
    assert got[0].startswith("globex")


@pytest.mark.parametrize("method", ["Who", "WhoStream"])
@pytest.mark.parametrize(("metadata", "problem"), [
    ((), "this service requires a bearer token"),
    ((("authorization", "Bearer wrong"),), "the bearer token is not valid"),
    ((("authorization", "a-token"),), "is not 'Bearer <token>'"),
    ((("authorization", "Basic a-token"),), "is not 'Bearer <token>'"),
])
def test_a_call_without_a_valid_token_is_unauthenticated(
    echo_server: str, method: str, metadata: tuple[tuple[str, str], ...], problem: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _call(echo_server, method, metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    details = info.value.details()  # type: ignore[attr-defined]
    assert problem in details and "send metadata authorization: Bearer <token>" in details
    assert "`kvserve token`" in details


def test_a_caller_without_a_token_is_answered_without_its_request_being_waited_for(echo_server: str) -> None:
    """Callers without a token that open calls and never send the request are answered at once: none of them
    holds one of the server's workers waiting for it (4 workers and 8 reserved here, 40 such calls), and a
    caller with a token is served meanwhile."""
    never = threading.Event()

    def silent() -> Iterator[bytes]:
        never.wait()
        yield b""

    with grpc.insecure_channel(echo_server) as channel:
        raw = channel.stream_stream("/test.Echo/WhoStream")  # the request stream left open, nothing sent
        calls = [raw(silent(), timeout=30) for _ in range(40)]
        try:
            for call in calls:
                with pytest.raises(grpc.RpcError) as info:
                    next(call)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
            assert _call(echo_server, "Who", (("authorization", "Bearer a-token"),)) == ["acme"]
        finally:
            never.set()


def test_health_and_reflection_need_no_token(echo_server: str) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(echo_server) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            timeout=10)
        names = {s.name for a in answers for s in a.list_services_response.service}
    assert "test.Echo" in names


# --- a real stack with auth on -----------------------------------------------------------------------


class AuthStack:
    """A stack as secure as `kvserve up` by default, whose tokens file holds two tenants besides the admin
    (`kvserve credentials`, then `kvserve token` for each, as an operator would)."""

    def __init__(self, root: Path) -> None:
        from kvserve.rpc.auth import add_token
        from kvserve.stack.credentials import ensure
        from kvserve.stack.stack import Stack, StackConfig
        from tests.stack_fixtures import BLOCK_SIZE, model_dir

        self.layout, _ = ensure(root / "credentials")
        self.tokens_file = self.layout.tokens
        self.acme = add_token(self.tokens_file, "acme")
        self.globex = add_token(self.tokens_file, "globex")
        self.log_dir = root / "logs"
        self.stack = Stack(StackConfig(
            model_dir=model_dir("llama"), data_dir=root / "data", decode_port=0, prefill_port=0, store_port=0,
            host_capacity="64MiB", disk_capacity="128MiB", block_size=BLOCK_SIZE, credentials=self.layout.root,
        ), log_dir=self.log_dir).start()
        self.addr = self.stack.addr

    def decode_log(self) -> str:
        return (self.log_dir / "decode.log").read_text(errors="replace")

    def client(self, token: str | None, addr: str | None = None) -> Client:
        return Client(addr or self.addr, timeout_s=60, token=token if token is not None else "",
                      tls_ca=self.layout.ca)


@pytest.fixture(scope="module")
def auth_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthStack]:
    s = AuthStack(tmp_path_factory.mktemp("auth-stack"))
    yield s
    s.stack.stop()


def test_the_client_refuses_a_token_it_could_not_send() -> None:
    for bad in ("two words", "tab\tbed", "caf\u00e9"):
        with pytest.raises(ValueError, match="printable ASCII without spaces"):
            Client("127.0.0.1:1", token=bad)


@pytest.mark.slow
def test_the_front_door_refuses_calls_without_a_valid_token(
    auth_stack: AuthStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    for token in ("", "not-a-token", auth_stack.acme[:-1]):
        with auth_stack.client(token) as c, pytest.raises(UnauthenticatedError) as info:
            c.generate(token_ids=[1, 2, 3], max_tokens=1)
        assert "send metadata authorization: Bearer <token>" in info.value.details
    ca = grpc.ssl_channel_credentials(auth_stack.layout.ca.read_bytes())
    with grpc.secure_channel(auth_stack.addr, ca) as channel:  # balancers check health without a token
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert "auth is on: 3 token(s) of 3 tenant(s)" in auth_stack.decode_log()  # acme, globex and the admin
    monkeypatch.setenv("KVSERVE_TOKEN", auth_stack.acme)  # the client's default
    with Client(auth_stack.addr, timeout_s=60, tls_ca=auth_stack.layout.ca) as c:
        assert c.generate(token_ids=[1, 2, 3], max_tokens=1, ignore_eos=True).usage.completion_tokens == 1


@pytest.mark.slow
def test_tenants_never_share_cached_blocks(auth_stack: AuthStack) -> None:
    from tests.stack_fixtures import BLOCK_SIZE, tokens

    prompt = tokens(3 * BLOCK_SIZE + 5, seed=4242)
    request: dict[str, Any] = dict(token_ids=prompt, max_tokens=2, ignore_eos=True, cache_salt="shared")
    full_blocks = 3 * BLOCK_SIZE
    with auth_stack.client(auth_stack.acme) as acme, auth_stack.client(auth_stack.globex) as globex:
        assert acme.generate(**request).usage.cached_tokens == 0
        assert acme.generate(**request).usage.cached_tokens == full_blocks  # its own cache
        answer = globex.generate(**request)
        assert answer.usage.cached_tokens == 0  # same prompt, same cache_salt, another tenant
        assert globex.generate(**request).usage.cached_tokens == full_blocks
        # Inside a tenant, the client's salt still narrows.
        assert acme.generate(**{**request, "cache_salt": "other"}).usage.cached_tokens == 0
        assert answer.token_ids == acme.generate(**request).token_ids  # the same model answers alike


@pytest.mark.slow
def test_sighup_reloads_the_tokens_file_and_a_bad_one_keeps_the_old(
    auth_stack: AuthStack, capsys: pytest.CaptureFixture[str]
) -> None:
    decode = auth_stack.stack.service("decode").process
    good = auth_stack.tokens_file.read_text()
    auth_stack.tokens_file.write_text(good + "initech not-a-hash\n")
    decode.send_signal(signal.SIGHUP)
    wait_until(lambda: "tokens file not reloaded" in auth_stack.decode_log(), timeout_s=60, interval_s=0.1,
               message="the reload's error not seen in the decode log")
    with auth_stack.client(auth_stack.acme) as c:  # the old table stays
        assert c.generate(token_ids=[1, 2, 3], max_tokens=1, ignore_eos=True).usage.completion_tokens == 1

    auth_stack.tokens_file.write_text(good)
    initech = issue(auth_stack.tokens_file, "initech", capsys)
    with auth_stack.client(initech) as c, pytest.raises(UnauthenticatedError):
        c.generate(token_ids=[1, 2, 3], max_tokens=1)  # not loaded yet
    decode.send_signal(signal.SIGHUP)

    def works() -> bool:
        with auth_stack.client(initech) as c:
            try:
                return c.generate(token_ids=[1, 2, 3], max_tokens=1, ignore_eos=True).usage.completion_tokens == 1
            except UnauthenticatedError:
                return False

    wait_until(works, timeout_s=60, interval_s=0.1, message="the new tenant's token not accepted after SIGHUP")
    assert decode.poll() is None


@pytest.mark.slow
def test_decode_refuses_to_start_with_tokens_but_no_secret(tmp_path: Path) -> None:
    """The tokens file named by $KVSERVE_AUTH_TOKENS: the flag's environment default reaches decode."""
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(f"acme {sha('a')}\n")
    make_certs(tmp_path / "certs", ["decode"])
    env = {**os.environ, "KVSERVE_AUTH_TOKENS": str(tokens_file)}
    done = subprocess.run([sys.executable, "-m", "decode_service", "--model", str(tmp_path / "no-model"),
                           *flags(tmp_path / "certs", "decode")], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 2, done.stderr
    assert f"decode: no server secret at {tokens_file}.secret" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_router_passes_each_callers_token_to_the_replica(auth_stack: AuthStack, tmp_path: Path) -> None:
    """The router holds no token table: the replica authenticates each request (and scopes its prefix
    hashes to the tenant); the router's own calls (load, events) use its service token (--token-file, from
    decode's --service-tokens), over TLS with its own certificate."""
    from kvserve.stack.stack import start_service, stop_service

    layout = auth_stack.layout
    router = start_service("router", "kvserve.router", ["--listen", "127.0.0.1:0", "--decode", auth_stack.addr,
                                                "--token-file", str(layout.router_token),
                                                *layout.tls_flags("router")], tmp_path / "router.log")
    try:
        wait_until(lambda: "is healthy" in (tmp_path / "router.log").read_text(), timeout_s=60, interval_s=0.1,
                   message="the router never saw its replica")
        for token in ("", "not-a-token"):
            with auth_stack.client(token, router.addr) as c, pytest.raises(UnauthenticatedError):
                c.generate(token_ids=[1, 2, 3], max_tokens=1)
        with auth_stack.client(auth_stack.acme, router.addr) as c:
            assert len(c.generate(token_ids=list(range(40)), max_tokens=3, ignore_eos=True).token_ids) == 3
    finally:
        stop_service(router)
    assert "does not tell its load" not in (tmp_path / "router.log").read_text()
