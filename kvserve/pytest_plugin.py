"""kvserve's pytest plugin: a real kvserve stack for the tests of services built on it.

Installed with kvserve (entry point `pytest11`), it gives three fixtures:

- `kvserve_stack` (session): the KV store, prefill and decode services and the HTTP API as processes on free
  loopback ports, serving a tiny random-weight model built for the session, or the model folder
  named by `--kvserve-model DIR`, `$KVSERVE_TEST_MODEL` or the `kvserve_model` ini option (first
  given wins); a `KVServeStack` with their addresses, pids and logs. The stack is secure, as `kvserve
  up` is: TLS and a bearer token at the front door (`KVServeStack.client_kwargs`: the admin's token
  and the CA), mTLS at the store (`KVServeStack.admin_tls`: the admin's certificate).
- `kvserve_client`: a `client.Client` connected to the stack's front door (decode).
- `kvserve_store`: a `kvstore.KVStoreClient` connected to its KV store.
- `kvserve_http_url`: the base URL of the stack's OpenAI-compatible HTTP API (`https://127.0.0.1:PORT/v1`),
  for a test's own OpenAI client: `KVServeStack.openai_kwargs` has its API key (the admin's token) and the
  CA to verify it with, e.g. `openai.OpenAI(base_url=kvserve_http_url, api_key=stack.openai_kwargs["api_key"],
  http_client=openai.DefaultHttpx2Client(verify=ssl.create_default_context(cafile=stack.openai_kwargs["ca"])))`.

Nothing starts unless a test asks for one of them, and importing this module imports neither grpc
nor torch (the tiny model is built by a subprocess). At the end of the session every service is
stopped (SIGTERM, SIGKILL after a bound) and the store's shared-memory dir is gone. When a test that
uses the stack fails, what each service logged during that test is added to its report.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from client.client import Client
    from client.local import ClientCredentials
    from kvserve.stack.stack import Stack
    from kvstore import KVStoreClient

MODEL_ENV = "KVSERVE_TEST_MODEL"
SERVICES = ("kvstore", "prefill", "decode", "http")
TINY_MODEL_ARGS = ("--arch", "llama", "--layers", "2", "--hidden", "64", "--seed", "0")
HOST_CAPACITY, DISK_CAPACITY = "256MiB", "1GiB"
LOG_SECTION_BYTES = 16 * 1024  # per service and failed test: the end of what it logged
OUR_CLIENT = Path(__file__).resolve().parents[1] / "client"  # kvserve's client package, beside this one

_LOGS = pytest.StashKey[dict[str, Path]]()  # the session's service logs, known before they start
_LOG_OFFSETS = pytest.StashKey[dict[str, int]]()  # per test: log sizes when it started


@dataclass(frozen=True)
class KVServeStack:
    """The services `kvserve_stack` started; they live until the end of the test session."""

    addr: str  # the decode service, the front door: what `Client` connects to
    http_url: str  # OpenAI's HTTP API in front of it: https://HOST:PORT/v1
    prefill_addr: str
    store_addr: str
    model_dir: Path
    data_dir: Path  # the store's disk tier and the logs
    logs: dict[str, Path]  # "kvstore", "prefill", "decode", "http" -> that service's log file
    pids: dict[str, int]
    shm_dir: Path | None  # the store's shared-memory dir (its arena's socket); None when kept in process memory
    credentials: Path  # the folder of its CA, certificates and tokens (client/local.py)

    @property
    def client_kwargs(self) -> ClientCredentials:
        """`Client(stack.addr, **stack.client_kwargs)`: the admin's token and the CA of the front door."""
        return _ours("client.local").Layout(self.credentials).client_kwargs()

    @property
    def openai_kwargs(self) -> dict[str, str]:
        """What an OpenAI client of `http_url` needs: "api_key" (the admin's token) and "ca" (the CA file its
        HTTPS certificate is checked against)."""
        layout = _ours("client.local").Layout(self.credentials)
        return {"api_key": layout.admin_token.read_text(encoding="utf-8").strip(), "ca": str(layout.ca)}

    @property
    def admin_tls(self) -> Any:
        """An `kvserve.rpc.tls.TLSConfig` with the admin's certificate, for a `KVStoreClient` of the store."""
        return _admin_tls(self.credentials)

    def log(self, name: str) -> str:
        """Everything service `name` has logged so far."""
        return self.logs[name].read_text(errors="replace")


def _admin_tls(credentials: Path) -> Any:
    from kvserve.rpc.tls import TLSConfig

    layout = _ours("client.local").Layout(credentials)
    cert, key = layout.admin_cert
    return TLSConfig.load(cert, key, layout.ca)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvserve", "kvserve stack fixtures")
    group.addoption(
        "--kvserve-model", dest="kvserve_model", metavar="DIR", default=None,
        help=f"Hugging Face model folder that the kvserve_stack fixture serves (default: ${MODEL_ENV}, "
        "then the kvserve_model ini option, else a tiny random model built for the session)",
    )
    parser.addini("kvserve_model", "model folder kvserve_stack serves, relative to the ini file", default="")


@pytest.fixture(scope="session")
def kvserve_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVServeStack]:
    """The KV store, prefill and decode services as processes on free loopback ports."""
    stack_module = _ours("kvserve.stack.stack")  # grpc: only once a test asks for a stack
    Stack, StackConfig = stack_module.Stack, stack_module.StackConfig

    root = tmp_path_factory.mktemp("kvserve")
    say = _terminal(request.config)
    if theirs := _shadowing_client():
        say(f"{theirs} shadows kvserve's client package; the kvserve fixtures load kvserve's own")
    model_dir = _configured_model(request.config)
    if model_dir is None:
        say(f"building a tiny model for this session in {root / 'model'} ...")
        model_dir = _build_tiny_model(root / "model")
    data_dir, log_dir = root / "data", root / "data" / "logs"
    stack = Stack(StackConfig(
        model_dir, data_dir, decode_port=0, prefill_port=0, store_port=0,
        host_capacity=HOST_CAPACITY, disk_capacity=DISK_CAPACITY, http_port=0,
    ), log_dir=log_dir, progress=say)
    logs = {name: log_dir / f"{name}.log" for name in SERVICES}
    request.config.stash[_LOGS] = logs
    began = time.monotonic()
    stack.start()
    say(f"stack ready in {time.monotonic() - began:.1f} s (logs in {log_dir})")
    stack.progress = None  # its stop at the end of the session is quiet
    shm_dir = None
    try:
        assert stack.layout is not None
        shm_dir = _shm_dir(stack.service("kvstore").addr, _admin_tls(stack.layout.root))
        yield KVServeStack(
            addr=stack.service("decode").addr,
            http_url=stack.service("http").url + "/v1",
            prefill_addr=stack.service("prefill").addr,
            store_addr=stack.service("kvstore").addr,
            model_dir=model_dir,
            data_dir=data_dir,
            logs=dict(logs),
            pids={s.name: s.process.pid for s in stack.services},
            shm_dir=shm_dir,
            credentials=stack.layout.root,
        )
    finally:
        _stop(stack, shm_dir)


@pytest.fixture()
def kvserve_client(kvserve_stack: KVServeStack) -> Iterator[Client]:
    """A `Client` of the stack's front door, closed after the test."""
    with _ours("client.client").Client(kvserve_stack.addr, **kvserve_stack.client_kwargs) as client:
        yield client


@pytest.fixture()
def kvserve_http_url(kvserve_stack: KVServeStack) -> str:
    """The base URL of the stack's OpenAI-compatible HTTP API (`KVServeStack.openai_kwargs` to call it)."""
    return kvserve_stack.http_url


@pytest.fixture()
def kvserve_store(kvserve_stack: KVServeStack) -> Iterator[KVStoreClient]:
    """A `KVStoreClient` of the stack's KV store, closed after the test."""
    from kvstore import KVStoreClient

    with KVStoreClient(kvserve_stack.store_addr, tls=kvserve_stack.admin_tls) as store:
        yield store


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """Adds each service's log to the report of a failed test that uses the stack."""
    outcome = yield
    logs = item.config.stash.get(_LOGS, None)
    if logs is None or "kvserve_stack" not in getattr(item, "fixturenames", ()):
        return
    if call.when == "setup":
        item.stash[_LOG_OFFSETS] = {name: _size(path) for name, path in logs.items()}
    report = outcome.get_result()
    if report.failed:
        offsets = item.stash.get(_LOG_OFFSETS, {})
        for name, path in logs.items():
            if path.exists():  # not when the stack failed before starting this service
                report.sections.append((f"kvserve {name} log", _log_section(path, offsets.get(name))))


def _terminal(config: pytest.Config) -> Callable[[str], None]:
    """Writes "kvserve: MESSAGE" lines to the terminal, under -q and output capture too: a stack takes a while
    to start, and the person waiting should see why."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")

    def say(message: str) -> None:
        with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
            if reporter is not None:
                reporter.ensure_newline()  # after "test_file.py ": the file's next result starts a line of its own
                writer = config.get_terminal_writer()
                if writer.width_of_current_line:  # after -q's dots
                    writer.line()
                writer.line(f"kvserve: {message}")
            else:
                print(f"kvserve: {message}", file=sys.stderr, flush=True)

    return say


def _shadowing_client() -> str | None:
    """Where the `client` that `import client` finds comes from, when it is not kvserve's."""
    module = sys.modules.get("client")
    try:
        spec = module.__spec__ if module is not None else importlib.util.find_spec("client")
    except (ImportError, ValueError):
        return None
    origin = spec.origin if spec is not None else None
    if origin is None or Path(origin).resolve() == OUR_CLIENT / "__init__.py":
        return None
    return origin


_OUR_CLIENT_MODULES: dict[str, ModuleType] = {}  # kvserve's client modules, once loaded in a project's place


def _ours(name: str) -> Any:
    """Imports module `name` of kvserve. Where the project under test shadows the `client` package (a
    client.py of its own on its path), kvserve's is put in its place while the import runs, and the
    project's is put back after: kvserve's modules keep what they imported, the project keeps its own."""
    if _shadowing_client() is None:
        return importlib.import_module(name)
    theirs = {key: sys.modules.pop(key) for key in list(sys.modules) if key.partition(".")[0] == "client"}
    try:
        sys.modules.update(_OUR_CLIENT_MODULES)
        if "client" not in sys.modules:
            spec = importlib.util.spec_from_file_location("client", OUR_CLIENT / "__init__.py",
                                                          submodule_search_locations=[str(OUR_CLIENT)])
            assert spec is not None and spec.loader is not None
            sys.modules["client"] = package = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(package)
        return importlib.import_module(name)
    finally:
        for key in [key for key in sys.modules if key.partition(".")[0] == "client"]:
            _OUR_CLIENT_MODULES[key] = sys.modules.pop(key)
        sys.modules.update(theirs)


def _configured_model(config: pytest.Config) -> Path | None:
    option = config.getoption("kvserve_model")
    if option:
        return config.invocation_params.dir / option
    if os.environ.get(MODEL_ENV):
        return Path(os.environ[MODEL_ENV])
    ini = config.getini("kvserve_model")
    if ini:
        return (config.inipath.parent if config.inipath else config.rootpath) / ini
    return None


def _build_tiny_model(path: Path) -> Path:
    """`kvserve model init`, in a subprocess: the test process loads no torch."""
    done = subprocess.run([sys.executable, "-P", "-m", "kvserve.engine.tiny", str(path), *TINY_MODEL_ARGS],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"building the tiny model in {path} failed (exit {done.returncode}):\n{done.stderr}")
    return path


def _shm_dir(store_addr: str, tls: Any) -> Path | None:
    from kvstore import KVStoreClient

    with KVStoreClient(store_addr, tls=tls) as store:
        socket = store.info().arena_socket
    return Path(socket).parent if socket else None


def _stop(stack: Stack, shm_dir: Path | None) -> None:
    """Stops every service (SIGTERM, then SIGKILL after a bound) and removes the store's
    shared-memory dir if the store could not (killed)."""
    stack.stop()
    if shm_dir is not None and shm_dir.exists():
        shutil.rmtree(shm_dir, ignore_errors=True)
        warnings.warn(f"kvserve: the KV store left its shared-memory dir {shm_dir} behind; removed it",
                      stacklevel=1)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _log_section(path: Path, since: int | None) -> str:
    """The end of what `path` got past offset `since` (of the whole log when None), at most
    LOG_SECTION_BYTES; the end of the log when nothing came past `since`."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            fresh = since is not None and end > since
            start = max(since if fresh and since is not None else 0, end - LOG_SECTION_BYTES)
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError as exc:
        return f"cannot read {path}: {exc}"
    if since is None:
        what = "its end"
    elif fresh:
        what = "what it logged during this test"
    else:
        what = "nothing logged during this test; its end"
    return f"{path} ({what}):\n{text}"
