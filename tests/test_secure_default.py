"""Issue 26's attacks from a local process, played against the default `kvserve up` (secure: it made its
credentials on its first start) and against `kvserve up --insecure`, where each succeeds as it should.
The attacker reaches every port on 127.0.0.1 but holds none of the data dir's files; the victim uses
the admin token that a local client finds. The records' MAC (tests/test_record_mac.py) and the
router's bounds (tests/test_router_bounds.py) have tests of their own."""

from __future__ import annotations

import json
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from client.client import Client, UnauthenticatedError
from client.local import Layout
from kvserve.rpc.certs import make_certs
from kvstore.block_format import checksum
from protos.kvserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc
from tests.processes import KVSERVE, free_port_run, free_ports
from tests.stack_fixtures import model_dir

pytestmark = pytest.mark.slow

PROMPT = " ".join(f"word{i}" for i in range(120))  # several full blocks
BLOCK = bytes(64)


@dataclass
class Up:
    """A `kvserve up` of this module; ports: decode, prefill, store, then metrics base."""

    process: subprocess.Popen[str]
    data_dir: Path
    ports: list[int]
    insecure: bool

    def addr(self, i: int) -> str:
        return f"127.0.0.1:{self.ports[i]}"

    @property
    def layout(self) -> Layout:
        return Layout(self.data_dir)


def _start_up(tmp: Path, *extra: str) -> Iterator[Up]:
    base = free_port_run(4)  # the metrics ports from it: decode's, prefill's, the store's, HTTP's
    ports = [*[p for p in free_ports(7) if not base <= p < base + 4][:3], base]
    data_dir = tmp / "data"
    argv = [KVSERVE, "up", "--data-dir", str(data_dir), "--model", str(model_dir("llama")),
            "--decode-port", str(ports[0]), "--prefill-port", str(ports[1]), "--store-port", str(ports[2]),
            "--metrics-base-port", str(ports[3]), "--no-http", *extra]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    seen = []
    for line in process.stdout:
        seen.append(line)
        if line.startswith("ready:"):
            break
    else:
        process.wait()
        raise AssertionError("kvserve up did not start:\n" + "".join(seen))
    threading.Thread(target=process.stdout.read, daemon=True).start()  # keep its pipe drained
    try:
        yield Up(process, data_dir, ports, "--insecure" in extra)
    finally:
        process.terminate()
        process.wait(60)


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    yield from _start_up(tmp_path_factory.mktemp("secure"))


@pytest.fixture(scope="module")
def insecure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    yield from _start_up(tmp_path_factory.mktemp("insecure"), "--insecure")


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Certificates from a CA of the attacker's own."""
    d = tmp_path_factory.mktemp("stranger")
    make_certs(d, ["kvstore", "client"])
    return d


def _attacker_channels(addr: str, stranger: Path) -> dict[str, grpc.Channel]:
    """Every way an attacker without the data dir's files can dial `addr`."""
    read = lambda name: (stranger / name).read_bytes()  # noqa: E731
    server_ca = None  # the attacker cannot check the server: it trusts anything it is shown
    return {
        "plaintext": grpc.insecure_channel(addr),
        "tls, no certificate": grpc.secure_channel(addr, grpc.ssl_channel_credentials(server_ca)),
        "a certificate from another CA": grpc.secure_channel(addr, grpc.ssl_channel_credentials(
            read("ca.pem"), read("client-key.pem"), read("client.pem"))),
    }


def _store_attacks(channel: grpc.Channel, victim_hashes: list[bytes]) -> dict[str, object]:
    """What the store tells or takes from `channel`: a Lookup of a guessed prompt, a Get of its blocks, a
    forged Put; RpcError's code for what it refused."""
    stub = kvstore_pb2_grpc.KVStoreStub(channel)
    return _outcomes({
        "lookup": lambda: stub.Lookup(kvstore_pb2.LookupRequest(hashes=victim_hashes), timeout=5).num_hits,
        "get": lambda: sum(len(r.chunk.data) for r in stub.Get(kvstore_pb2.GetRequest(hashes=victim_hashes),
                                                                timeout=5)),
        "put": lambda: stub.Put(iter([kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(
            hash=b"\x01" * 32, total_size=len(BLOCK), offset=0, data=BLOCK, checksum=checksum(BLOCK)))]),
            timeout=5).num_new,
        "events": lambda: next(iter(stub.Events(kvstore_pb2.EventsRequest(), timeout=5))).kind,
    })


def _outcomes(calls: dict[str, Callable[[], object]]) -> dict[str, object]:
    """Each call's answer, or the status code it was refused with."""
    outcome: dict[str, object] = {}
    for name, call in calls.items():
        try:
            outcome[name] = call()
        except grpc.RpcError as exc:
            outcome[name] = exc.code()  # type: ignore[attr-defined]
    return outcome


def _victim_hashes(up: Up) -> list[bytes]:
    """The victim's request (as a local user: its credentials are found, no flags), then its prompt's block
    hashes, which the attacker is assumed to have guessed, from decode as the router asks for them."""
    with Client(up.addr(0)) as client:
        assert client.generate(PROMPT, max_tokens=2).usage.prompt_tokens > 64
    layout, secure = up.layout, not up.insecure
    channel = (grpc.secure_channel(up.addr(0), grpc.ssl_channel_credentials(layout.ca.read_bytes())) if secure
               else grpc.insecure_channel(up.addr(0)))
    metadata = [("authorization", f"Bearer {layout.router_token.read_text().strip()}"),
                ("kvserve-on-behalf-of", f"Bearer {layout.admin_token.read_text().strip()}")] if secure else []
    with channel:
        request = decode_pb2.GenerateRequest(prompt=common_pb2.Prompt(text=PROMPT))
        return list(decode_pb2_grpc.DecodeReplicaStub(channel).PrefixHashes(request, metadata=metadata,
                                                                            timeout=10).hashes)


def test_the_default_store_answers_no_one_without_a_service_certificate(secure: Up, stranger: Path) -> None:
    hashes = _victim_hashes(secure)
    assert hashes
    for how, channel in _attacker_channels(secure.addr(2), stranger).items():
        with channel:
            outcome = _store_attacks(channel, hashes)
        assert outcome == dict.fromkeys(("lookup", "get", "put", "events"), grpc.StatusCode.UNAVAILABLE), how


def test_the_insecure_store_answers_anyone(insecure: Up) -> None:
    """The same attacks succeed against --insecure: the guess is confirmed, a forged block is taken, and a
    victim's prompt is read back as its blocks are named on the store's Events."""
    hashes = _victim_hashes(insecure)
    with grpc.insecure_channel(insecure.addr(2)) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        assert stub.Lookup(kvstore_pb2.LookupRequest(hashes=hashes), timeout=5).num_hits == len(hashes)
        forged = kvstore_pb2.BlockChunk(hash=b"\x01" * 32, total_size=len(BLOCK), data=BLOCK, checksum=checksum(BLOCK))
        assert stub.Put(iter([kvstore_pb2.PutRequest(chunk=forged)]), timeout=5).num_new == 1
        events = stub.Events(kvstore_pb2.EventsRequest(), timeout=60)
        stored: list[bytes] = []
        follow = threading.Thread(target=lambda: stored.extend(next(e.hashes for e in events
                                                                    if e.kind == kvstore_pb2.Event.KIND_STORED)))
        follow.start()
        with Client(insecure.addr(0)) as client:
            client.generate("another victim: " + PROMPT, max_tokens=1)
        follow.join(60)
        events.cancel()
        assert stored
        read = sum(len(r.chunk.data) for r in stub.Get(kvstore_pb2.GetRequest(hashes=stored), timeout=5))
        assert read > 0


def _replica_calls(addr: str, credentials: grpc.ChannelCredentials | None, metadata: list[tuple[str, str]]
                   ) -> dict[str, object]:
    channel = grpc.insecure_channel(addr) if credentials is None else grpc.secure_channel(addr, credentials)
    stub = decode_pb2_grpc.DecodeReplicaStub(channel)
    request = decode_pb2.GenerateRequest(prompt=common_pb2.Prompt(text=PROMPT))
    with channel:
        return _outcomes({
            "load": lambda: stub.Load(decode_pb2.LoadRequest(), metadata=metadata, timeout=5).running,
            "prefix_hashes": lambda: len(stub.PrefixHashes(request, metadata=metadata, timeout=10).hashes),
            "events": lambda: next(iter(stub.Events(kvstore_pb2.EventsRequest(), metadata=metadata,
                                                    timeout=5))).tier,
        })


def test_decode_replica_answers_only_a_service_token(secure: Up) -> None:
    layout = secure.layout
    tls = grpc.ssl_channel_credentials(layout.ca.read_bytes())
    tenant = layout.admin_token.read_text().strip()  # a tenant's token (tenant admin), valid at the front door
    router = layout.router_token.read_text().strip()
    denied = _replica_calls(secure.addr(0), tls, [("authorization", f"Bearer {tenant}")])
    assert denied == dict.fromkeys(("load", "prefix_hashes", "events"), grpc.StatusCode.PERMISSION_DENIED)
    unknown = _replica_calls(secure.addr(0), tls, [])
    assert unknown == dict.fromkeys(("load", "prefix_hashes", "events"), grpc.StatusCode.UNAUTHENTICATED)
    served = _replica_calls(secure.addr(0), tls, [("authorization", f"Bearer {router}"),
                                                  ("kvserve-on-behalf-of", f"Bearer {tenant}")])
    assert served["load"] == 0 and served["events"] == kvstore_pb2.TIER_ENGINE
    assert isinstance(served["prefix_hashes"], int) and served["prefix_hashes"] > 0
    # The router's token alone cannot name a namespace: hashes are asked for a tenant.
    alone = _replica_calls(secure.addr(0), tls, [("authorization", f"Bearer {router}")])
    assert alone["prefix_hashes"] == grpc.StatusCode.UNAUTHENTICATED and alone["load"] == 0


def test_insecure_decode_replica_answers_anyone(insecure: Up) -> None:
    served = _replica_calls(insecure.addr(0), None, [])
    assert served["load"] == 0 and served["events"] == kvstore_pb2.TIER_ENGINE


def test_the_front_door_needs_the_token_a_local_client_finds(secure: Up, insecure: Up) -> None:
    with Client(secure.addr(0), token="", tls_ca=secure.layout.ca) as client, \
            pytest.raises(UnauthenticatedError, match="requires a bearer token"):
        client.generate("hello", max_tokens=1)
    with Client(secure.addr(0)) as client:  # found: the CA and the admin token
        assert client.generate("hello", max_tokens=1).usage.completion_tokens == 1
    with Client(insecure.addr(0)) as client:
        assert client.generate("hello", max_tokens=1).usage.completion_tokens == 1


def test_reflection_lists_only_the_public_api(secure: Up) -> None:
    credentials = grpc.ssl_channel_credentials(secure.layout.ca.read_bytes())
    with grpc.secure_channel(secure.addr(0), credentials) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(iter(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]), timeout=5)))
    names = {s.name for s in reply.list_services_response.service}
    assert "kvserve.v1.Decode" in names and "kvserve.v1.DecodeReplica" not in names


def _listening_hosts(port: int) -> set[str]:
    """The local addresses a socket listens on for `port` (/proc/net/tcp and tcp6)."""
    hosts = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # LISTEN
                hosts.add("127.0.0.1" if address == "0100007F" else address)
    return hosts


def test_metrics_follow_the_listen_host_and_need_a_certificate_under_tls(secure: Up, insecure: Up) -> None:
    for up in (secure, insecure):
        for port in range(up.ports[3], up.ports[3] + 3):
            assert _listening_hosts(port) == {"127.0.0.1"}, port
    url = f"https://127.0.0.1:{secure.ports[3]}/metrics"
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP to a TLS port: dropped
        urllib.request.urlopen(f"http://127.0.0.1:{secure.ports[3]}/metrics", timeout=5)
    no_cert = ssl.create_default_context(cafile=str(secure.layout.ca))
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        urllib.request.urlopen(url, timeout=5, context=no_cert).read()
    admin = ssl.create_default_context(cafile=str(secure.layout.ca))
    admin.load_cert_chain(*(str(p) for p in secure.layout.admin_cert))
    with urllib.request.urlopen(url, timeout=5, context=admin) as page:
        assert b"kvserve_decode" in page.read()
    with urllib.request.urlopen(f"http://127.0.0.1:{insecure.ports[3]}/metrics", timeout=5) as page:
        assert b"kvserve_decode" in page.read()


def test_local_tools_find_the_admin_credentials(secure: Up) -> None:
    done = subprocess.run([KVSERVE, "health", secure.addr(2)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([KVSERVE, "stats", "--data-dir", str(secure.data_dir), "--json", "--metrics",
                           f"https://127.0.0.1:{secure.ports[3] + 2}/metrics"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    assert "kvstore" in json.loads(done.stdout)
