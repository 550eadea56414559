"""`docker compose up` for real (`make test-compose`; docs/OPERATIONS.md, "Compose, for real"): the image built
from this checkout and the unmodified docker-compose.yml started by a real Docker engine, checked as a user
and an operator would:

- every service healthy; a generate through the router (TLS, with the CA and admin token taken out of the
  credentials volume as the compose file's header says) whose tokens equal Hugging Face's greedy output on
  the model in the stack's own volume; the same prompt through the HTTP front with the `openai` SDK;
- the store's process killed, as the OOM killer would: requests are served meanwhile, Docker starts it
  again, it turns healthy, and requests are served after;
- the plaintext overlay (docker-compose.insecure.yml) on the same volumes.

Opt-in: it runs only with KVSERVE_TEST_COMPOSE=1 (`make test-compose` sets it), with any Docker engine
that answers and Compose v2 (`docker compose`) or v1 (`docker-compose`). It is a compose project of its
own (KVSERVE_COMPOSE_PROJECT, default kvserve-test) on free host ports (KVSERVE_GRPC_PORT,
KVSERVE_HTTP_PORT), removed with its volumes at the end; its image is KVSERVE_IMAGE (default
kvserve:test-compose). Each phase's time is printed (`-s`).
"""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import openai
import pytest

from client.client import Client, Result
from kvserve.engine.model import load_model
from tests.engine_fixtures import assert_greedy_matches, oracle, random_tokens
from tests.processes import free_ports

ROOT = Path(__file__).resolve().parents[1]
HEALTH_TIMEOUT_S = 600.0  # the first start builds the tiny model and loads it twice on a loaded host
SERVICES = ("redis", "kvstore", "prefill", "decode", "router", "http")
NEW_TOKENS = 8

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("KVSERVE_TEST_COMPOSE") != "1",
                       reason="docker compose for real: `make test-compose` (KVSERVE_TEST_COMPOSE=1)"),
]


@cache
def compose_command() -> list[str]:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.fail("no Docker Compose: install Compose v2 (`docker compose`) or v1 (`docker-compose`)")


@dataclass
class Project:
    """One compose project of docker-compose.yml (and `overlays`), driven through the compose CLI."""

    name: str
    env: dict[str, str]
    overlays: tuple[str, ...] = ()

    def command(self, *args: str) -> list[str]:
        files = [a for f in ("docker-compose.yml", *self.overlays) for a in ("-f", f)]
        return [*compose_command(), "-p", self.name, *files, *args]

    def run(self, *args: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        cmd = self.command(*args)
        done = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        return done

    def output(self, *args: str) -> bytes:
        """A one-off container's stdout, as bytes."""
        done = subprocess.run(self.command(*args), cwd=ROOT, env=self.env, capture_output=True, timeout=300)
        assert done.returncode == 0, done.stderr.decode(errors="replace")
        return done.stdout

    def container(self, service: str) -> str:
        cid = self.run("ps", "-q", service).stdout.strip()
        assert cid, f"no container of {service}"
        return cid

    def inspect(self, service: str, template: str) -> str:
        return docker("inspect", "-f", template, self.container(service))

    def wait_healthy(self, services: tuple[str, ...] = SERVICES, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = list(services)
        while waiting:
            waiting = [s for s in waiting if self.inspect(s, "{{.State.Health.Status}}") != "healthy"]
            if waiting and time.monotonic() > deadline:
                logs = self.run("logs", "--tail", "30", *waiting, check=False).stdout
                pytest.fail(f"not healthy within {timeout_s:.0f} s: {waiting}\n{logs}")
            time.sleep(2)

    def read(self, path: str) -> bytes:
        """A file of the credentials volume, taken out as the compose file's header says."""
        return self.output("run", "--rm", "-T", "--entrypoint", "cat", "credentials", path)


def docker(*args: str) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, check=True, timeout=120)
    return done.stdout.strip()


class Phases:
    """Prints how long each phase took (docs/OPERATIONS.md quotes them)."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def done(self, what: str) -> None:
        now = time.monotonic()
        print(f"\ncompose: {what} in {now - self.start:.0f} s", flush=True)
        self.start = now


@pytest.fixture(scope="module")
def phases() -> Phases:
    return Phases()


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory, phases: Phases) -> Iterator[Project]:
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.fail("no Docker engine answers `docker info`: start one (as root: `dockerd &`)")
    grpc_port, http_port = free_ports(2)
    env = {**os.environ, "KVSERVE_IMAGE": os.environ.get("KVSERVE_IMAGE", "kvserve:test-compose"),
           "KVSERVE_GRPC_PORT": str(grpc_port), "KVSERVE_HTTP_PORT": str(http_port)}
    p = Project(os.environ.get("KVSERVE_COMPOSE_PROJECT", "kvserve-test"), env)
    p.run("down", "--volumes", "--remove-orphans")  # what an interrupted run left
    p.run("build", timeout=3600)
    size = int(docker("image", "inspect", "-f", "{{.Size}}", env["KVSERVE_IMAGE"]))
    phases.done(f"built {env['KVSERVE_IMAGE']} ({size / 1e9:.2f} GB)")
    try:
        p.run("up", "--detach")
        p.wait_healthy()
        phases.done("up, every service healthy")
        yield p
    finally:
        p.run("down", "--volumes", "--remove-orphans", check=False)


@pytest.fixture(scope="module")
def secrets(project: Project, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The admin token and the CA, out of the credentials volume."""
    ca = tmp_path_factory.mktemp("compose") / "ca.pem"
    ca.write_bytes(project.read("/credentials/certs/ca.pem"))
    return project.read("/credentials/admin/admin.token").decode().strip(), ca


@pytest.fixture(scope="module")
def model_dir(project: Project, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model prefill and decode serve, copied out of the stack's models volume."""
    out = tmp_path_factory.mktemp("models")
    tar = project.output("run", "--rm", "-T", "--entrypoint", "tar", "model-init", "-C", "/models", "-cf", "-",
                         "tiny-llama")
    subprocess.run(["tar", "-x", "-C", str(out)], input=tar, check=True)
    return out / "tiny-llama"


LONG = 600  # past decode's --local-prefill-tokens (512): prefill computes it, its KV comes through the store


@pytest.fixture(scope="module")
def expect(model_dir: Path) -> Callable[..., Result]:
    """Generates on a prompt of `length` random tokens and checks the tokens against Hugging Face's greedy
    output on the stack's model."""
    model = load_model(model_dir)

    def check(client: Client, seed: int, length: int = 40) -> Result:
        ids = random_tokens(length, seed=seed)
        want, logits = oracle(model, ids, NEW_TOKENS)
        got = client.generate(token_ids=ids, max_tokens=NEW_TOKENS, ignore_eos=True)
        assert_greedy_matches(list(got.token_ids), want, logits)
        return got

    return check


def front_door(project: Project, token: str, ca: Path | None) -> Client:
    return Client(f"127.0.0.1:{project.env['KVSERVE_GRPC_PORT']}", timeout_s=300, token=token, tls_ca=ca)


def test_generate_through_the_router_equals_hugging_face(
        project: Project, secrets: tuple[str, Path], expect: Callable[..., Result], phases: Phases) -> None:
    token, ca = secrets
    with front_door(project, token, ca) as client:
        expect(client, seed=1)  # cold, computed by decode itself
        assert expect(client, seed=1).usage.cached_tokens > 0
        assert expect(client, seed=5, length=LONG).timings.prefill_path == "disaggregated"
        assert expect(client, seed=5, length=LONG).usage.cached_tokens > 0
    phases.done("generate through the router, local and disaggregated, cold and warm")


def test_the_http_front_answers_the_openai_sdk(project: Project, secrets: tuple[str, Path]) -> None:
    token, ca = secrets
    ids = random_tokens(40, seed=1)
    with front_door(project, token, ca) as client:
        want = client.generate(token_ids=ids, max_tokens=NEW_TOKENS, ignore_eos=True).text
    http = openai.DefaultHttpx2Client(verify=ssl.create_default_context(cafile=str(ca)))
    sdk = openai.OpenAI(base_url=f"https://127.0.0.1:{project.env['KVSERVE_HTTP_PORT']}/v1", api_key=token,
                        http_client=http)
    got = sdk.completions.create(model="tiny-llama", prompt=ids, max_tokens=NEW_TOKENS, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert got.choices[0].text == want


def test_a_killed_store_comes_back_and_requests_are_served_throughout(
        project: Project, secrets: tuple[str, Path], expect: Callable[..., Result], phases: Phases) -> None:
    token, ca = secrets
    restarts = int(project.inspect("kvstore", "{{.RestartCount}}"))
    # SIGKILL, as the OOM killer would, sent on the engine's host (which may not be this one) from a container
    # in its PID namespace.
    pid = project.inspect("kvstore", "{{.State.Pid}}")
    docker("run", "--rm", "--pid", "host", "--user", "0", "--entrypoint", "sh", project.env["KVSERVE_IMAGE"],
           "-c", f"kill -KILL {pid}")
    with front_door(project, token, ca) as client:
        expect(client, seed=2, length=LONG)  # while the store is gone or starting again
        deadline = time.monotonic() + 120
        while int(project.inspect("kvstore", "{{.RestartCount}}")) == restarts:
            assert time.monotonic() < deadline, "Docker did not start the killed store again"
            time.sleep(1)
        project.wait_healthy(("kvstore",))
        phases.done("the killed store restarted and healthy")
        # The hand-off goes through the store that came back.
        assert expect(client, seed=3, length=LONG).timings.prefill_path == "disaggregated"
        expect(client, seed=2, length=LONG)
    project.wait_healthy()


def test_the_plaintext_overlay(
        project: Project, secrets: tuple[str, Path], expect: Callable[..., Result], phases: Phases) -> None:
    token, _ = secrets
    plain = Project(project.name, project.env, overlays=("docker-compose.insecure.yml",))
    plain.run("up", "--detach")
    plain.wait_healthy()
    phases.done("the plaintext overlay up, every service healthy")
    with front_door(plain, token, None) as client:
        assert expect(client, seed=4, length=LONG).timings.prefill_path == "disaggregated"
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{project.env['KVSERVE_HTTP_PORT']}/v1", api_key=token)
    assert sdk.models.list().data[0].id == "tiny-llama"
