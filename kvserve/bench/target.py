"""The stack a benchmark measures: the three services as local processes on a temporary folder (ports 0,
Prometheus pages on free ports), or a running stack given by --addr; and its services' counters."""

from __future__ import annotations

import argparse
import contextlib
import re
import socket
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from client.metrics import parse_metrics
from kvserve.engine.fetch import DATA_DIR_DEFAULT, REAL_MODEL, models_dir, real_model_dir
from kvserve.stack.stack import Stack, StackConfig
from kvstore.record_key import write_new

MODEL_HELP = (f"model folder (default: DATA_DIR/models/{REAL_MODEL} where `kvserve model fetch {REAL_MODEL}` has "
              f"put it, else the tiny random-weight DATA_DIR/models/tiny-llama, built if missing; DATA_DIR: "
              f"{DATA_DIR_DEFAULT})")
DTYPES = ("auto", "float32", "bfloat16", "float16")  # the services' --dtype (rpc.cli)


def tiny_model_dir() -> Path:
    return models_dir() / "tiny-llama"


def ensure_model(model: Path | None) -> Path:
    """The model folder a benchmark runs: `model`, or by default the real model where it has been fetched, else
    the tiny llama (said on stderr); the tiny llama is built when it is the one and missing."""
    real, tiny = real_model_dir(), tiny_model_dir()
    if model is None:
        if (real / "config.json").exists():
            return real
        print(f"no {REAL_MODEL} in {real}: benchmarking the tiny random-weight {tiny} "
              f"(`kvserve model fetch {REAL_MODEL}` fetches the real one)", file=sys.stderr, flush=True)
        model = tiny
    if model == tiny and not (model / "config.json").exists():
        print(f"building the tiny model in {model} ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "kvserve.cli", "model", "init", str(model), "--arch", "llama"],
                       check=True)
    return model


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def add_device_flags(ap: argparse.ArgumentParser) -> None:
    """--device and --dtype: where the engines this benchmark starts run (services and in-process baselines)."""
    ap.add_argument("--device", default="cpu",
                    help="torch device of the services started here and of the in-process baseline, e.g. cuda "
                         "(default %(default)s)")
    ap.add_argument("--dtype", default="auto", choices=DTYPES,
                    help="their model's dtype; auto: the one its config names (default %(default)s)")
    ap.add_argument("--store-device-capacity", default="8GiB",
                    help="with a CUDA --device: the store's device arena on that GPU, where prefill leaves blocks "
                         "and decode takes them device to device (default %(default)s; 0: none)")


def device_flags(args: argparse.Namespace) -> list[str]:
    """The prefill and decode services' flags for `add_device_flags`' settings."""
    return ["--device", args.device, "--dtype", args.dtype]


def store_device_flags(args: argparse.Namespace) -> list[str]:
    """The store's flags for `add_device_flags`' settings: a device arena on the services' GPU."""
    if not args.device.startswith("cuda") or re.fullmatch(r"0+\s*[A-Za-z]*", args.store_device_capacity.strip()):
        return []
    return ["--device", "cuda", "--device-capacity", args.store_device_capacity]


def add_record_key_flag(ap: argparse.ArgumentParser) -> None:
    """--record-key on|off: the store started here with or without sealed records, to measure their cost."""
    ap.add_argument("--record-key", choices=["on", "off"], default=None,
                    help="the store started here: on, with a record key of its own (every record written to or read "
                         "from disk and Redis sealed: encrypted, under a MAC); off, without one (records in the clear, "
                         "bound to their keys by checksum only), as the benchmarks' plaintext stacks run by default")


def record_key_flags(args: argparse.Namespace, tmp: Path) -> list[str]:
    """The store's flags for --record-key (a new key file in tmp for on); none when the benchmark has no such flag."""
    if getattr(args, "record_key", None) == "on":
        return ["--record-key-file", str(write_new(tmp / "record-key"))]
    return []


@contextlib.contextmanager
def local_stack(model: Path, tmp: Path, name: str, log_dir: Path | None, prefill_args: Sequence[str] = (),
                decode_args: Sequence[str] = (), metrics_ports: Mapping[str, int] | None = None,
                engine_args: Sequence[str] = (), store_args: Sequence[str] = (), http: bool = False) -> Iterator[Stack]:
    """A stack whose data lives in tmp/name and whose logs go to log_dir/name (default tmp/name/logs);
    `metrics_ports` maps kvstore, prefill and decode to the port of their Prometheus page; `engine_args`
    go to prefill and decode both (before their own), `store_args` to the store; `http`: the HTTP API too."""
    ports = metrics_ports or {}

    def flags(service: str) -> list[str]:
        return ["--metrics-port", str(ports[service])] if service in ports else []

    config = StackConfig(model_dir=model, data_dir=tmp / name, decode_port=0, prefill_port=0, store_port=0,
                         extra_store_args=[*flags("kvstore"), *store_args],
                         extra_prefill_args=[*flags("prefill"), *engine_args, *prefill_args],
                         extra_decode_args=[*flags("decode"), *engine_args, *decode_args],
                         insecure=True,  # plaintext: the benchmarks measure the engine and the hand-off
                         http_port=0 if http else None)
    with Stack(config, log_dir=log_dir / name if log_dir else tmp / name / "logs") as s:
        yield s


@dataclass(frozen=True, slots=True)
class Target:
    """Where a benchmark sends its requests: the front door, the store (when known), the services'
    metrics pages (none when not known), and the model the services run."""

    addr: str
    store_addr: str | None
    metrics_urls: tuple[str, ...]
    model: Path
    block_size: int = 16


def add_target_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", type=Path, default=None, help=f"{MODEL_HELP}; with --addr, the stack's model")
    ap.add_argument("--addr", default=None,
                    help="a running stack's front door (default: start the three services on a temporary folder)")
    ap.add_argument("--kvstore", default=None, help="with --addr: that stack's store address")
    ap.add_argument("--metrics", action="append", default=[], metavar="URL",
                    help="with --addr: a service's metrics URL, e.g. http://127.0.0.1:9100/metrics (repeatable)")
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="keep the services' logs here (default: removed with the run)")


@contextlib.contextmanager
def open_target(args: argparse.Namespace, name: str, engine_args: Sequence[str] = (),
                store_args: Sequence[str] = (), decode_args: Sequence[str] = ()) -> Iterator[Target]:
    """args.addr as it is, or a local stack with its metrics pages (`engine_args` to prefill and decode,
    `store_args` to the store, then its --record-key flags, `decode_args` to decode), stopped on exit."""
    if args.addr:
        yield Target(args.addr, args.kvstore, tuple(args.metrics), args.model)
        return
    ports = {service: free_port() for service in ("kvstore", "prefill", "decode")}
    with tempfile.TemporaryDirectory(prefix=f"kvserve-bench-{name}-") as tmp, \
            local_stack(args.model, Path(tmp), name, args.log_dir, metrics_ports=ports, engine_args=engine_args,
                        store_args=[*store_args, *record_key_flags(args, Path(tmp))], decode_args=decode_args) as s:
        yield Target(s.addr, s.service("kvstore").addr,
                     tuple(f"http://127.0.0.1:{p}/metrics" for p in ports.values()), args.model,
                     s.config.block_size)


def scrape(urls: Sequence[str]) -> dict[str, float]:
    """Every sample of every page (the services' names keep them apart); {} without pages."""
    samples: dict[str, float] = {}
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as resp:
            samples.update(parse_metrics(resp.read().decode()))
    return samples


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """How much each sample grew between two scrapes (counters, histogram sums and counts)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def histogram_means(d: Mapping[str, float], prefixes: Sequence[str]) -> dict[str, dict[str, float]]:
    """{histogram: {count, mean_s}} of every `*_seconds` histogram of the services named by `prefixes`
    that observed something in the window `d` (a `delta`)."""
    out = {}
    for name, total in d.items():
        if name.endswith("_seconds_sum") and name.startswith(tuple(prefixes)):
            base = name.removesuffix("_sum")
            count = d.get(base + "_count", 0.0)
            if count > 0:
                out[base] = {"count": count, "mean_s": total / count}
    return out
