"""`kvserve health ADDR`: exit 0 for SERVING, 1 for any other answer (draining, an unknown service), 2 when
the server cannot be asked; against a real store server, plaintext and with mTLS, and against one of a
`kvserve up` on this host, whose admin certificate it finds with no flags."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import local
from client.cli import main as kvserve
from kvstore.config import StoreConfig
from kvstore.server import SERVICE_NAME, StoreServer
from rpc.certs import make_certs
from rpc.tls import ENV_CA, ENV_CERT, ENV_KEY, TLSConfig
from stack.credentials import ensure
from tests.kvstore_fixtures import REPO, running_server


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StoreServer]:
    with running_server(tmp_path, shm=False) as server:
        yield server


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    make_certs(d, ["kvstore", "client"])
    return d


@pytest.fixture
def mtls_store(tmp_path: Path, certs: Path) -> Iterator[StoreServer]:
    tls = TLSConfig.load(certs / "kvstore.pem", certs / "kvstore-key.pem", certs / "ca.pem")
    server = StoreServer(StoreConfig(shm=False), tls=tls)
    server.start()
    yield server
    server.stop(grace_s=0.5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_serving_server_exits_0(store: StoreServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert kvserve(["health", store.address]) == 0
    assert capsys.readouterr().out == f"{store.address}: SERVING\n"
    assert kvserve(["health", store.address, "--service", SERVICE_NAME, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"addr": store.address, "service": SERVICE_NAME, "status": "SERVING"}


def test_an_unknown_service_and_a_draining_server_exit_1(store: StoreServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert kvserve(["health", store.address, "--service", "kvserve.v1.Nothing"]) == 1
    assert capsys.readouterr().out == f"{store.address} kvserve.v1.Nothing: SERVICE_UNKNOWN\n"
    store.rpc.drain()  # what SIGTERM does first: balancers and probes stop sending it requests
    assert kvserve(["health", store.address]) == 1
    assert capsys.readouterr().out == f"{store.address}: NOT_SERVING\n"


def test_nothing_listening_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    addr = f"127.0.0.1:{_free_port()}"
    assert kvserve(["health", addr, "--timeout", "5"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"{addr}: not reachable: UNAVAILABLE") and err.count("\n") == 1


@pytest.mark.parametrize("argv", [["--timeout", "0"], ["--tls-cert", "c.pem"], ["--tls-ca", "/nonexistent/ca.pem"], []])
def test_bad_arguments_exit_2(argv: list[str], store: StoreServer, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (ENV_CA, ENV_CERT, ENV_KEY):
        monkeypatch.delenv(var, raising=False)
    args = ["health", *argv] if not argv else ["health", store.address, *argv]
    try:
        code = kvserve(args)
    except SystemExit as exc:  # argparse's own refusal
        code = int(exc.code or 0)
    assert code == 2


def test_mtls_needs_a_certificate_from_the_ca(mtls_store: StoreServer, certs: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (ENV_CA, ENV_CERT, ENV_KEY):
        monkeypatch.delenv(var, raising=False)
    addr = mtls_store.address
    client = ["--tls-cert", str(certs / "client.pem"), "--tls-key", str(certs / "client-key.pem")]
    assert kvserve(["health", addr, "--tls-ca", str(certs / "ca.pem"), *client]) == 0
    assert kvserve(["health", addr, "--tls-ca", str(certs / "ca.pem")]) == 2  # no certificate: refused
    assert kvserve(["health", addr]) == 2  # plaintext to a TLS server
    # A container's health check: the service's own KVSERVE_TLS_* variables, no flags.
    monkeypatch.setenv(ENV_CERT, str(certs / "kvstore.pem"))
    monkeypatch.setenv(ENV_KEY, str(certs / "kvstore-key.pem"))
    monkeypatch.setenv(ENV_CA, str(certs / "ca.pem"))
    assert kvserve(["health", addr]) == 0


def test_a_server_of_an_up_on_this_host_is_asked_with_its_admin_certificate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No flags: the credentials that `up` registered for the port (client/local.py) are used, and only while
    they are registered."""
    for var in (ENV_CA, ENV_CERT, ENV_KEY):
        monkeypatch.delenv(var, raising=False)
    layout, _ = ensure(tmp_path / "data")
    server = StoreServer(StoreConfig(shm=False), tls=TLSConfig.load(*layout.cert("kvstore"), layout.ca))
    port = server.start()
    addr = f"127.0.0.1:{port}"
    try:
        assert kvserve(["health", addr]) == 2  # no `up` named it: plaintext, refused
        local.register([port], layout.root)
        assert kvserve(["health", addr]) == 0
        local.unregister([port], layout.root)
        assert kvserve(["health", addr]) == 2
    finally:
        local.unregister([port])
        server.stop(grace_s=0.5)


def test_the_kvserve_command_exits_with_the_status(store: StoreServer) -> None:
    """What a compose health check runs: the installed command, as a process."""
    kvserve_bin = Path(sys.executable).parent / "kvserve"
    command = [str(kvserve_bin)] if kvserve_bin.exists() else [sys.executable, "-m", "client.cli"]
    done = subprocess.run([*command, "health", store.address], capture_output=True, text=True, cwd=REPO,
                          timeout=60)
    assert (done.returncode, done.stdout) == (0, f"{store.address}: SERVING\n")
    store.rpc.drain()
    done = subprocess.run([*command, "health", store.address], capture_output=True, text=True, cwd=REPO,
                          timeout=60)
    assert (done.returncode, done.stdout) == (1, f"{store.address}: NOT_SERVING\n")


def test_the_health_listener_is_as_secure_as_the_port_and_drains_with_it(
        tmp_path: Path, certs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--health-listen: the probes' own address answers health only, with the main port's TLS (an mTLS store:
    a certificate from the CA), and says NOT_SERVING once the server drains."""
    for var in (ENV_CA, ENV_CERT, ENV_KEY):
        monkeypatch.delenv(var, raising=False)
    health_addr = f"127.0.0.1:{_free_port()}"
    tls = TLSConfig.load(certs / "kvstore.pem", certs / "kvstore-key.pem", certs / "ca.pem")
    server = StoreServer(StoreConfig(shm=False), tls=tls, health_listen=health_addr)
    server.start()
    try:
        client = ["--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / "client.pem"),
                  "--tls-key", str(certs / "client-key.pem")]
        assert kvserve(["health", health_addr, *client]) == 0
        assert kvserve(["health", health_addr, "--service", SERVICE_NAME, *client]) == 0
        assert kvserve(["health", health_addr]) == 2  # plaintext: refused, as on the main port
        assert kvserve(["health", health_addr, "--tls-ca", str(certs / "ca.pem")]) == 2  # no certificate
        # Watch, which holds a worker for as long as the caller likes, is not served there.
        channel = grpc.secure_channel(health_addr, grpc.ssl_channel_credentials(
            (certs / "ca.pem").read_bytes(), (certs / "client-key.pem").read_bytes(), (certs / "client.pem").read_bytes()))
        with channel, pytest.raises(grpc.RpcError) as info:
            next(health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        server.rpc.drain()
        assert kvserve(["health", health_addr, *client]) == 1
    finally:
        server.stop(grace_s=0.5)
