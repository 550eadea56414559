"""What every service's command line shares: the server flags, the model-service flags, logging,
size parsing, the start-up lines `kvserve up` reads, and serving until SIGTERM with one clear line when
the start fails. The process's own set-up is kvserve.host's."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

from kvserve.host.collector import collect_when_quiet
from kvserve.host.process import CUDA_THREADS, usable_cores
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


def flag_actions(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's `--flag` options but --help: those a variable can set."""
    return [a for a in p._actions
            if any(s.startswith("--") for s in a.option_strings) and not isinstance(a, argparse._HelpAction)]


def long_flag(action: argparse.Action) -> str:
    return next(s for s in action.option_strings if s.startswith("--"))


def flag_var(service: str, action: argparse.Action) -> str:
    """`KVSERVE_<SERVICE>_<FLAG>`: the variable that sets the flag of `action`."""
    return env_prefix(service) + long_flag(action)[2:].upper().replace("-", "_")


def env_args(p: argparse.ArgumentParser, service: str, environ: dict[str, str] | None = None) -> list[str]:
    """The command-line arguments the `KVSERVE_<SERVICE>_<FLAG>` variables of `environ` stand for."""
    environ = dict(os.environ) if environ is None else environ
    args: list[str] = []
    for action in flag_actions(p):
        flag, var = long_flag(action), flag_var(service, action)
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


def engine_token_budget(args: argparse.Namespace) -> int:
    """--max-num-batched-tokens, or its default for --device: a CPU's forward costs in proportion to its
    tokens from a few dozen on, a GPU's stays flat to hundreds."""
    if args.max_num_batched_tokens is not None:
        return int(args.max_num_batched_tokens)
    cpu, cuda = args.token_budget_defaults
    return int(cuda if str(args.device).startswith("cuda") else cpu)


def progress(text: str) -> None:
    """A `PROGRESS <text>` line on stdout, before `LISTENING`: `kvserve up` shows it while the service starts."""
    print(f"PROGRESS {text}", flush=True)


def warm_up(engine: Any, service: str) -> None:
    """Runs the engine's warm-up (engine.Engine.warm_up) before the service serves, saying what it took."""
    progress("warming up the engine")
    seconds = engine.warm_up()
    logging.getLogger(service).info("engine warmed up in %.2f s", seconds)
    progress(f"engine warmed up in {seconds:.1f} s")


def configure_logging(service: str, level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")


STOP_MARGIN_S = 10.0


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
