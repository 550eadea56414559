"""mTLS between the services: `kvserve certs` makes a valid chain; a store started with --tls-* refuses
plaintext callers and callers without a certificate from its CA, and serves those with one (over gRPC
and its same-host arena); the front door serves TLS without client certificates; a whole stack with
mTLS generates what Hugging Face does."""

from __future__ import annotations

import json
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.cli.commands import main as kvserve
from kvserve.rpc.certs import flags, make_certs
from kvserve.rpc.cli import tls_from_args
from kvserve.rpc.server import Server
from kvserve.rpc.tls import ENV_CA, ENV_CERT, ENV_KEY, TLSConfig, TLSError, channel
from kvserve.stack.stack import Service, start_service, stop_service
from kvstore import KVStoreClient
from protos.block_hash import BlockHash

NAMES = ("kvstore", "prefill", "decode", "router", "http")
KEY = BlockHash(b"k" * 32)


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _hosts(cert: x509.Certificate) -> set[str]:
    return {str(g.value) for g in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    assert kvserve(["certs", str(d), "--san", "kv.example", "--san", "10.0.0.7"]) == 0
    assert kvserve(["certs", str(d), "--name", "client"]) == 0  # a tool's certificate, as `admin` is
    return d


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second CA with a client certificate: valid, but not from the store's CA."""
    d = tmp_path_factory.mktemp("other")
    assert kvserve(["certs", str(d), "--name", "client"]) == 0
    return d


def client_tls(d: Path, name: str = "client", ca: Path | None = None) -> TLSConfig:
    return TLSConfig.load(d / f"{name}.pem", d / f"{name}-key.pem", ca or d / "ca.pem")


# --- kvserve certs ------------------------------------------------------------------------------


def test_certs_make_a_chain_every_service_can_serve_and_present(certs: Path) -> None:
    ca = _cert(certs / "ca.pem")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    ca.verify_directly_issued_by(ca)
    assert stat.S_IMODE((certs / "ca-key.pem").stat().st_mode) == 0o600
    for name in NAMES:
        cert = _cert(certs / f"{name}.pem")
        cert.verify_directly_issued_by(ca)  # raises if the CA did not sign it
        assert _hosts(cert) == {name, "localhost", "127.0.0.1", "::1", "kv.example", "10.0.0.7"}
        client = [] if name == "http" else [ExtendedKeyUsageOID.CLIENT_AUTH]  # the public HTTPS edge: a server's
        assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
            ExtendedKeyUsageOID.SERVER_AUTH, *client]
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        public_key = cert.public_key()
        assert isinstance(public_key, ec.EllipticCurvePublicKey) and public_key.curve.name == "secp256r1"
        assert stat.S_IMODE((certs / f"{name}-key.pem").stat().st_mode) == 0o600
        TLSConfig.load(certs / f"{name}.pem", certs / f"{name}-key.pem", certs / "ca.pem")  # the key is the cert's
    assert sorted(p.name for p in certs.iterdir()) == sorted(
        ["ca.pem", "ca-key.pem", *(f"{n}{suffix}.pem" for n in (*NAMES, "client") for suffix in ("", "-key"))])


def test_certs_print_the_flags_to_start_each_service(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kvserve(["certs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("kvstore", "prefill", "decode"):
        assert f"kvserve {name} {' '.join(flags(tmp_path, name))}" in out
    assert f"{ENV_CERT}, {ENV_KEY}, {ENV_CA}" in out


def test_certs_keep_the_ca_and_refuse_to_overwrite_without_force(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kvserve(["certs", str(tmp_path), "--name", "kvstore"]) == 0
    ca, store = (tmp_path / "ca.pem").read_bytes(), (tmp_path / "kvstore.pem").read_bytes()
    capsys.readouterr()

    assert kvserve(["certs", str(tmp_path), "--name", "kvstore"]) == 1
    err = capsys.readouterr().err
    assert "kvstore" in err and "--force" in err
    assert (tmp_path / "kvstore.pem").read_bytes() == store

    assert kvserve(["certs", str(tmp_path), "--name", "router", "--json"]) == 0  # added later: same CA
    report = json.loads(capsys.readouterr().out)
    assert report["ca"]["new"] is False and set(report["certs"]) == {"router"}
    assert report["certs"]["router"]["flags"] == flags(tmp_path, "router")
    _cert(tmp_path / "router.pem").verify_directly_issued_by(_cert(tmp_path / "ca.pem"))

    assert kvserve(["certs", str(tmp_path), "--name", "kvstore", "--force"]) == 0
    assert (tmp_path / "ca.pem").read_bytes() == ca
    assert (tmp_path / "kvstore.pem").read_bytes() != store

    store = (tmp_path / "kvstore.pem").read_bytes()  # what `kvserve up` calls on every start
    assert set(make_certs(tmp_path, keep_existing=True).written) == {"prefill", "decode", "http"}
    assert (tmp_path / "kvstore.pem").read_bytes() == store and (tmp_path / "ca.pem").read_bytes() == ca
    assert make_certs(tmp_path, keep_existing=True).written == {}


def test_certs_refuse_a_half_ca_and_bad_hosts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ca.pem").write_text("not a certificate")
    assert kvserve(["certs", str(tmp_path)]) == 1
    assert "ca-key.pem" in capsys.readouterr().err
    assert not (tmp_path / "kvstore.pem").exists()
    with pytest.raises(SystemExit):
        kvserve(["certs", str(tmp_path / "x"), "--san", "kvstore:50053"])
    assert "without :PORT" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kvserve(["certs", str(tmp_path / "x"), "--name", "ca"])


# --- loading the files, and the flags ------------------------------------------------------------


@pytest.mark.parametrize("cert, key, problem", [
    ("missing.pem", "kvstore-key.pem", "(--tls-cert) {cert}: no such file"),
    ("kvstore-key.pem", "kvstore.pem", "(--tls-cert) {cert}: not a PEM certificate .* swapped"),
    ("kvstore.pem", "kvstore.pem", "(--tls-key) {key}: not a PEM private key"),
    ("kvstore.pem", "prefill-key.pem", "(--tls-key) {key}: is not the key of the certificate {cert}"),
    ("", "kvstore-key.pem", "(--tls-cert) {cert}: is a directory"),
])
def test_bad_files_are_named_with_what_is_wrong(certs: Path, cert: str, key: str, problem: str) -> None:
    paths = {"cert": certs / cert, "key": certs / key}
    with pytest.raises(TLSError, match=re.escape(problem.format(**paths)).replace(r"\.\*", ".*")):
        TLSConfig.load(paths["cert"], paths["key"], certs / "ca.pem")


def test_the_flags_take_the_environment_and_refuse_half_settings(
        certs: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.__main__ import parser

    for var in (ENV_CERT, ENV_KEY, ENV_CA):
        monkeypatch.delenv(var, raising=False)
    assert tls_from_args(parser().parse_args(["--insecure"]), "kvstore") is None
    for argv, problem in [([], "kvstore: serves TLS unless told otherwise"),
                          (["--insecure", "--tls-ca", str(certs / "ca.pem")], "kvstore: --insecure serves plaintext"),(["--tls-cert", str(certs / "kvstore.pem")], "kvstore: --tls-cert needs --tls-key"),
                          (["--tls-ca", str(certs / "ca.pem")], "kvstore: --tls-ca needs --tls-cert and --tls-key"),
                          (["--tls-cert", str(certs / "kvstore.pem"), "--tls-key", str(certs / "gone.pem")],
                           f"kvstore: TLS private key (--tls-key) {certs / 'gone.pem'}: no such file")]:
        with pytest.raises(SystemExit) as exit_info:
            tls_from_args(parser().parse_args(argv), "kvstore")
        assert exit_info.value.code == 2
        assert problem in capsys.readouterr().err

    monkeypatch.setenv(ENV_CERT, str(certs / "kvstore.pem"))
    monkeypatch.setenv(ENV_KEY, str(certs / "kvstore-key.pem"))
    monkeypatch.setenv(ENV_CA, str(certs / "ca.pem"))
    tls = tls_from_args(parser().parse_args([]), "kvstore")
    assert tls is not None
    assert (tls.cert, tls.ca) == ((certs / "kvstore.pem").read_bytes(), (certs / "ca.pem").read_bytes())


# --- servers -------------------------------------------------------------------------------------


def _health(addr: str, tls: TLSConfig | None) -> int:
    with channel(addr, (), tls) as ch:
        return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status)


def test_the_front_door_serves_tls_without_client_certificates(certs: Path) -> None:
    """What decode runs: TLS with the CA (for its own calls), no certificate asked of its callers."""
    server = Server("127.0.0.1:0", tls=client_tls(certs, "decode"), require_client_cert=False)
    addr = f"localhost:{server.start()}"
    try:
        assert _health(addr, TLSConfig.load(ca=certs / "ca.pem")) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            _health(addr, None)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    finally:
        server.stop(0)


def _start(module: str, args: list[str], log: Path) -> Service:
    """`python -m module args` on port 0 of loopback, once healthy (asked over TLS with its own certificate)."""
    return start_service(module, module, ["--listen", "127.0.0.1:0", *args], log)


@pytest.fixture(scope="module")
def tls_store(certs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("store")
    store = _start("kvstore", ["--host-capacity", "1MiB", "--shm-root", str(d), "--log-level", "WARNING",
                               *flags(certs, "kvstore")], d / "kvstore.log")
    yield store.addr
    stop_service(store)


def _refused(addr: str, tls: TLSConfig | None) -> None:
    """Lookup, Get, Put and Events all fail the way a refused handshake does: UNAVAILABLE."""
    with KVStoreClient(addr, timeout_s=10, tls=tls) as store:
        calls = {"Lookup": lambda: store.lookup([KEY]), "Get": lambda: store.get([KEY]),
                 "Put": lambda: store.put([(KEY, b"stolen")]), "Events": lambda: next(store.events())}
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, name  # type: ignore[attr-defined]


def test_a_tls_store_refuses_callers_without_a_certificate_from_its_ca(
        tls_store: str, certs: Path, other_ca: Path) -> None:
    _refused(tls_store, None)  # plaintext
    _refused(tls_store, TLSConfig.load(ca=certs / "ca.pem"))  # TLS, no client certificate
    _refused(tls_store, client_tls(other_ca, ca=certs / "ca.pem"))  # a certificate from another CA
    _refused(tls_store, client_tls(certs, ca=other_ca / "ca.pem"))  # the store's certificate is not trusted
    _refused(tls_store, client_tls(certs, "http"))  # the HTTP front's: from the CA, but a server's only
    with KVStoreClient(tls_store, tls=client_tls(certs), use_shm=False) as store:
        assert store.get([KEY]) == [None]  # nothing was stored by the refused calls, and it still serves


def test_a_tls_store_serves_a_client_with_a_certificate_from_its_ca(tls_store: str, certs: Path) -> None:
    key, other, payload = BlockHash(b"r" * 32), BlockHash(b"s" * 32), bytes(range(256)) * 64
    with KVStoreClient(tls_store, tls=client_tls(certs), use_shm=False) as store:
        assert store.put([(key, payload)]) == 1
        assert store.get([key]) == [payload]
        assert store.shm_dir() is None
    # The same host: the arena (its socket takes only this user's processes), found over TLS.
    with KVStoreClient(tls_store.replace("127.0.0.1", "localhost"), tls=client_tls(certs, "prefill")) as store:
        assert store.shm_dir() is not None
        assert store.get([key]) == [payload]
        assert store.put([(other, payload)]) == 1
        assert store.get([other]) == [payload]


@pytest.mark.slow
def test_a_stack_with_mtls_generates_what_hugging_face_does(certs: Path, tmp_path: Path) -> None:
    """Store, prefill and decode with mTLS between them: the same greedy tokens as the oracle (which the
    plaintext stack matches in test_e2e_generation), and the second request hits the store's cache."""
    from client import Client
    from tests.stack_fixtures import BLOCK_SIZE, assert_greedy_matches, model_dir, oracle, tokens

    model = str(model_dir("llama"))
    services: list[Service] = []
    try:
        services.append(_start("kvstore", ["--host-capacity", "8MiB", "--shm-root", str(tmp_path),
                                           *flags(certs, "kvstore")], tmp_path / "kvstore.log"))
        common = ["--model", model, "--kvstore", services[0].addr, "--block-size", str(BLOCK_SIZE),
                  "--log-level", "WARNING"]
        services.append(_start("prefill_service", [*common, *flags(certs, "prefill")], tmp_path / "prefill.log"))
        prefill_addr = services[1].addr
        services.append(_start("decode_service", [*common, "--prefill", prefill_addr, *flags(certs, "decode")],
                               tmp_path / "decode.log"))
        decode_addr = services[2].addr

        with pytest.raises(grpc.RpcError) as info:  # prefill is internal: no plaintext callers
            _health(prefill_addr, None)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]

        ids, n = tokens(3 * BLOCK_SIZE + 5, seed=7), 12
        want, logits = oracle("llama", ids, n)
        with Client(decode_addr, timeout_s=120, tls_ca=certs / "ca.pem") as c:  # a tenant: no certificate
            for cached in (0, 3 * BLOCK_SIZE):
                result = c.generate(token_ids=ids, max_tokens=n, ignore_eos=True)
                assert_greedy_matches(result.token_ids, want, logits)
                assert result.usage.cached_tokens == cached
    finally:
        for service in reversed(services):
            stop_service(service)
