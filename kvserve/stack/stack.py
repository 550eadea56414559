"""Runs the three services as local processes: what `kvserve up`, the demo and the benchmarks use."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.local import Layout
from kvserve.rpc.server import SHARE_PORT_ENV  # "1": a service binds with SO_REUSEPORT (stack.placeholder)
from kvserve.stack.credentials import ensure as ensure_credentials
from kvserve.stack.memory import held_bytes, size
from kvserve.stack.status import describe_exit

START_TIMEOUT_S = 120.0
METRICS_OFFSETS = {"decode": 0, "prefill": 1, "kvstore": 2, "http": 3}  # each one's port past --metrics-base-port


class StackError(RuntimeError):
    pass


def connect_host(host: str) -> str:
    """The address to reach a server that listens on `host` (a wildcard means this machine)."""
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


@dataclass
class Service:
    """One service process; `port` is read from the `LISTENING <port>` line it prints.

    `log_offset` is the size its log had when this process started: what it logged lies past it."""

    name: str
    process: subprocess.Popen[str]
    port: int
    log_path: Path | None
    host: str = "127.0.0.1"
    log_offset: int = 0
    started_at: float = field(default_factory=time.time)  # Unix time
    log_file: IO[str] | None = field(default=None, repr=False)  # its stderr, and its stdout once drained
    credentials: grpc.ChannelCredentials | None = field(default=None, repr=False)  # to ask its health over TLS
    health_url: str | None = None  # an HTTP service (http_api): its health is a GET of this path, not gRPC's
    ca: str | None = None  # the CA its HTTPS certificate is checked against

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """An HTTP service's base URL (https when it serves TLS)."""
        return f"{'http' if self.ca is None else 'https'}://{self.addr}"


_TAIL_BYTES = 64 << 10


def log_lines(log_path: Path | None, lines: int = 3, since: int = 0) -> list[str]:
    """The last non-empty lines of a service log written past byte `since` (one process's own lines)."""
    if log_path is None or not log_path.exists():
        return []
    with open(log_path, "rb") as f:
        start = max(since, f.seek(0, os.SEEK_END) - _TAIL_BYTES)
        f.seek(start)
        text = f.read().decode(errors="replace")
    if start > since:  # the first line read is cut
        text = text.partition("\n")[2]
    return [line.rstrip() for line in text.splitlines() if line.strip()][-lines:]


def log_tail(log_path: Path | None, lines: int = 3, since: int = 0) -> str:
    """The last lines of a service log (past byte `since`), indented, for an error message ("" when
    there is none)."""
    return "".join(f"\n    {line}" for line in log_lines(log_path, lines, since))


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of the last `flag VALUE` or `flag=VALUE` in args (argparse keeps the last)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def health_credentials(args: Sequence[str]) -> grpc.ChannelCredentials | None:
    """For a service started with --tls-cert/--tls-key/--tls-ca: TLS that presents its own certificate
    (an internal server takes only callers with one from its CA); None for a plaintext one."""
    cert, key, ca = (flag_value(args, f) for f in ("--tls-cert", "--tls-key", "--tls-ca"))
    if not cert or not key:
        return None
    return grpc.ssl_channel_credentials(root_certificates=Path(ca).read_bytes() if ca else None,
                                        private_key=Path(key).read_bytes(), certificate_chain=Path(cert).read_bytes())


def remove_shm_leftovers(pid: int, root: Path = Path("/dev/shm")) -> list[Path]:
    """Removes the shared-memory dirs (kvstore/host_tier.py: ROOT/kvserve-PID-*) of the store process
    `pid` once it has died; those of live processes, and other users', are left alone."""
    try:
        os.kill(pid, 0)
        return []  # alive (or the pid is in use again): its dir is not a leftover
    except ProcessLookupError:
        pass
    except OSError:
        return []
    removed = []
    for d in root.glob(f"kvserve-{pid}-*"):
        try:
            if not d.is_dir() or d.is_symlink() or d.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


PARENT_PID_ENV = "KVSERVE_PARENT_PID"  # read by kvserve.host.process.exit_with_parent in each service


def _child_env(share_port: bool = False) -> dict[str, str]:
    """The services' environment. From the main thread it names this process as their parent, so
    that on Linux each asks to get SIGTERM when this process dies (even by SIGKILL) and a killed
    `kvserve up` leaves no orphan servers holding its ports and data folder. Off the main thread
    it does not: the signal follows the thread that started a child, and a worker thread's end
    would stop it. The services set this up themselves, not a preexec function here: code run
    between fork and exec in a process that already has gRPC threads can deadlock or crash."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop(PARENT_PID_ENV, None)
    env.pop(SHARE_PORT_ENV, None)
    if share_port:
        env[SHARE_PORT_ENV] = "1"
    if threading.current_thread() is threading.main_thread():
        env[PARENT_PID_ENV] = str(os.getpid())
    return env


def port_in_use(host: str, port: int, *, shared: bool = False) -> bool:
    """Whether a server listens on `port` of `host`. A bind without SO_REUSEPORT fails where one
    does (gRPC servers set SO_REUSEPORT, and would share the port); SO_REUSEADDR lets the bind
    pass over connections of a stopped server that linger in TIME_WAIT. `shared`: bind with
    SO_REUSEPORT, so that a server of ours that shares its port (stack.placeholder) does not count."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind((host.strip("[]") or "0.0.0.0", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _drain(stream: IO[str], sink: IO[str] | None) -> None:
    for line in stream:
        if sink is not None:
            sink.write(line)
            sink.flush()
    if sink is not None:
        sink.close()


def start_service(
    name: str, module: str, args: Sequence[str], log_path: Path | None = None, timeout_s: float = START_TIMEOUT_S,
    host: str = "127.0.0.1", health_url: str | None = None, progress: Callable[[str], None] | None = None,
) -> Service:
    """Starts `python -m module args...`, waits for its LISTENING line and for health SERVING (see `wait_started`).

    The process ends when the one that started it dies (Linux). `host` is where to reach it."""
    return wait_started(spawn_service(name, module, args, log_path, host, health_url=health_url), timeout_s,
                        progress=progress)


def spawn_service(name: str, module: str, args: Sequence[str], log_path: Path | None = None,
                  host: str = "127.0.0.1", port: int = 0, health_url: str | None = None,
                  share_port: bool = False) -> Service:
    """Starts `python -m module args...` and returns at once: `wait_started` waits for it to serve.

    Call it from the main thread: a service started by another thread is stopped when that thread ends
    (see `_child_env`). `port` is the one it is expected to listen on (0: not known yet). `health_url`: the
    service is an HTTP one, healthy once a GET of that path answers 200 (over HTTPS with its --tls-cert).
    `share_port`: it binds with SO_REUSEPORT, beside a placeholder that holds its port (stack.placeholder)."""
    # Read before anything starts: a file that cannot be read raises OSError with no process left behind.
    credentials = health_credentials(args) if health_url is None else None
    log = open(log_path, "a") if log_path else None  # noqa: SIM115 - owned by the drain thread
    offset = log.seek(0, os.SEEK_END) if log is not None else 0
    try:
        proc = subprocess.Popen(
            # -P: the caller's folder is not on the service's path (a project's client.py would shadow kvserve's).
            [sys.executable, "-P", "-m", module, *args],
            stdout=subprocess.PIPE,
            stderr=log if log is not None else None,
            text=True,
            env=_child_env(share_port),
        )
    except BaseException:
        if log is not None:
            log.close()
        raise
    if health_url is not None:
        return Service(name, proc, port, log_path, host, log_offset=offset, log_file=log, health_url=health_url,
                       ca=flag_value(args, "--tls-ca") if flag_value(args, "--tls-cert") else None)
    return Service(name, proc, port, log_path, host, log_offset=offset, log_file=log, credentials=credentials)


class StartFailed(StackError):
    """A service that exited or hung before serving; `reason` says which, without the log."""

    def __init__(self, service: Service, reason: str) -> None:
        tail = log_tail(service.log_path, since=service.log_offset)
        super().__init__(f"{service.name} {reason}" + (f"; {service.log_path} ends with:{tail}" if tail else ""))
        self.service = service
        self.reason = reason


def wait_started(service: Service, timeout_s: float = START_TIMEOUT_S,
                 listening: Callable[[], None] | None = None, progress: Callable[[str], None] | None = None) -> Service:
    """Waits for a spawned service's LISTENING line (setting its port; then calls `listening`) and for
    health SERVING, telling `progress` what the service says it is doing meanwhile; kills it and raises
    StartFailed when it exits or does not get there within timeout_s. Any thread may wait."""
    proc = service.process
    draining = False
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        port = _read_listening_port(proc.stdout.fileno(), deadline, progress)
        if port is None and time.monotonic() < deadline:  # its output ended: it is exiting
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        if port is None and proc.poll() is None:
            raise StartFailed(service, f"did not start within {timeout_s:.0f} s")
        if port is None:
            raise StartFailed(service, f"{describe_exit(proc.wait())} before listening")
        service.port = port
        if listening is not None:
            listening()
        threading.Thread(target=_drain, args=(proc.stdout, service.log_file), daemon=True).start()
        draining = True
        try:
            if service.health_url is not None:
                wait_http_healthy(service.url + service.health_url, deadline - time.monotonic(), proc, service.ca)
            else:
                wait_healthy(service.addr, deadline - time.monotonic(), proc, service.credentials)
        except StackError:
            if proc.poll() is None:
                raise
            raise StartFailed(service, f"{describe_exit(proc.returncode)} before it was healthy") from None
        return service
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if not draining and service.log_file is not None:
            service.log_file.close()
        raise


def _read_listening_port(fd: int, deadline: float, progress: Callable[[str], None] | None = None) -> int | None:
    """The port of the `LISTENING <port>` line on fd; None at end of file or past the deadline. The text of each
    `PROGRESS <text>` line before it goes to `progress` (rpc.cli.progress).

    Polls rather than blocking in read(): a signal delivered to another thread of this process
    must still reach its handler in the main thread promptly (Ctrl-C while starting).
    """
    pending = b""
    while time.monotonic() < deadline:
        if not select.select([fd], [], [], 0.2)[0]:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            return None
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if line.startswith(b"LISTENING "):
                return int(line.split()[1])
            if line.startswith(b"PROGRESS ") and progress is not None:
                progress(line.removeprefix(b"PROGRESS ").decode(errors="replace").strip())
    return None


def wait_healthy(addr: str, timeout_s: float, process: subprocess.Popen[str] | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
    """Waits for health SERVING at addr (over TLS with `credentials`); StackError past timeout_s, or as
    soon as `process` exits."""
    deadline = time.monotonic() + max(timeout_s, 1.0)
    with (grpc.insecure_channel(addr) if credentials is None else grpc.secure_channel(addr, credentials)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process is not None and process.poll() is not None:
                raise StackError(f"{addr}: the server {describe_exit(process.returncode)}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise StackError(f"{addr} is not healthy after {timeout_s:.0f} s")
            time.sleep(0.1)


def wait_http_healthy(url: str, timeout_s: float, process: subprocess.Popen[str] | None = None,
                      ca: str | None = None) -> None:
    """Waits for a GET of `url` to answer 200 (checking HTTPS against the CA file `ca`); StackError past
    timeout_s, or as soon as `process` exits."""
    deadline = time.monotonic() + max(timeout_s, 1.0)
    context = ssl.create_default_context(cafile=ca) if ca else None
    while True:
        if process is not None and process.poll() is not None:
            raise StackError(f"{url}: the server {describe_exit(process.returncode)}")
        try:
            with urllib.request.urlopen(url, timeout=2.0, context=context) as reply:
                if reply.status == 200:
                    return
        except OSError:  # refused, 503 (HTTPError), TLS
            pass
        if time.monotonic() > deadline:
            raise StackError(f"{url} is not healthy after {timeout_s:.0f} s")
        time.sleep(0.1)


def stop_service(service: Service, timeout_s: float = 30.0) -> int:
    """SIGTERM, then SIGKILL if it has not exited within timeout_s; returns its exit code."""
    if service.process.poll() is None:
        service.process.send_signal(signal.SIGTERM)
        try:
            service.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            service.process.kill()
    return service.process.wait()


# The services that run the model, which share this host's cores by thread budgets (`thread_budgets`); the
# odd core goes to the first. (Decode used to start at nice 10 instead, so that prompts went first; with
# budgets that no longer helped, docs/OPERATIONS.md, "CPU threads".)
COMPUTE_SERVICES = ("decode", "prefill")


def host_cores() -> int:
    """How many cores this process, and so the stack it starts, may use (its affinity mask)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def thread_budgets(cores: int, names: Sequence[str] = COMPUTE_SERVICES,
                   fixed: Mapping[str, int] | None = None) -> dict[str, int]:
    """The compute threads (--threads) of the services `names` that share `cores`: those in `fixed` keep
    theirs, the others split what is left evenly, the odd cores to the first named (decode), at least 1
    each. They add up to `cores` but where there are fewer cores than services (one core: 1 each)."""
    fixed = {n: t for n, t in (fixed or {}).items() if n in names}
    rest = [n for n in names if n not in fixed]
    left = max(cores - sum(fixed.values()), 0)
    share, odd = divmod(left, len(rest)) if rest else (0, 0)
    return {n: fixed[n] if n in fixed else max(1, share + (rest.index(n) < odd)) for n in names}


# The flags whose value is a file a service reads as it starts: its certificate, key and CA, the store's record
# key, decode's tokens files and secret.
FILE_FLAGS = ("--tls-cert", "--tls-key", "--tls-ca", "--record-key-file", "--auth-tokens", "--auth-secret-file",
              "--service-tokens")


def unreadable(paths: Sequence[Path]) -> dict[Path, str]:
    """Each of `paths` that cannot be opened for reading, with why ("missing", "unreadable: Permission denied")."""
    why = {}
    for path in paths:
        try:
            with open(path, "rb"):
                pass
        except FileNotFoundError:
            why[path] = "missing"
        except OSError as exc:
            why[path] = f"unreadable: {exc.strerror or exc}"
    return why


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """How a stack starts one of its services; a restart runs the same command on the same port."""

    name: str
    module: str
    args: tuple[str, ...]
    log_path: Path | None
    host: str  # where to reach it
    health_url: str | None = None  # an HTTP service's health path (spawn_service)

    @property
    def port(self) -> int:
        listen = flag_value(self.args, "--listen") or ""
        return int(listen.rpartition(":")[2] or 0)

    @property
    def ports(self) -> list[int]:
        """The ports it listens on (gRPC, then metrics), leaving out 0 (any)."""
        metrics = flag_value(self.args, "--metrics-port")
        return [p for p in (self.port, int(metrics or 0)) if p]

    @property
    def files(self) -> list[Path]:
        """What it reads as it starts: the files its flags name (FILE_FLAGS), and its --model's config.json and
        the other files in that folder now."""
        paths = [Path(p) for p in (flag_value(self.args, f) for f in FILE_FLAGS) if p]
        if (model := flag_value(self.args, "--model")) is None:
            return paths
        config = Path(model) / "config.json"
        try:
            others = sorted(p for p in Path(model).iterdir() if p.is_file() and p != config)
        except OSError:
            others = []
        return [*paths, config, *others]

    def on_port(self, port: int) -> ServiceSpec:
        """The same service on `port` (where it was started on port 0 and got that one)."""
        args = list(self.args)
        for i, arg in enumerate(args[:-1]):
            if arg == "--listen":
                args[i + 1] = f"{args[i + 1].rpartition(':')[0]}:{port}"
        return ServiceSpec(self.name, self.module, tuple(args), self.log_path, self.host, self.health_url)


@dataclass
class StackConfig:
    model_dir: Path
    data_dir: Path
    host: str = "127.0.0.1"
    decode_port: int = 50051
    prefill_port: int = 50052
    store_port: int = 50053
    metrics_base_port: int | None = None  # decode, prefill, store, http get base, base+1, base+2, base+3
    host_capacity: str | None = None  # the store's --host-capacity (None: its default)
    disk_capacity: str = "8GiB"
    block_size: int = 16
    # prefill's and decode's --kv-cache-memory, --max-model-len, --max-num-seqs (None: theirs)
    kv_cache_memory: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    extra_store_args: list[str] = field(default_factory=list)
    # Appended to each service's flags; a flag given again wins (argparse keeps the last), so e.g.
    # extra_prefill_args=["--kvstore", ADDR] points prefill at another store.
    extra_prefill_args: list[str] = field(default_factory=list)
    extra_decode_args: list[str] = field(default_factory=list)
    # Secure by default: mTLS between the services, TLS and tokens at the front door, a MAC on the store's
    # records, with the credentials in this folder (client/local.py; None: data_dir), made on the first start.
    # `insecure` serves plaintext with no tokens instead, and says so in each service's log.
    credentials: Path | None = None
    insecure: bool = False
    # The cores prefill and decode split between them (`thread_budgets`); None: those this process may use.
    cores: int | None = None
    # The OpenAI-compatible HTTP API (http_api) on this port in front of decode (0: any); None: not served.
    http_port: int | None = None


def _given(flag: str, value: object) -> tuple[str, ...]:
    """(flag, value) where value is set; () where it is None."""
    return () if value is None else (flag, str(value))


class Stack:
    """The store, prefill and decode services as local processes, started in order; with `http_port`, the
    OpenAI-compatible HTTP API in front of decode too.

    `progress`, if given, hears what start and stop do: "starting decode ...", "decode ready on ADDR (2.1 s)",
    "stopping decode ...", "stopped in 1.3 s" (a message that ends in "..." is a step under way)."""

    def __init__(self, config: StackConfig, log_dir: Path | None = None,
                 progress: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.log_dir = log_dir
        self.progress = progress
        self.services: list[Service] = []
        self.specs: dict[str, ServiceSpec] = {}

    def _say(self, message: str) -> None:
        if self.progress is not None:
            self.progress(message)

    def _metrics(self, offset: int) -> list[str]:
        base = self.config.metrics_base_port
        return [] if base is None else ["--metrics-port", str(base + offset)]

    @property
    def layout(self) -> Layout | None:
        """Where the stack's credentials are; None when it serves plaintext."""
        c = self.config
        return None if c.insecure else Layout(c.credentials or c.data_dir)

    def _secure(self, name: str) -> list[str]:
        """The flags that make service `name` secure: its certificate, and the store's record key or decode's
        tokens; --insecure when the stack is not."""
        layout = self.layout
        if layout is None:
            return ["--insecure"]
        own = {"kvstore": ["--record-key-file", str(layout.record_key)],
               "decode": ["--auth-tokens", str(layout.tokens), "--auth-secret-file", str(layout.tokens_secret),
                          "--service-tokens", str(layout.service_tokens)]}
        return [*layout.tls_flags(name), *own.get(name, [])]

    def _log(self, name: str) -> Path | None:
        if self.log_dir is None:
            return None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self.log_dir / f"{name}.log"

    def extra_args(self, name: str) -> list[str]:
        c = self.config
        return {"kvstore": c.extra_store_args, "prefill": c.extra_prefill_args, "decode": c.extra_decode_args}[name]

    def setting(self, name: str, flag: str) -> str | None:
        """What the service `name` is given for `flag` besides the stack's own: in its extra args, else in
        this process's environment (KVSERVE_<SERVICE>_<FLAG>, which the service reads too)."""
        value = flag_value(self.extra_args(name), flag)
        return value if value is not None else os.environ.get(f"KVSERVE_{name.upper()}_{flag[2:].upper()}") or None

    def thread_budgets(self) -> dict[str, int]:
        """The --threads the stack gives prefill and decode, which share this host's cores: they add up to
        them (`thread_budgets`). A service on CUDA is left out (its own default applies: the GPU computes),
        and one given --threads in its extra args or KVSERVE_<SERVICE>_THREADS keeps it, the other taking
        the rest of the cores."""
        cpu = [n for n in COMPUTE_SERVICES if not (self.setting(n, "--device") or "cpu").startswith("cuda")]
        fixed = {n: int(t) for n in cpu if (t := self.setting(n, "--threads")) and t.isdigit() and int(t) > 0}
        cores = self.config.cores if self.config.cores is not None else host_cores()
        return {n: t for n, t in thread_budgets(cores, cpu, fixed).items() if n not in fixed}

    def _threads(self, name: str) -> list[str]:
        """--threads from the split, and --share-cores: services the split gave budgets lend each other the
        cores of theirs while idle (kvserve.host.cores), through a folder of the data dir that `start` empties."""
        budgets = self.thread_budgets()
        if name not in budgets:
            return []
        cores = self.config.cores if self.config.cores is not None else host_cores()
        # not on one core, where each already has a thread of its own on it
        share = ["--share-cores", str(self.cores_dir)] if len(budgets) > 1 and sum(budgets.values()) <= cores else []
        return ["--threads", str(budgets[name]), *share]

    @property
    def cores_dir(self) -> Path:
        return self.config.data_dir / "cores"

    def store_spec(self) -> ServiceSpec:
        c = self.config
        return ServiceSpec("kvstore", "kvstore", (
            "--listen", f"{c.host}:{c.store_port}", *_given("--host-capacity", c.host_capacity),
            "--disk-capacity", c.disk_capacity, "--disk-path", str(c.data_dir / "kvstore"),
            *self._metrics(METRICS_OFFSETS["kvstore"]), *self._secure("kvstore"), *c.extra_store_args,
        ), self._log("kvstore"), connect_host(c.host))

    def prefill_spec(self, store_addr: str) -> ServiceSpec:
        c = self.config
        return ServiceSpec("prefill", "prefill_service", (
            *self._common(store_addr), "--listen", f"{c.host}:{c.prefill_port}",
            *self._metrics(METRICS_OFFSETS["prefill"]),
            *self._threads("prefill"), *self._secure("prefill"), *c.extra_prefill_args,
        ), self._log("prefill"), connect_host(c.host))

    def decode_spec(self, store_addr: str, prefill_addr: str) -> ServiceSpec:
        c = self.config
        return ServiceSpec("decode", "decode_service", (
            *self._common(store_addr), "--prefill", prefill_addr, "--listen", f"{c.host}:{c.decode_port}",
            *self._metrics(METRICS_OFFSETS["decode"]), *self._threads("decode"), *self._secure("decode"),
            *c.extra_decode_args,
        ), self._log("decode"), connect_host(c.host))

    def http_spec(self, decode_addr: str) -> ServiceSpec:
        """The HTTP API in front of decode, serving the model under its folder's name, with a certificate of its
        own (it holds no model, no token: each caller's token goes on to decode)."""
        c = self.config
        layout = self.layout
        secure = ["--insecure"] if layout is None else layout.tls_flags("http")
        return ServiceSpec("http", "kvserve.http", (
            "--listen", f"{c.host}:{c.http_port}", "--upstream", decode_addr, "--model-name", c.model_dir.name,
            *self._metrics(METRICS_OFFSETS["http"]), *secure,
        ), self._log("http"), connect_host(c.host), health_url="/health")

    def _common(self, store_addr: str) -> tuple[str, ...]:
        c = self.config
        return ("--model", str(c.model_dir), "--kvstore", store_addr, "--block-size", str(c.block_size),
                *_given("--kv-cache-memory", c.kv_cache_memory), *_given("--max-model-len", c.max_model_len),
                *_given("--max-num-seqs", c.max_num_seqs))

    def hosts(self) -> list[str]:
        """The host the services' certificates must name besides localhost: the one they listen on."""
        host = self.config.host.strip("[]")
        return [] if host in ("", "0.0.0.0", "::", "127.0.0.1", "::1", "localhost") else [host]

    def check(self) -> None:
        """Raises StackError, before anything starts, when the model folder is missing or a port is taken."""
        c = self.config
        if not (c.model_dir / "config.json").is_file():
            what = "does not exist" if not c.model_dir.exists() else "has no config.json"
            raise StackError(f"model folder {c.model_dir} {what}: give a Hugging Face model folder "
                             f"(`kvserve model init DIR` builds a tiny one)")
        self.check_ports()

    def check_ports(self) -> None:
        """Raises StackError when a port the stack would listen on is taken (gRPC servers share a port
        silently, so a second stack would not fail by itself)."""
        c = self.config
        ports = {"decode": c.decode_port, "prefill": c.prefill_port, "store": c.store_port, "HTTP": c.http_port or 0}
        if c.metrics_base_port is not None:
            ports |= {f"{name} metrics": c.metrics_base_port + offset for name, offset in METRICS_OFFSETS.items()
                      if name != "http" or c.http_port is not None}
        taken = [f"{name} port {port}" for name, port in ports.items() if port and port_in_use(c.host, port)]
        if taken:
            raise StackError(f"{', '.join(taken)} already in use on {c.host} (another `kvserve up`?); "
                             "stop it or choose other ports")

    def start(self) -> Stack:
        try:
            self.check()
            if self.layout is not None:
                try:
                    ensure_credentials(self.layout.root, self.hosts())
                except (ValueError, OSError) as exc:  # TLSError, AuthConfigError: a half CA, a broken file
                    raise StackError(f"the credentials in {self.layout.root} cannot be used: {exc}") from None
            shutil.rmtree(self.cores_dir, ignore_errors=True)  # an earlier run's budgets (other ports)
            store = self.add(self.store_spec())
            prefill = self.add(self.prefill_spec(store.addr))
            decode = self.add(self.decode_spec(store.addr, prefill.addr))
            if self.config.http_port is not None:
                self.add(self.http_spec(decode.addr))
        except BaseException:
            self.stop()
            raise
        return self

    def add(self, spec: ServiceSpec) -> Service:
        """Starts one more service and waits until it serves; `stop` stops it before those added earlier."""
        self._say(f"starting {spec.name} ...")
        began = time.monotonic()
        try:
            service = start_service(spec.name, spec.module, spec.args, spec.log_path, host=spec.host,
                                    health_url=spec.health_url, progress=lambda text: self._say(f"{spec.name}: {text}"))
        except (StackError, OSError):  # not a signal's exception: an interrupted start says so itself
            self._say(f"{spec.name} did not start")
            raise
        held = held_bytes(service.process.pid)
        self._say(f"{spec.name} ready on {service.addr} ({time.monotonic() - began:.1f} s"
                  f"{'' if held is None else f', {size(held)} resident'})")
        self.services.append(service)
        self.specs[spec.name] = spec.on_port(service.port)
        return service

    def respawn(self, name: str, share_port: bool = False) -> Service:
        """Starts service `name` again, with the same flags on the same port, in place of its process,
        which must have exited (`share_port`: beside a placeholder, see `spawn_service`). Returns at once:
        `wait_started` waits for it to serve; OSError, with nothing started, where its TLS files or its log
        cannot be opened. Main thread only (see `spawn_service`)."""
        spec = self.specs[name]
        i = next(i for i, s in enumerate(self.services) if s.name == name)
        if self.services[i].process.poll() is None:
            raise StackError(f"{name} (pid {self.services[i].process.pid}) is still running")
        self._log(name)  # its folder again, should it have been removed
        service = spawn_service(name, spec.module, spec.args, spec.log_path, spec.host, port=spec.port,
                                health_url=spec.health_url, share_port=share_port)
        self.services[i] = service
        return service

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    @property
    def addr(self) -> str:
        return self.service("decode").addr

    def stop(self) -> None:
        """Stops the HTTP API, decode, then prefill, then the store (which flushes its memory tiers to disk)."""
        began = time.monotonic()
        stopping = bool(self.services)
        for service in reversed(self.services):
            self._say(f"stopping {service.name} ...")
            stop_service(service)
        self.services.clear()
        if stopping:
            self._say(f"stopped in {time.monotonic() - began:.1f} s")

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
