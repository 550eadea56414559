"""`kvserve health ADDR`: exit 0 for SERVING, 1 for any other answer (draining, an unknown service), 2 when
the server cannot be asked; against a real store server, plaintext and with mTLS, and against one of a
`kvserve up` on this host, whose admin certificate it finds with no flags. `kvserve health URL` (the HTTP
front's /health): exit 0 for HTTP 200 only, against a stdlib HTTP server, plain and over TLS."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import local
from kvserve.cli.commands import main as kvserve
from kvserve.rpc.certs import make_certs
from kvserve.rpc.tls import ENV_CA, ENV_CERT, ENV_KEY, TLSConfig
from kvserve.stack.credentials import ensure
from kvstore.config import StoreConfig
from kvstore.server import SERVICE_NAME, StoreServer
from tests.http_fixtures import http_server
from tests.kvstore_fixtures import REPO, running_server


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StoreServer]:
    with running_server(tmp_path, shm=False) as server:
        yield server


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    make_certs(d, ["kvstore", "client", "http"])
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
    assert out == "" and err == f"{addr}: not reachable: nothing listens at {addr} (connection refused)\n"


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
    command = [str(kvserve_bin)] if kvserve_bin.exists() else [sys.executable, "-m", "kvserve.cli"]
    done = subprocess.run([*command, "health", store.address], capture_output=True, text=True, cwd=REPO,
                          timeout=60)
    assert (done.returncode, done.stdout) == (0, f"{store.address}: SERVING\n")
    store.rpc.drain()
    done = subprocess.run([*command, "health", store.address], capture_output=True, text=True, cwd=REPO,
                          timeout=60)
    assert (done.returncode, done.stdout) == (1, f"{store.address}: NOT_SERVING\n")


def test_the_probe_imports_only_what_asking_health_needs(store: StoreServer) -> None:
    """`kvserve health` runs every few seconds in each container, beside a service that may be busy: it loads
    neither the stack, its supervisor nor cryptography (what the other commands need), nor HTTP for a gRPC
    address."""
    script = ("import sys; import kvserve.cli as entry; sys.argv = ['kvserve', 'health', sys.argv[1]]; rc = entry.main(); "
              "print(rc, sorted(m for m in sys.modules if m.split('.')[0] in ('cryptography', 'http', 'torch') "
              "or m.startswith(('kvserve.stack.', 'kvserve.http')) and m != 'kvserve.stack.status'))")
    done = subprocess.run([sys.executable, "-c", script, store.address], capture_output=True, text=True, cwd=REPO,
                          timeout=60)
    assert done.stdout.splitlines()[-1] == "0 []", (done.stdout, done.stderr)


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


# -- an http:// or https:// URL: the HTTP front's /health ------------------------------------------------


@pytest.fixture
def plain_port() -> Iterator[int]:
    with http_server() as port:
        yield port


@pytest.fixture
def tls_port(certs: Path) -> Iterator[int]:
    """An HTTPS server with the certificate `kvserve credentials` makes the HTTP front (http.pem)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs / "http.pem", certs / "http-key.pem")
    with http_server(context) as port:
        yield port


@pytest.fixture
def no_tls_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (ENV_CA, ENV_CERT, ENV_KEY):
        monkeypatch.delenv(var, raising=False)


def _health(*argv: str) -> int:
    try:
        return kvserve(["health", *argv])
    except SystemExit as exc:  # argparse's own refusal
        return int(exc.code or 0)


@pytest.mark.parametrize("path, code, line", [
    ("/health", 0, "SERVING"),
    ("/down", 1, 'NOT_SERVING (HTTP 503 Service Unavailable: {"status": "NOT_SERVING", "upstream": '
                 '"router:50050: UNAVAILABLE"})'),
    ("/nothing", 1, "NOT_SERVING (HTTP 404 Not Found: no such page)"),
    ("/moved", 1, "NOT_SERVING (HTTP 302 Found)"),  # a redirect is not followed: the probe's URL is wrong
])
def test_a_url_exits_0_only_for_http_200(path: str, code: int, line: str, plain_port: int, no_tls_env: None,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{plain_port}{path}"
    assert _health(url) == code
    assert capsys.readouterr() == (f"{url}: {line}\n", "")
    assert _health(url, "--json") == code
    report = json.loads(capsys.readouterr().out)
    status = int(line.split("HTTP ")[1][:3]) if code else 200
    assert {k: report[k] for k in ("addr", "service", "status", "http_status")} == {
        "addr": url, "service": "", "status": line.split()[0], "http_status": status}
    assert ("error" in report) == (code != 0) and report.get("error", "") in line


def test_a_url_nobody_answers_exits_2_with_one_line(no_tls_env: None, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{_free_port()}/health"
    assert _health(url) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"{url}: not reachable: connection refused (nothing listens there)\n"
    assert _health(url, "--json") == 2
    assert json.loads(capsys.readouterr().out) == {
        "addr": url, "service": "", "status": "UNREACHABLE", "error": "connection refused (nothing listens there)"}


def test_a_url_that_never_answers_exits_2_within_the_timeout(no_tls_env: None,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A hung server: the kernel takes the connection, nobody reads the request."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/health"
        assert _health(url, "--timeout", "0.3") == 2
    assert capsys.readouterr().err == f"{url}: not reachable: no answer within 0.3 s\n"


def test_an_https_url_is_checked_against_the_ca(tls_port: int, plain_port: int, certs: Path, tmp_path: Path,
                                                no_tls_env: None, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """--tls-ca (or $KVSERVE_TLS_CA) trusts the server's CA; without it, or with another CA, the handshake fails
    and says why; the wrong scheme either way says so."""
    url = f"https://127.0.0.1:{tls_port}/health"
    ca = str(certs / "ca.pem")
    assert _health(url, "--tls-ca", ca) == 0
    assert capsys.readouterr().out == f"{url}: SERVING\n"
    assert _health(f"https://localhost:{tls_port}/down", "--tls-ca", ca) == 1  # a name the certificate holds

    other = tmp_path / "other"
    make_certs(other, ["x"])
    for argv in ([url], [url, "--tls-ca", str(other / "ca.pem")]):  # the system's CAs; a CA that did not sign it
        capsys.readouterr()
        assert _health(*argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"{url}: not reachable: TLS: the server's certificate is not trusted")
        assert "--tls-ca" in err and err.count("\n") == 1

    assert _health(f"http://127.0.0.1:{tls_port}/health") == 2  # plaintext to an HTTPS server
    assert capsys.readouterr().err.endswith("without an HTTP answer (an HTTPS server? ask https://)\n")
    assert _health(f"https://127.0.0.1:{plain_port}/health", "--tls-ca", ca) == 2  # TLS to a plain one
    err = capsys.readouterr().err
    assert err.startswith(f"https://127.0.0.1:{plain_port}/health: not reachable: TLS: ") and err.count("\n") == 1
    assert err.endswith("a plain HTTP server? ask http://\n")

    monkeypatch.setenv(ENV_CA, ca)  # a container's check: the CA from the variable, no flag
    assert _health(url) == 0


def test_an_https_url_of_an_up_on_this_host_is_checked_against_its_ca(tmp_path: Path, no_tls_env: None) -> None:
    """No flags: the CA of the `kvserve up` registered for the port, as for a gRPC address; the HTTP front's
    certificate is one `kvserve credentials` makes."""
    layout, _ = ensure(tmp_path / "data")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*layout.cert("http"))
    with http_server(context) as port:
        url = f"https://127.0.0.1:{port}/health"
        try:
            assert _health(url) == 2  # the system's CAs: not trusted
            local.register([port], layout.root)
            assert _health(url) == 0
        finally:
            local.unregister([port])


@pytest.mark.parametrize("argv, message", [
    (["--service", "kvserve.v1.Decode"], "--service names a gRPC service"),
    (["--tls-ca", "/nonexistent/ca.pem"], "--tls-ca /nonexistent/ca.pem: No such file or directory"),
    (["--tls-ca", __file__], "not a PEM certificate"),
    (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
])
def test_bad_arguments_for_a_url_exit_2_saying_which(argv: list[str], message: str, tls_port: int,
                                                     no_tls_env: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert _health(f"https://127.0.0.1:{tls_port}/health", *argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("health: ") and message in err


def test_a_url_without_a_host_exits_2(no_tls_env: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert _health("http://:8000/health") == 2
    assert "not an http:// or https:// URL with a host" in capsys.readouterr().err


def test_the_kvserve_command_checks_a_url(tls_port: int, certs: Path) -> None:
    """What the HTTP front's compose health check and Kubernetes probe run: the installed command, as a process."""
    kvserve_bin = Path(sys.executable).parent / "kvserve"
    command = [str(kvserve_bin)] if kvserve_bin.exists() else [sys.executable, "-m", "kvserve.cli"]
    url = f"https://127.0.0.1:{tls_port}/health"
    env = {k: v for k, v in os.environ.items() if k not in (ENV_CA, ENV_CERT, ENV_KEY)}
    done = subprocess.run([*command, "health", url, "--tls-ca", str(certs / "ca.pem")], capture_output=True,
                          text=True, cwd=REPO, timeout=60, env=env)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{url}: SERVING\n", "")
