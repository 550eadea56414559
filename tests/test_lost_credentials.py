"""Credentials lost under a running `kvserve up` (RELIABILITY.md): a service that has to start again while a file
it reads (a credential, a file of its model) is missing is not started; `up` says in one line which file and what
to do, looks again at each delay of its back-off and starts it once the file is back, and the others keep serving.
Over small fake services, then a real `up` whose certs/ and auth/ are deleted before prefill is SIGKILLed; and
`kvserve credentials` (what a restarted `up` runs) repairing such a loss."""

from __future__ import annotations

import io
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import Client
from client.local import Layout
from kvserve.rpc.auth import load_tokens
from kvserve.rpc.certs import DEFAULT_NAMES
from kvserve.stack.credentials import ensure as ensure_credentials
from kvserve.stack.stack import ServiceSpec, Stack, StackConfig, spawn_service, unreadable
from kvserve.stack.status import STATUS_FILE, read_status
from kvserve.stack.supervisor import Backoff, Supervisor
from tests.polling import wait_until
from tests.processes import alive, children

FAKE_SERVICE = '''
import argparse, os, sys, threading
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

p = argparse.ArgumentParser()
p.add_argument("--listen")
p.add_argument("--record-key-file")
p.add_argument("--mode-file")
p.add_argument("--model")
a = p.parse_args()
if a.record_key_file:
    if open(a.mode_file).read().strip() == "lose":  # the key goes between up's check and this read
        os.remove(a.record_key_file)
    try:
        open(a.record_key_file).read()
    except OSError as exc:
        print(f"fake: --record-key-file: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)  # as the real store: a file it cannot use is a bad setting
server = grpc.server(futures.ThreadPoolExecutor(2))
servicer = health.HealthServicer()
servicer.set("", health_pb2.HealthCheckResponse.SERVING)
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
port = server.add_insecure_port(a.listen)
server.start()
print(f"LISTENING {port}", flush=True)
threading.Event().wait()
'''


class Fakes:
    """A fake "kvstore" that reads its record key from a secure stack's credentials, and a fake "decode" given the
    stack's model folder, watched by a Supervisor that looks again after 0.05 s, doubling up to 0.2 s."""

    def __init__(self, tmp: Path) -> None:
        self.out, self.err = io.StringIO(), io.StringIO()
        # Secure (insecure=False): the record key lies in the stack's credentials. The fakes serve plaintext: their
        # command lines carry no TLS flags, so up's health checks and placeholders speak plaintext.
        self.stack = Stack(StackConfig(model_dir=tmp / "model", data_dir=tmp), log_dir=tmp / "logs")
        layout = self.stack.layout
        assert layout is not None
        self.key, self.mode = layout.record_key, tmp / "kvstore.mode"
        self.key.parent.mkdir()
        (tmp / "logs").mkdir()
        self.model = self.stack.config.model_dir  # in the data dir, as `up`'s tiny model is
        self.model.mkdir()
        for file in ("config.json", "model.safetensors"):
            (self.model / file).write_text("{}")
        self.key.write_text("ab" * 32 + "\n")
        self.mode.write_text("serve")
        for name, flags in (("kvstore", ("--record-key-file", str(self.key), "--mode-file", str(self.mode))),
                            ("decode", ("--model", str(self.model)))):
            self.stack.add(ServiceSpec(name, "fakesvc", ("--listen", "127.0.0.1:0", *flags),
                                       tmp / "logs" / f"{name}.log", "127.0.0.1"))
        self.supervisor = Supervisor(self.stack, tmp / STATUS_FILE, backoff=lambda: Backoff(initial_s=0.05, max_s=0.2),
                                     out=self.out, err=self.err)

    def kill(self, name: str) -> int:
        proc = self.stack.service(name).process
        proc.kill()
        proc.wait()
        return proc.pid

    def poll_until(self, done: Callable[[], bool], timeout_s: float = 60) -> None:
        def polled() -> bool:
            if done():
                return True
            self.supervisor.poll()
            return False

        wait_until(polled, timeout_s, interval_s=0.02, message=lambda: f"stderr so far:\n{self.err.getvalue()}")

    def state(self, name: str) -> tuple[str, int | None, int]:
        s = self.supervisor.status().services[name]
        return s.state, s.pid, s.restarts


@pytest.fixture()
def fakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fakes]:
    (tmp_path / "fakesvc.py").write_text(FAKE_SERVICE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    f = Fakes(tmp_path)
    yield f
    f.stack.stop()
    f.supervisor.close()


def _said(path: Path, data_dir: Path) -> str:
    return (f"kvserve up: cannot start kvstore again: {path} (missing); restore them from a backup, or make them "
            f"again with `kvserve credentials {data_dir}`; it starts by itself once they are there; looking again "
            "in 0.1 s, then at growing delays up to 0.2 s; the other services keep serving")


def test_a_service_whose_record_key_is_gone_waits_for_it_and_says_so_once(fakes: Fakes, tmp_path: Path) -> None:
    f = fakes
    decode_pid, port = f.stack.service("decode").process.pid, f.stack.service("kvstore").port
    key = f.key.read_bytes()
    f.key.unlink()
    killed = f.kill("kvstore")
    f.poll_until(lambda: "cannot start" in f.err.getvalue())
    later = time.monotonic() + 1.0
    f.poll_until(lambda: time.monotonic() > later)  # five rounds or more of the back-off, the key still gone
    lines = f.err.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"kvserve up: kvstore (pid {killed}) was killed by SIGKILL"), lines
    assert lines[1] == _said(f.key, tmp_path), lines[1]
    assert f.state("kvstore") == ("waiting", None, 0)  # never started without it
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError) as refused:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)  # up's placeholder
    # to callers, no path of the server's
    assert refused.value.details() == "kvstore restarting (a file it reads is missing); retry in a few seconds"  # type: ignore[attr-defined]
    assert f.stack.service("decode").process.pid == decode_pid and alive(decode_pid)

    f.key.write_bytes(key)
    f.poll_until(lambda: f.state("kvstore")[0] == "running", timeout_s=30)
    back = f.stack.service("kvstore")
    assert f.state("kvstore") == ("running", back.process.pid, 1) and back.port == port
    assert f.out.getvalue().startswith(f"kvserve up: kvstore is back on 127.0.0.1:{port} (pid {back.process.pid}, "
                                       "restart 1"), f.out.getvalue()
    assert len(f.err.getvalue().splitlines()) == 2


def test_a_file_gone_as_the_service_starts_is_waited_for_not_taken_for_bad_flags(fakes: Fakes, tmp_path: Path) -> None:
    """Exit code 2 ends `up` (flags, a model or a port that cannot work), unless a file the service reads went."""
    f = fakes
    key = f.key.read_bytes()
    f.mode.write_text("lose")  # up finds the key, the new process does not
    f.kill("kvstore")
    f.poll_until(lambda: "cannot start" in f.err.getvalue())
    assert f.err.getvalue().splitlines()[1] == _said(f.key, tmp_path), f.err.getvalue()
    assert f.state("kvstore")[::2] == ("waiting", 1)  # one start, that failed
    f.mode.write_text("serve")
    f.key.write_bytes(key)
    f.poll_until(lambda: f.state("kvstore")[0] == "running", timeout_s=30)


def test_a_model_file_gone_is_waited_for_too(fakes: Fakes) -> None:
    f = fakes
    weights = f.model / "model.safetensors"
    weights.unlink()
    f.kill("decode")
    f.poll_until(lambda: "cannot start" in f.err.getvalue())
    assert f.err.getvalue().splitlines()[1] == (
        f"kvserve up: cannot start decode again: {weights} (missing); put the model folder {f.model} back and it "
        "starts by itself; looking again in 0.1 s, then at growing delays up to 0.2 s; the other services keep serving")
    weights.write_text("{}")
    f.poll_until(lambda: f.state("decode")[0] == "running", timeout_s=30)


def test_unreadable_says_which_files_cannot_be_opened_and_why(tmp_path: Path) -> None:
    (tmp_path / "here").write_text("x")
    (tmp_path / "dir").mkdir()
    paths = [tmp_path / "here", tmp_path / "gone", tmp_path / "dir"]
    assert unreadable(paths) == {tmp_path / "gone": "missing", tmp_path / "dir": "unreadable: Is a directory"}


def test_what_each_service_reads_as_it_starts(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for file in ("tokenizer.json", "config.json", "model.safetensors"):
        (model / file).write_text("{}")
    (model / "sub").mkdir()
    stack = Stack(StackConfig(model_dir=model, data_dir=tmp_path))
    layout = Layout(tmp_path)

    def certs(name: str) -> list[Path]:
        return [*layout.cert(name), layout.ca]

    assert stack.store_spec().files == [*certs("kvstore"), layout.record_key]
    model_files = [model / "config.json", model / "model.safetensors", model / "tokenizer.json"]
    assert stack.prefill_spec("s:1").files == [*certs("prefill"), *model_files]
    assert stack.decode_spec("s:1", "p:2").files == [*certs("decode"), layout.tokens, layout.tokens_secret,
                                                      layout.service_tokens, *model_files]
    (model / "config.json").unlink()  # gone before `up` looks: still what it must find
    assert stack.prefill_spec("s:1").files == [*certs("prefill"), *model_files]
    assert stack.http_spec("d:3").files == certs("http")


def test_a_service_whose_tls_files_are_gone_is_not_spawned(tmp_path: Path) -> None:
    """`up` reads a service's certificate to ask its health: where it cannot, nothing is started, nothing left."""
    before = children(os.getpid())
    gone = [str(tmp_path / f) for f in ("prefill.pem", "prefill-key.pem", "ca.pem")]
    with pytest.raises(FileNotFoundError):
        spawn_service("prefill", "prefill_service", ["--tls-cert", gone[0], "--tls-key", gone[1], "--tls-ca", gone[2]],
                      tmp_path / "prefill.log")
    assert children(os.getpid()) == before and not (tmp_path / "prefill.log").exists()


def _issued_by(cert: Path, ca: Path) -> bool:
    try:
        x509.load_pem_x509_certificate(cert.read_bytes()).verify_directly_issued_by(
            x509.load_pem_x509_certificate(ca.read_bytes()))
    except (ValueError, TypeError):
        return False
    return True


def test_credentials_made_again_after_a_loss_fit_together(tmp_path: Path) -> None:
    """What `kvserve up` (or `kvserve credentials`) makes once its certs/ and auth/ are gone: a new CA signs every
    certificate, the admin's kept one too; the admin and router tokens kept are in the new tokens files."""
    layout, _ = ensure_credentials(tmp_path)
    old_ca = layout.ca.read_bytes()
    shutil.rmtree(layout.certs)
    shutil.rmtree(layout.auth)
    _, made = ensure_credentials(tmp_path)
    assert layout.ca.read_bytes() != old_ca
    assert all(_issued_by(c, layout.ca) for c in [*(layout.cert(n)[0] for n in DEFAULT_NAMES), layout.admin_cert[0]])
    assert load_tokens(layout.tokens).tenant_of(layout.admin_token.read_text().strip()) == "admin"
    assert load_tokens(layout.service_tokens).tenant_of(layout.router_token.read_text().strip()) == "router"
    assert f"{layout.tokens} with admin's token from {layout.admin_token} (any other token it held is lost: issue " \
           "it again with `kvserve token`)" in made

    (layout.certs / "ca.pem").unlink()  # the CA alone: the certificates it signed are made again
    (layout.certs / "ca-key.pem").unlink()
    _, made = ensure_credentials(tmp_path)
    assert made == [f"a CA in {layout.certs}", *(f"the {n} certificate" for n in DEFAULT_NAMES),
                    f"the admin certificate in {layout.admin} (it reads and writes every tenant's blocks)"]
    assert _issued_by(layout.cert("prefill")[0], layout.ca) and _issued_by(layout.admin_cert[0], layout.ca)
    assert ensure_credentials(tmp_path)[1] == []  # nothing lost now: nothing made


# -- a real `kvserve up` -------------------------------------------------------------------------------------------


def _serving(addr: str, credentials: grpc.ChannelCredentials) -> bool:
    with grpc.secure_channel(addr, credentials) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.slow
def test_credentials_deleted_under_up_stop_only_the_service_that_must_restart(
        up: tuple[subprocess.Popen[str], list[str], list[str], Path, list[int]], tmp_path: Path) -> None:
    """certs/ and auth/ deleted, prefill SIGKILLed: `up` runs on and says which file and what to do; decode (which
    computes prompts itself while prefill is down), the store and the HTTP API serve callers who hold the
    credentials in memory; a SIGHUP keeps decode's tokens; the files restored, prefill comes back by itself."""
    proc, out, err, data, ports = up
    layout = Layout(data)
    ca = layout.ca.read_bytes()  # what a client holds once it has connected
    admin = layout.admin_credentials()
    https = ssl.create_default_context(cadata=ca.decode())
    decode, prefill, store = (f"127.0.0.1:{p}" for p in ports[:3])
    with Client(decode, timeout_s=60) as client:  # finds up's CA and admin token, and reads them now
        prompt = "The certificates were deleted, and yet"
        assert client.generate(prompt, max_tokens=4, ignore_eos=True).usage.completion_tokens == 4
        backup = tmp_path / "backup"
        for folder in (layout.certs, layout.auth):
            shutil.copytree(folder, backup / folder.name)
            shutil.rmtree(folder)
        before = read_status(data)
        assert before is not None and (pid := before.services["prefill"].pid) is not None
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: any(line.startswith("kvserve up: cannot start prefill") for line in err), 60,
                   message=lambda: "".join(err))

        assert proc.poll() is None
        line = next(line for line in err if line.startswith("kvserve up: cannot start prefill again: "))
        assert f"{layout.cert('prefill')[0]} (missing)" in line and f"{layout.ca} (missing)" in line, line
        assert ("restore them from a backup and it starts by itself, or stop `kvserve up` and start it again to make "
                f"a new CA and credentials (not `kvserve credentials {data}` while `up` runs: a new CA would not match "
                "the certificates the running services hold)") in line, line
        status = read_status(data)
        assert status is not None and (status.services["prefill"].state, status.services["prefill"].pid) == (
            "waiting", None)
        assert client.generate(prompt + " decode", max_tokens=4, ignore_eos=True).usage.completion_tokens == 4
        assert _serving(store, admin) and _serving(decode, admin)
        with urllib.request.urlopen(f"https://127.0.0.1:{ports[3]}/health", timeout=10, context=https) as reply:
            assert reply.status == 200

        # SIGHUP: decode reads its tokens files again; gone, it says so and keeps the tokens it has
        decode_log = data / "logs" / "decode.log"
        os.kill(proc.pid, signal.SIGHUP)
        wait_until(lambda: "tokens file not reloaded, the previous 1 token(s) stay in use: cannot read tokens file "
                           f"{layout.tokens}" in decode_log.read_text(), 30, message=lambda: decode_log.read_text())
        assert client.generate(prompt, max_tokens=4, ignore_eos=True).usage.completion_tokens == 4

        for folder in (layout.certs, layout.auth):
            shutil.copytree(backup / folder.name, folder)
        wait_until(lambda: any(line.startswith("kvserve up: prefill is back on") for line in out), 120,
                   message=lambda: "".join(out + err))
        back = read_status(data)
        assert back is not None and back.services["prefill"].state == "running"
        assert back.services["prefill"].pid not in (None, pid) and _serving(prefill, admin)
        assert client.generate(prompt + " again", max_tokens=4, ignore_eos=True).usage.completion_tokens == 4
    assert proc.poll() is None
    assert sum(line.startswith("kvserve up: cannot start prefill") for line in err) == 1, err
    assert not [line for line in out + err if "Traceback" in line], "".join(err)
    assert {n: s.restarts for n, s in back.services.items()} == {"kvstore": 0, "prefill": 1, "decode": 0, "http": 0}
