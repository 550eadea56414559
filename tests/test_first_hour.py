"""The first hour with kvserve (issue 29): where a command fails because of how the server is set up (TLS, a
client certificate, a token, nothing running), its one line names the fix, with the real files where the
registry of local `kvserve up`s or DATA_DIR/up.json knows them; and generate, chat, health and stats find
the `kvserve up` of a data dir by its up.json. Against real servers on loopback: a fake front door over
TLS or with tokens, a store with mTLS, plaintext ones; and an up.json written as `up` writes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from client import local
from client.local import Layout
from kvserve.cli import commands as cli
from kvserve.rpc.auth import Auth, Authenticator, TenantSalts, token_digest
from kvserve.rpc.certs import make_certs
from kvserve.rpc.server import Server
from kvserve.rpc.tls import TLSConfig
from kvserve.stack.credentials import ensure
from kvserve.stack.status import STATUS_FILE, ServiceStatus, UpStatus, write_status
from kvstore.config import StoreConfig
from kvstore.server import StoreServer
from protos.kvserve.v1 import decode_pb2_grpc
from tests.fake_decode import DECODE_SERVICE, FakeDecode
from tests.kvstore_fixtures import REPO
from tests.processes import free_ports

NO_TOKEN = "a bearer token with --token TOKEN or KVSERVE_TOKEN (`kvserve token TENANT` makes one"


@pytest.fixture(autouse=True)
def _no_client_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KVSERVE_TLS_CA", "KVSERVE_TLS_CERT", "KVSERVE_TLS_KEY", "KVSERVE_TOKEN"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    """A node's credentials, as `kvserve up` makes them in its data dir (where a test writes its up.json)."""
    return ensure(tmp_path / "data")[0]


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("other")
    make_certs(d, ["decode"])
    return d / "ca.pem"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@contextmanager
def front_door(tls: TLSConfig | None = None, auth: Auth | None = None) -> Iterator[str]:
    """A fake decode service ("x" per token) on a real server: TLS without client certificates (as decode
    serves), or plaintext; with `auth`, bearer tokens."""
    server = Server("127.0.0.1:0", tls=tls, require_client_cert=False,
                    interceptors=() if auth is None else auth.interceptors())
    server.add(decode_pb2_grpc.add_DecodeServicer_to_server, FakeDecode(), DECODE_SERVICE)
    port = server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


@contextmanager
def store(layout: Layout | None = None) -> Iterator[StoreServer]:
    """A real store: with `layout`, mTLS with its certificate and metrics over HTTPS, as `up` serves it."""
    tls = None if layout is None else TLSConfig.load(*layout.cert("kvstore"), layout.ca)
    server = StoreServer(StoreConfig(shm=False), metrics_port=0, tls=tls)
    server.start()
    try:
        yield server
    finally:
        server.stop(grace_s=0.5)


def write_up(data_dir: Path, services: dict[str, str], layout: Layout | None = None,
             metrics: dict[str, str] | None = None) -> None:
    """DATA_DIR/up.json of a running `kvserve up` (this process) serving `services` (name: addr)."""
    now = time.time()
    statuses = {name: ServiceStatus("running", os.getpid(), addr, 0, now, None, None, (metrics or {}).get(name))
                for name, addr in services.items()}
    data_dir.mkdir(parents=True, exist_ok=True)
    write_status(data_dir / STATUS_FILE, UpStatus(
        os.getpid(), now, now, services.get("decode", ""), statuses, insecure=layout is None,
        credentials=None if layout is None else str(layout.root), ca=None if layout is None else str(layout.ca),
        admin_token=None if layout is None else str(layout.admin_token)))


def test_a_plaintext_call_of_a_tls_front_door_names_the_ca_and_the_token(
        layout: Layout, other_ca: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """gRPC says "Socket closed"; the CLI says the server speaks TLS, and which files to pass. Where the up.json
    of --data-dir names the address, even where this host's registry does not, it calls with that up's CA
    (and admin token) by itself, and a wrong CA's message names that up's."""
    with front_door(TLSConfig.load(*layout.cert("decode"), layout.ca)) as addr:
        code, _, err = run(["generate", "--addr", addr, "--data-dir", str(tmp_path), "hi"], capsys)
        assert code == 2 and err == (f"kvserve generate: the server at {addr} speaks TLS: pass --tls-ca CA.pem "
                                     f"(DATA_DIR/certs/ca.pem of the server's `kvserve up`) and {NO_TOKEN})\n")
        write_up(layout.root, {"decode": addr}, layout)
        data = ["--data-dir", str(layout.root)]
        code, out, err = run(["generate", "--addr", addr, *data, "--max-tokens", "2", "hi"], capsys)
        assert code == 0 and out == "xx\n", err
        code, _, err = run(["generate", "--addr", addr, *data, "--tls-ca", str(other_ca), "hi"], capsys)
        assert code == 2 and err == (f"kvserve generate: the certificate of the server at {addr} is not signed by "
                                     f"the CA in {other_ca}: pass --tls-ca {layout.ca}\n")
        code, out, err = run(["generate", "--addr", addr, *data, "--tls-ca", str(layout.ca), "--max-tokens", "2",
                              "hi"], capsys)
        assert code == 0 and out == "xx\n", err


def test_a_wrong_ca_is_one_line_without_grpc_core_logs(layout: Layout, other_ca: Path) -> None:
    """The installed command: gRPC core's log line of the failed handshake stays off stderr, and the message
    does not end in gRPC's ": OK"."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    with front_door(TLSConfig.load(*layout.cert("decode"), layout.ca)) as addr:
        done = subprocess.run([sys.executable, "-m", "kvserve.cli", "generate", "--addr", addr, "--tls-ca",
                               str(other_ca), "hi"], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert done.returncode == 2
    assert done.stderr == (f"kvserve generate: the certificate of the server at {addr} is not signed by the CA in "
                           f"{other_ca}: pass --tls-ca with the CA that signed it\n")


def test_a_refused_token_names_the_flag_and_the_variable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"acme {token_digest('a-token').hex()}\n")
    with front_door(auth=Auth(Authenticator(tokens), TenantSalts(b"k" * 32))) as addr:
        data = ["--data-dir", str(tmp_path)]
        code, _, err = run(["generate", "--addr", addr, *data, "hi"], capsys)
        assert code == 2 and err == f"kvserve generate: this service requires a bearer token: pass {NO_TOKEN})\n"
        code, _, err = run(["generate", "--addr", addr, *data, "--token", "wrong", "hi"], capsys)
        assert code == 2 and err == (f"kvserve generate: the bearer token is not valid (unknown or revoked): "
                                     f"pass {NO_TOKEN})\n")
        code, out, _ = run(["generate", "--addr", addr, *data, "--token", "a-token", "--max-tokens", "1", "hi"], capsys)
        assert code == 0 and out == "x\n"


def test_health_of_an_mtls_store_says_it_wants_a_client_certificate(
        layout: Layout, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Not "not reachable: Socket closed", which reads as "down": the store takes only callers with a
    certificate from its CA, and these flags give one; without them, the admin certificate of the up that
    serves it (up.json's, here) is used."""
    cert, key = layout.admin_cert
    with store(layout) as server:
        addr = server.address
        code, _, err = run(["health", addr, "--data-dir", str(tmp_path / "none")], capsys)
        assert code == 2 and err == (
            f"{addr}: not reachable: the server at {addr} speaks TLS and takes only callers with a certificate from "
            "its CA: pass --tls-ca CA.pem (DATA_DIR/certs/ca.pem of the server's `kvserve up`) --tls-cert CERT.pem "
            "--tls-key KEY.pem (a certificate from the server's CA, e.g. DATA_DIR/admin/admin.pem and admin-key.pem "
            "of its `kvserve up`) (without them, `kvserve health` and `stats` present the admin certificate of the "
            f"`kvserve up` on this host that serves {addr}: none is registered in {local.home() / 'up'} or in "
            "--data-dir's up.json)\n")
        write_up(layout.root, {"kvstore": addr}, layout)
        data = ["--data-dir", str(layout.root)]
        code, _, err = run(["health", addr, *data, "--tls-ca", str(layout.ca)], capsys)
        assert code == 2 and err == (f"{addr}: not reachable: the server at {addr} takes only callers with a "
                                     "certificate from its CA, and this call presented none: pass --tls-cert "
                                     f"{cert} --tls-key {key}\n")
        code, out, _ = run(["health", addr, *data], capsys)
        assert code == 0 and out == f"{addr}: SERVING\n"
        code, out, _ = run(["health", addr, "--tls-ca", str(layout.ca), "--tls-cert", str(cert), "--tls-key", str(key)],
                           capsys)
        assert code == 0 and out == f"{addr}: SERVING\n"


def test_a_tls_call_of_a_plaintext_server_says_to_drop_the_ca(layout: Layout, capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    with store() as server:
        code, _, err = run(["health", server.address, "--tls-ca", str(layout.ca)], capsys)
    assert code == 2 and err == (f"{server.address}: not reachable: the server at {server.address} speaks plaintext, "
                                 "not TLS (an `up --insecure`?): call it without --tls-ca (nor KVSERVE_TLS_CA)\n")


def test_generate_and_health_without_an_address_ask_the_up_of_the_data_dir(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with front_door() as addr, store() as server:
        write_up(tmp_path, {"kvstore": server.address, "decode": addr})
        code, out, err = run(["generate", "--data-dir", str(tmp_path), "--max-tokens", "3", "hi"], capsys)
        assert code == 0 and out == "xxx\n", err
        code, out, _ = run(["health", "--data-dir", str(tmp_path)], capsys)
        assert code == 0 and out == f"{server.address}: SERVING\n{addr}: SERVING\n"
    empty = tmp_path / "empty"
    code, _, err = run(["health", "--data-dir", str(empty)], capsys)
    assert code == 2 and err == (f"health: no `kvserve up` runs in {empty} (no {empty / STATUS_FILE}): give ADDR, or "
                                 "start one with `kvserve up`\n")


def test_with_nothing_running_generate_and_stats_say_to_start_an_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    front, store_port = free_ports(2)
    monkeypatch.setattr(cli, "DEFAULT_ADDR", f"127.0.0.1:{front}")
    monkeypatch.setattr(cli, "DEFAULT_STORE_ADDR", f"127.0.0.1:{store_port}")
    no_up = f"and no `kvserve up` runs in {tmp_path} (no {tmp_path / STATUS_FILE}): start one with `kvserve up`"
    code, _, err = run(["stats", "--data-dir", str(tmp_path)], capsys)
    assert code == 2 and err == (f"kvserve stats: nothing listens at 127.0.0.1:{store_port} (the default store "
                                 f"address), {no_up}, or pass --kvstore\n")
    code, _, err = run(["generate", "--data-dir", str(tmp_path), "hi"], capsys)
    assert code == 2 and err.endswith(f"kvserve generate: nothing listens at 127.0.0.1:{front} (the default front "
                                      f"door address), {no_up}, or pass --addr\n")


def test_stats_reads_the_store_and_the_metrics_of_the_up_from_up_json(
        layout: Layout, capsys: pytest.CaptureFixture[str]) -> None:
    """No --kvstore, no --metrics: the up's store, over mTLS with the admin certificate its registration names,
    and its metrics page over HTTPS."""
    with store(layout) as server:
        url = f"https://127.0.0.1:{server.rpc.bound_metrics_port}/metrics"
        write_up(layout.root, {"kvstore": server.address}, layout, metrics={"kvstore": url})
        local.register([server.port], layout.root)
        try:
            code, out, err = run(["stats", "--data-dir", str(layout.root), "--json"], capsys)
            assert code == 0, err
            report = json.loads(out)
            assert report["up"]["ca"] == str(layout.ca) and report["up"]["services"]["kvstore"]["metrics_url"] == url
            assert 'kvserve_kvstore_blocks{tier="host"}' in report["services"][url]
            code, out, err = run(["stats", "--data-dir", str(layout.root)], capsys)
            assert code == 0 and f"TLS: CA {layout.ca}, admin token in {layout.admin_token}\n" in out
            assert f"\n{url}\n  kvserve_kvstore_blocks" in out, out
        finally:
            local.unregister([server.port])


def test_stats_uses_a_data_dirs_credentials_only_for_its_ups_addresses(
        layout: Layout, capsys: pytest.CaptureFixture[str]) -> None:
    """--kvstore of a plaintext store, beside a data dir whose up serves elsewhere: asked in plaintext, not with
    the data dir's admin certificate."""
    with store() as server:
        code, out, err = run(["stats", "--data-dir", str(layout.root), "--kvstore", server.address], capsys)
    assert code == 0 and f"KV store {server.address}: leases 0" in out, err
