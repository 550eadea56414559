"""What every service's command line shares: the server flags, the model-service flags, logging,
size parsing, and serving until SIGTERM with one clear line when the start fails."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import logging
import os
import signal
import struct
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from kvserve.rpc.server import Server, run_until_signal
from kvserve.rpc.tls import ENV_CA, ENV_CERT, ENV_KEY, TLSConfig, TLSError


def parse_size(text: str) -> int:
    """'512MiB', '2GiB', '100MB', '4096' -> bytes."""
    units = {
        "": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
        "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4,
        "tib": 1024**4,
    }
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if not num or unit not in units:
        raise ValueError(f"cannot read size {text!r}: use a number with an optional unit like 512MiB or 2GiB")
    return int(float(num) * units[unit])


OWNER_ONLY = 0o077  # the umask of every service and of `kvserve up`: files 0600, folders 0700
DTYPES = ("auto", "float32", "bfloat16", "float16")  # --dtype: engine.model.model_dtype reads them

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def env_prefix(service: str) -> str:
    """`KVSERVE_<SERVICE>_`: the prefix of the variables that set `service`'s flags."""
    return f"KVSERVE_{service.upper()}_"


def env_epilog(service: str) -> str:
    """The line every service's --help ends with, naming its variables."""
    return (f"Every flag can be set by an environment variable instead: {env_prefix(service)}<FLAG>, the flag's "
            f"name in upper case with dashes as underscores (e.g. --log-level: {env_prefix(service)}LOG_LEVEL; "
            f"a switch takes true or false). A flag on the command line wins over its variable.")


def env_args(p: argparse.ArgumentParser, service: str, environ: dict[str, str] | None = None) -> list[str]:
    """The command-line arguments the `KVSERVE_<SERVICE>_<FLAG>` variables of `environ` stand for."""
    environ = dict(os.environ) if environ is None else environ
    args: list[str] = []
    for action in p._actions:
        flags = [s for s in action.option_strings if s.startswith("--")]
        if not flags or isinstance(action, argparse._HelpAction):
            continue
        flag = flags[0]
        var = env_prefix(service) + flag[2:].upper().replace("-", "_")
        value = environ.get(var, "")
        if not value:
            continue
        if action.nargs == 0:  # a switch: --x, or --x/--no-x
            word = value.strip().lower()
            if word not in _TRUE | _FALSE:
                p.error(f"{var}={value!r}: a switch takes true or false")
            if word in _TRUE:
                args.append(flag)
            elif isinstance(action, argparse.BooleanOptionalAction):
                args.append(f"--no-{flag[2:]}")
        else:
            args.append(f"{flag}={value}")
    return args


def parse_args(p: argparse.ArgumentParser, argv: Iterable[str] | None, service: str) -> argparse.Namespace:
    """`p.parse_args(argv)` with every flag also readable from `KVSERVE_<SERVICE>_<FLAG>`; the command line
    comes after the variables, so it wins. Every service starts here, and from here on what it writes (the
    disk tier, sockets, logs) is its user's alone, whatever umask it was started with."""
    os.umask(OWNER_ONLY)
    argv = sys.argv[1:] if argv is None else list(argv)
    return p.parse_args([*env_args(p, service), *argv])


def add_server_flags(p: argparse.ArgumentParser, *, listen: str, max_workers: int | None = None) -> None:
    """--listen, --metrics-port, --log-level, --tls-cert/--tls-key/--tls-ca, and --max-workers when the
    service takes it."""
    p.add_argument("--listen", default=listen, help="HOST:PORT to serve on; port 0 picks one "
                   "and prints LISTENING <port> (default %(default)s)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port (0: any)")
    p.add_argument("--health-listen", default=None, metavar="ADDR",
                   help="also answer health checks (only those) on this address, HOST:PORT or unix:PATH, with the same "
                        "TLS as --listen but on a gRPC server of their own, so that a probe never waits behind the "
                        "service's calls; the deployments' probes ask there (default: off)")
    if max_workers is not None:
        p.add_argument("--max-workers", type=positive_int, default=max_workers,
                       help="most calls served at once (a stream counts until it ends); one more is refused at once "
                            "with RESOURCE_EXHAUSTED. Health checks do not count (default %(default)s)")
    p.add_argument("--log-level", default="INFO")
    tls = p.add_argument_group("TLS", "mTLS between the services, required unless --insecure; `kvserve credentials "
                                      "DIR` makes the files (`kvserve up` does on its first start)")
    tls.add_argument("--tls-cert", default=os.environ.get(ENV_CERT) or None, metavar="PEM",
                     help=f"this service's certificate: served to its callers and presented to the services it "
                          f"calls (env {ENV_CERT})")
    tls.add_argument("--tls-key", default=os.environ.get(ENV_KEY) or None, metavar="PEM",
                     help=f"the certificate's private key (env {ENV_KEY})")
    tls.add_argument("--tls-ca", default=os.environ.get(ENV_CA) or None, metavar="PEM",
                     help=f"the CA that signs the services' certificates: the services this one calls are checked "
                          f"against it, and the store and prefill accept only callers with a certificate it "
                          f"signed (env {ENV_CA})")
    tls.add_argument("--insecure", action="store_true",
                     help="serve plaintext gRPC with no TLS: anyone who reaches the port can call it (and read or "
                          "write the store's blocks). Only for a port nobody else can reach; logged as a warning")


def tls_from_args(args: argparse.Namespace, service: str) -> TLSConfig | None:
    """The service's TLS settings from --tls-cert, --tls-key, --tls-ca; None (plaintext) only with --insecure,
    which is logged as a warning. A certificate comes with its key, and a CA needs both (a server serves TLS
    with its own certificate); a missing or bad setting is one line on stderr and exit code 2, as a bad flag is."""
    given = any(v is not None for v in (args.tls_cert, args.tls_key, args.tls_ca))
    try:
        if getattr(args, "insecure", False):
            if given:
                raise TLSError("--insecure serves plaintext: drop it, or drop --tls-cert/--tls-key/--tls-ca "
                               f"(or ${ENV_CERT}, ${ENV_KEY}, ${ENV_CA})")
            logging.getLogger("kvserve.rpc.cli").warning(
                "--insecure: serving plaintext gRPC with no TLS; anyone who reaches %s can call %s", args.listen,
                service)
            return None
        if not given:
            raise TLSError("serves TLS unless told otherwise: give --tls-cert, --tls-key and --tls-ca (`kvserve "
                           "credentials DIR` makes them; `kvserve up` does it for you), or --insecure for plaintext "
                           "on a port nobody else can reach")
        flag, missing = (("--tls-ca", "--tls-cert and --tls-key") if args.tls_cert is None and args.tls_key is None
                         else ("--tls-key", "--tls-cert") if args.tls_cert is None
                         else ("--tls-cert", "--tls-key") if args.tls_key is None else ("", ""))
        if missing:
            raise TLSError(f"{flag} needs {missing}: a service serves TLS with its own certificate and key, "
                           f"which it also presents to the services it calls (`kvserve certs DIR` makes them)")
        return TLSConfig.load(args.tls_cert, args.tls_key, args.tls_ca)
    except TLSError as exc:
        print(f"{service}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def add_model_flags(p: argparse.ArgumentParser, *, model_help: str) -> None:
    """The flags of a service that runs the model over the store (prefill, decode)."""
    p.add_argument("--model", required=True, help=model_help)
    p.add_argument("--kvstore", default="127.0.0.1:50053", help="KV store address (default %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block; every service of a "
                   "deployment must agree (default %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default %(default)s)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="the model's dtype, and its KV's: auto is the one the model's config names, float32 when "
                        "it names none; every service of a deployment must agree (default %(default)s)")
    p.add_argument("--store-timeout-s", type=float, default=2.0,
                   help="deadline of each KV store call; past it the request recomputes (default %(default)s)")




def add_engine_flags(p: argparse.ArgumentParser, *, budget_cpu: int, budget_cuda: int, why: str) -> None:
    """The flags of the batched engine (prefill, decode): KV pool size and what one step may hold.
    The token budget's default depends on the device (see `engine_token_budget`)."""
    p.add_argument("--kv-cache-memory", type=parse_size, default=None, metavar="BYTES",
                   help="most memory the KV pool takes, e.g. 2GiB; on CPU it takes it as its blocks are used, and "
                        "keeps finished sequences' blocks only within what it has taken (the store keeps the rest). "
                        "Default on CPU: what --max-num-seqs sequences of --max-model-len tokens need, at most a "
                        "fifth of the memory available at start, at least one such sequence; on CUDA half the free "
                        "device memory. A request that cannot fit it even alone is refused")
    p.add_argument("--max-model-len", type=positive_int, default=None, metavar="TOKENS",
                   help="most tokens (prompt and answer) of one request; longer ones are refused (default: the "
                        "model's positions)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"most tokens in one forward: every decoding sequence's next token, then prompt "
                        f"chunks; {why} (default {budget_cpu} on CPU, {budget_cuda} on CUDA)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="most sequences in the engine at once; more wait (default %(default)s)")
    p.add_argument("--threads", type=non_negative_int, default=None, metavar="N",
                   help="CPU threads this service computes on (torch's intra-op threads); where services share "
                        "a host, give each its share of the cores (`kvserve up` does; docs/OPERATIONS.md, "
                        f"\"CPU threads\"). Default, or 0: on CPU every core this process may use "
                        f"({len(usable_cores())} here), on CUDA {CUDA_THREADS} (the GPU computes, the CPU only "
                        f"feeds it)")
    p.add_argument("--share-cores", default=None, metavar="DIR",
                   help="a folder shared with the other compute services of this host (`kvserve up` gives one): "
                        "this service computes on its --threads, and on theirs while they have nothing to compute "
                        "(docs/OPERATIONS.md, \"CPU threads\"; default: off, --threads alone)")
    p.add_argument("--nice", type=int, default=0, choices=range(20), metavar="0-19",
                   help="lower this service's CPU priority by this much at start (Unix nice), against other "
                        "work on the host that has no budget of its own (default 0)")
    p.add_argument("--engine-nice", type=int, default=0, choices=range(20), metavar="0-19",
                   help="run the engine's threads this much below the service's priority (Unix nice, Linux); the "
                        "threads that take calls run above it regardless (docs/OPERATIONS.md, \"CPU priority\"; "
                        "default %(default)s: the engine computes at the service's priority, as other work on the "
                        "host does)")
    p.set_defaults(token_budget_defaults=(budget_cpu, budget_cuda))


def add_admission_flags(p: argparse.ArgumentParser, *, seqs: int, tokens: int) -> None:
    """The bounds on waiting work (rpc.admission): past them a request is RESOURCE_EXHAUSTED at once."""
    p.add_argument("--max-waiting-seqs", type=positive_int, default=seqs, metavar="N",
                   help="most requests waiting for their prompt to be computed; one more is refused at once with "
                        "RESOURCE_EXHAUSTED and a retry hint (default %(default)s)")
    p.add_argument("--max-waiting-tokens", type=positive_int, default=tokens, metavar="N",
                   help="most prompt tokens waiting to be computed, as --max-waiting-seqs (default %(default)s)")


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer of at least 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


# On CUDA the forward runs on the GPU; the CPU threads only launch its kernels and run the step's Python and
# small host copies, so a process needs no OpenMP team (vLLM likewise cuts its GPU worker processes to one
# OpenMP thread unless OMP_NUM_THREADS says otherwise).
CUDA_THREADS = 1


def usable_cores() -> set[int]:
    """The cores this process may run on (its affinity mask; a container's cpuset)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


# The share of the memory available at start that a cache takes at most by default: each engine's KV pool
# (--kv-cache-memory, engine.kv_cache) and the store's host tier (--host-capacity). Each takes its memory as
# it fills.
MEMORY_SHARE = 0.2


def memory_cap() -> int | None:
    """MEMORY_SHARE of `available_memory()`; None where it cannot be read."""
    available = available_memory()
    return int(MEMORY_SHARE * available) if available else None


def available_memory(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process could still take: the kernel's MemAvailable, or less where the memory cgroup it runs in
    (a container's, cgroup v2) has a limit closer by; None where neither can be read."""
    found = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        rel = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.startswith("0::"))
        folder = cgroup / rel.strip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((folder / "memory.current").read_text()))
    except (OSError, ValueError, StopIteration):
        pass
    return max(0, min(found)) if found else None


def default_threads(device: str, cores: int) -> int:
    """The compute thread budget of a service given no --threads: on CPU all `cores` it may use (a process
    alone on its host, as before budgets), on CUDA `CUDA_THREADS`."""
    return CUDA_THREADS if str(device).startswith("cuda") else max(1, cores)


def engine_threads(args: argparse.Namespace) -> int:
    """--threads, or (not given, or 0) its default for --device and the cores this process may use."""
    if args.threads:
        return int(args.threads)
    return default_threads(args.device, len(usable_cores()))


def engine_token_budget(args: argparse.Namespace) -> int:
    """--max-num-batched-tokens, or its default for --device: a CPU's forward costs in proportion to its
    tokens from a few dozen on, a GPU's stays flat to hundreds."""
    if args.max_num_batched_tokens is not None:
        return int(args.max_num_batched_tokens)
    cpu, cuda = args.token_budget_defaults
    return int(cuda if str(args.device).startswith("cuda") else cpu)


def exit_with_parent() -> None:
    """Linux: when started by `kvserve up` (or any stack.stack launcher), which names itself in
    KVSERVE_PARENT_PID, get SIGTERM as soon as that process dies, so no orphan keeps its ports;
    exit at once if it is already gone. Does nothing for a service started any other way."""
    parent = os.environ.pop("KVSERVE_PARENT_PID", "")
    if not parent.isdigit() or sys.platform != "linux":
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        return
    if os.getppid() != int(parent):  # it died before the call
        sys.exit(f"the process that started this service ({parent}) has exited")


_GIL_SWITCH_INTERVAL_S = 0.0005
# glibc's mallopt parameters; 32 MiB is the ceiling of glibc's own adaptive threshold on 64-bit.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_HEAP_BUFFER_MAX = 32 << 20
# Entries in each of oneDNN's two caches of compiled kernels (ideep's, which torch's linear layers use, and
# oneDNN's own): see prepare_engine_process.
ONEDNN_CACHE_ENTRIES = 256


def prepare_engine_process(args: argparse.Namespace | int) -> None:
    """What a process that runs the engine sets before any thread starts (every thread inherits it),
    from its parsed flags (`args`; a bare int is the older form, --nice alone, which leaves torch's
    threads as torch sets them).

    - Its compute thread budget (--threads, `engine_threads`): torch's intra-op threads, the OpenMP
      team that runs each kernel on several cores, and one inter-op thread (the engine forks no
      torch tasks, so the inter-op pool only ever adds idle threads). Services that share a host's
      cores each take their share: two OpenMP teams sized to every core stall at each other's
      barriers (engine.engine's docstring). One line in the log says the budget.
    - Its CPU priority (--nice).
    - Python's GIL switch interval, 0.5 ms instead of 5. The step thread lets go of the GIL in each of
      a step's few hundred kernels; while another thread runs Python (I/O threads encoding a finished
      prompt's KV for the store), it waited up to the interval to get it back after each one, and one
      such save stalled every running stream for 300-500 ms.
    - glibc's malloc: tensor buffers up to 32 MiB come from the heap, and freed ones stay there for
      the next step. By default a buffer over 128 KiB gets a fresh mmap until glibc's adaptive
      threshold has seen that size freed, and each fresh mapping is faulted in page by page: over a
      decode service's first 16 streams, half a million page faults made each step 40 % slower.
      Other C libraries are left as they are.
    - oneDNN's kernel caches: at most ONEDNN_CACHE_ENTRIES each, instead of 1024 (LRU_CACHE_CAPACITY, and
      ONEDNN_PRIMITIVE_CACHE_CAPACITY or its older name DNNL_..., unless the environment sets them; a kernel
      lives while either cache holds it, so the larger cap decides the memory). A prepacked linear layer
      (engine.packed_linear) compiles a kernel for each row count it sees, about 0.4 MiB each; a step's
      row count varies with its batch, so the default caches filled to 420 MiB in every engine process,
      which a service's memory grew by, storm after storm, until they were full. At 256 they hold about
      105 MiB, the kernels of 64 recent row counts for each of a llama's four layer shapes; a row count
      past them costs about 0.5 ms per shape, once per step. Call this before the model loads: packing
      its weights is the process's first oneDNN kernel.
    """
    nice = args if isinstance(args, int) else int(args.nice)
    if not isinstance(args, int):
        set_thread_budget(engine_threads(args), source="--threads" if args.threads
                          else f"default for --device {args.device}")
    os.nice(nice)
    for names in (["LRU_CACHE_CAPACITY"], ["ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"]):
        if not any(os.environ.get(name) for name in names):  # oneDNN reads them at its first kernel; "" is unset
            os.environ[names[0]] = str(ONEDNN_CACHE_ENTRIES)
    sys.setswitchinterval(_GIL_SWITCH_INTERVAL_S)
    if sys.platform == "linux":
        try:
            libc = ctypes.CDLL(None)
            libc.mallopt(_M_MMAP_THRESHOLD, _HEAP_BUFFER_MAX)
            libc.mallopt(_M_TRIM_THRESHOLD, 2 * _HEAP_BUFFER_MAX)
        except (AttributeError, OSError):
            pass


def progress(text: str) -> None:
    """A `PROGRESS <text>` line on stdout, before `LISTENING`: `kvserve up` shows it while the service starts."""
    print(f"PROGRESS {text}", flush=True)


def warm_up(engine: Any, service: str) -> None:
    """Runs the engine's warm-up (engine.Engine.warm_up) before the service serves, saying what it took."""
    progress("warming up the engine")
    seconds = engine.warm_up()
    logging.getLogger(service).info("engine warmed up in %.2f s", seconds)
    progress(f"engine warmed up in {seconds:.1f} s")


def trim_heap() -> None:
    """Gives back to the kernel what the heap holds free (glibc's malloc_trim): once the model is loaded and its
    layers packed, the buffers of the loading (about 45 MB on SmolLM2) would otherwise stay resident."""
    if sys.platform == "linux":
        with contextlib.suppress(AttributeError, OSError):
            ctypes.CDLL(None).malloc_trim(0)


# How far above the service's priority the threads that take calls run where the process may (EnginePriority),
# and the slice they ask for: EEVDF's shortest, 0.1 ms (the default is 0.7 ms times 1 + log2 of the cores).
FRONT_RAISE = 10
FRONT_SLICE_NS = 100_000
_SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}.get(os.uname().machine) if hasattr(os, "uname") else None


class EnginePriority:
    """CPU priority inside an engine service (Linux, where nice is per thread; elsewhere nothing changes): the
    engine computes at the service's own priority (`--engine-nice` lowers it further), and the threads that take
    calls run above it, so that on cores the engine keeps busy a call is taken, or refused, at once.

    The front's threads (gRPC's completion-queue thread, which takes each new call, request and token sent, and
    the workers that admit, refuse and stream) are raised `front_raise` above the service where the process may
    (root, CAP_SYS_NICE, or an RLIMIT_NICE that allows it: compose's `ulimits: nice`), and everywhere get the
    scheduler's shortest slice (Linux 6.12 or later, no privilege needed), so that a thread woken by a call
    preempts a running step instead of waiting out its slice. The engine keeps the default slice and the
    service's priority: beside other work on the host it takes its fair share, as any process does.

    Create it on the main thread before any other thread starts (every thread inherits the raise); the engine's
    threads are its loop (`run`), the threads that start while `starting()` is open (torch's OpenMP workers,
    which loading the model starts), and those that these start later, which inherit their priority (more
    OpenMP workers, the KV I/O threads)."""

    def __init__(self, engine_nice: int, front_raise: int = FRONT_RAISE) -> None:
        self.enabled = sys.platform == "linux"
        self.base = os.getpriority(os.PRIO_PROCESS, 0) if self.enabled else 0
        self.engine = min(19, self.base + engine_nice)
        self.front = self.base
        self.short_slice = False
        if not self.enabled:
            return
        log = logging.getLogger("kvserve.rpc.cli")
        if front_raise:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, max(-20, self.base - front_raise))
                self.front = os.getpriority(os.PRIO_PROCESS, 0)
            except PermissionError:
                log.info("the threads that take calls keep the service's priority: raising them needs CAP_SYS_NICE "
                         "or RLIMIT_NICE (docs/OPERATIONS.md, \"CPU priority\")")
        self.short_slice = _set_slice(0, self.front, FRONT_SLICE_NS)
        log.info("CPU priority: the threads that take calls at nice %d%s, the engine's at nice %d", self.front,
                 f" with a {FRONT_SLICE_NS // 1000} us slice" if self.short_slice else "", self.engine)

    @property
    def changes(self) -> bool:
        return self.enabled and (self.front != self.engine or self.short_slice)

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Puts the threads started within at the engine's priority (nothing of the gRPC server's may start there)."""
        before = _thread_ids() if self.changes else set()
        try:
            yield
        finally:
            if self.changes:
                self._lower_started(before)

    def run(self, loop: Callable[[], None]) -> Callable[[], None]:
        """`loop` (the engine's step loop), run at the engine's priority on the thread that calls it."""

        def run() -> None:
            self._lower(threading.get_native_id())
            loop()

        return run

    def _lower_started(self, before: set[int]) -> None:
        log = logging.getLogger("kvserve.rpc.cli")
        if not before:  # a process has a thread: /proc is not there
            log.warning("/proc/self/task is not readable, so torch's threads run at the priority of the threads "
                        "that take calls; only the engine's loop is put at its own")
            return
        started = _thread_ids() - before
        for tid in started:
            self._lower(tid)
        log.info("the engine's loop and %d threads started as the model loaded run at nice %d", len(started),
                 self.engine)

    def _lower(self, tid: int) -> None:
        if not self.changes:
            return
        with contextlib.suppress(ProcessLookupError):  # the thread has ended
            if self.short_slice:
                _set_slice(tid, self.engine, 0)  # also sets its nice
            else:
                os.setpriority(os.PRIO_PROCESS, tid, self.engine)


def _set_slice(tid: int, nice: int, slice_ns: int) -> bool:
    """Thread `tid`'s (0: the caller's) nice and scheduler slice (`slice_ns`, 0: the default), by sched_setattr:
    False where the kernel or the platform has no such call (a custom slice for SCHED_OTHER came in Linux 6.12;
    before, the kernel takes the call and ignores the slice)."""
    if _SYS_SCHED_SETATTR is None:
        return False
    # struct sched_attr: size, policy (SCHED_OTHER), flags, nice, priority, runtime (the slice), deadline, period
    attr = ctypes.create_string_buffer(struct.pack("IIQiIQQQ", 48, 0, 0, nice, 0, slice_ns, 0, 0))
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(_SYS_SCHED_SETATTR, tid, attr, 0) == 0
    except (AttributeError, OSError):
        return False


def _thread_ids() -> set[int]:
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def set_thread_budget(threads: int, source: str = "--threads") -> None:
    """torch's intra-op threads to `threads` and its inter-op threads to 1, logged in one line. The
    inter-op count can be set once per process, before any inter-op work: a later call leaves it.

    rpc does not import torch (the store and the router run without it): this sets the threads of the
    torch the process has already loaded, as the engine services have by the time they call it."""
    torch: Any = sys.modules.get("torch")
    if torch is None:
        raise RuntimeError("set_thread_budget: torch is not loaded; import the engine first")
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # already set, or inter-op work has started
        torch.set_num_interop_threads(1)
    logging.getLogger("kvserve.rpc.cli").info(
        "compute threads: %d (%s; %d cores usable; torch intra-op %d, inter-op %d)", threads, source,
        len(usable_cores()), torch.get_num_threads(), torch.get_num_interop_threads())


def configure_logging(service: str, level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")


STOP_MARGIN_S = 10.0
# A full collection once this many generation-1 collections have passed, whatever the load (collect_when_quiet);
# Python's own threshold is 10.
FULL_COLLECTION_AFTER = 200


def collect_when_quiet(calls_arrived: Callable[[], int], *, every_s: float = 1.0,
                       at_most: int = FULL_COLLECTION_AFTER) -> threading.Thread | None:
    """Python's full collections, moved off the path of calls. Python runs one on whichever thread
    allocates, once ten generation-1 collections have passed and little lives long (after `gc.freeze` almost
    nothing does): under a storm of calls, about every half second. It holds the GIL while it scans every
    object the calls in flight hold (88-91 ms wall, 32 ms CPU, under 600 streams), and no call is taken or
    refused meanwhile.

    Here the collections of generations 0 and 1 stay as they are, and a thread of the service's priority
    runs the full one when Python would have (ten generation-1 collections since the last) but only after a
    check `every_s` finds that no call came (`calls_arrived()` unchanged; a stream already open, as a
    subscriber's, does not count), or once `at_most` have passed whatever the load: the bound on the garbage
    in cycles that waits (gRPC's calls leave some), about one full collection in ten seconds under a storm.

    For CPython's generational collector (3.11-3.13, with the GIL); elsewhere (3.14's incremental collector,
    a free-threaded build) this does nothing and returns None."""
    if sys.version_info >= (3, 14) or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0, gen1, 1 << 30)  # never from allocations

    def run() -> None:
        seen = calls_arrived()
        while True:
            time.sleep(every_s)
            try:
                arrived = calls_arrived()
                pending = gc.get_count()[2]  # generation-1 collections since the last full one
                if pending >= at_most or (pending >= gen2 and arrived == seen):
                    gc.collect()
                seen = arrived
            except Exception:  # never die and leave full collections off
                logging.getLogger("kvserve.rpc.cli").exception("the check for a full collection failed")

    thread = threading.Thread(target=run, name="full-collections", daemon=True)
    thread.start()
    return thread


def serve(
    server: Server,
    service: str,
    *,
    before_stop: Iterable[Callable[[], None]] = (),
    on_stop: Iterable[Callable[[], None]] = (),
    main_loop: Callable[[], None] | None = None,
    grace_s: float = 5.0,
    callbacks_s: float = 5.0,
) -> int:
    """Starts `server`, prints `LISTENING <port>` and serves until SIGTERM or SIGINT (exit code 0),
    running `main_loop` on this thread meanwhile if given (`kvserve.rpc.server.run_until_signal`).

    The stop takes at most `grace_s` for calls in flight, about `callbacks_s` for the callbacks, and
    STOP_MARGIN_S more; past that the process writes its threads' stacks to stderr and exits with code 1.

    A port that is taken or not valid is one line on stderr and exit code 2, after the `on_stop`
    callbacks have released what the service holds.
    """
    # What start-up built (the model, the tokenizer, the tables) stays as long as the process: out of the
    # collector's sight. A full collection scanned it all, and held the GIL 0.4-0.5 s at a time under 600
    # streams, which a health check waited out. (No gc.collect() first: it takes 0.25 s at every start, for
    # start-up garbage in cycles that would only be kept.) What is left to scan, the calls' own objects,
    # is scanned when calls are not arriving.
    gc.freeze()
    collect_when_quiet(lambda: server.limit.arrived)  # before main_loop lowers this thread: it keeps our priority
    try:
        port = server.start()
    except OSError as exc:
        print(f"{service}: {exc}", file=sys.stderr)
        for fn in on_stop:
            fn()
        return 2
    print(f"LISTENING {port}", flush=True)
    run_until_signal(server, before_stop=before_stop, on_stop=on_stop, grace_s=grace_s, main_loop=main_loop,
                     exit_within_s=grace_s + callbacks_s + STOP_MARGIN_S)
    return 0
