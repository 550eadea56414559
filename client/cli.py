"""The `kvserve` command line. Imports no torch: model and server commands load their packages lazily."""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from client.client import DEFAULT_ADDR, Client, KVServeError, Result
from client.stack import Stack, StackConfig, StackError

DEFAULT_DATA_DIR = Path("data")
DEFAULT_MODEL_DIR = DEFAULT_DATA_DIR / "models" / "tiny-llama"

# Commands whose arguments belong to another package's own parser.
FORWARDED = {
    ("model", "init"): "engine.tiny",
    ("bench", "hash"): "engine.bench",
    ("bench", "prefill"): "engine.prefill_bench",
    ("bench", "store"): "kvstore.bench",
    ("bench", "e2e"): "client.bench",
    ("kvstore",): "kvstore.__main__",
    ("prefill",): "prefill_service.__main__",
    ("decode",): "decode_service.__main__",
}


def _forward(argv: Sequence[str]) -> int | None:
    for key, module in FORWARDED.items():
        if tuple(argv[: len(key)]) == key:
            return int(importlib.import_module(module).main(list(argv[len(key):])) or 0)
    return None


def _request_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--addr", default=DEFAULT_ADDR, help="decode service address (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 is off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 is off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="skip the KV cache (for A/B comparisons)")
    p.add_argument("--cache-salt", default=None, help="requests with other salts never share KV")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos, prefix_cache=args.prefix_cache,
        cache_salt=args.cache_salt,
    )


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvserve",
        description="Disaggregated prefill/decode LLM serving with a tiered, prefix-keyed KV store.",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model = sub.add_parser("model", help="model tools: `kvserve model init DIR --arch llama|qwen2|gpt2`")
    model.add_argument("action", choices=["init"])
    sub.add_parser("kvstore", help="run the KV store service (see `kvserve kvstore --help`)")
    sub.add_parser("prefill", help="run the prefill service (see `kvserve prefill --help`)")
    sub.add_parser("decode", help="run the decode service, the front door (see `kvserve decode --help`)")
    bench = sub.add_parser("bench", help="benchmarks: hash, prefill, store, e2e (see `kvserve bench NAME --help`)")
    bench.add_argument("name", choices=["hash", "prefill", "store", "e2e"])

    up = sub.add_parser("up", help="start the store, prefill and decode services locally")
    up.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    up.add_argument("--model", type=Path, default=None,
                    help="model folder (default: the tiny llama under DATA_DIR, built if missing)")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--decode-port", type=int, default=50051)
    up.add_argument("--prefill-port", type=int, default=50052)
    up.add_argument("--store-port", type=int, default=50053)
    up.add_argument("--metrics-base-port", type=int, default=None,
                    help="Prometheus ports: decode BASE, prefill BASE+1, store BASE+2")
    up.add_argument("--host-capacity", default="1GiB")
    up.add_argument("--disk-capacity", default="8GiB")
    up.add_argument("--block-size", type=int, default=16)

    gen = sub.add_parser("generate", help="generate from a prompt, chat messages or token ids")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("prompt", nargs="?", help="prompt text")
    src.add_argument("--token-ids", help="comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--messages-file", type=Path, help='JSON file: [{"role": ..., "content": ...}, ...]')
    gen.add_argument("--json", action="store_true", help="print the result object as JSON")
    _request_options(gen)

    chat = sub.add_parser("chat", help="interactive multi-turn chat; shows cached tokens and TTFT per turn")
    chat.add_argument("--system", default=None, help="system prompt")
    _request_options(chat)

    stats = sub.add_parser("stats", help="KV store and service figures")
    stats.add_argument("--kvstore", default="127.0.0.1:50053", help="store address (default %(default)s)")
    stats.add_argument("--metrics", action="append", default=[],
                       help="a service's metrics URL, e.g. http://127.0.0.1:9100/metrics (repeatable)")
    stats.add_argument("--json", action="store_true")
    return ap


def cmd_up(args: argparse.Namespace) -> int:
    model_dir = args.model or args.data_dir / "models" / "tiny-llama"
    if args.model is None and not (model_dir / "config.json").exists():
        print(f"building the tiny model in {model_dir} ...", flush=True)
        subprocess.run([sys.executable, "-m", "client.cli", "model", "init", str(model_dir)], check=True)
    config = StackConfig(
        model_dir=model_dir, data_dir=args.data_dir, host=args.host, decode_port=args.decode_port,
        prefill_port=args.prefill_port, store_port=args.store_port,
        metrics_base_port=args.metrics_base_port, host_capacity=args.host_capacity,
        disk_capacity=args.disk_capacity, block_size=args.block_size,
    )
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    stack = Stack(config, log_dir=args.data_dir / "logs")
    try:
        stack.start()
    except StackError as exc:
        print(f"kvserve up: {exc}", file=sys.stderr)
        return 1
    try:
        for s in stack.services:
            print(f"{s.name:8s} {s.addr}  (log: {s.log_path})")
        print(f"ready: front door at {stack.addr}  (Ctrl-C to stop)", flush=True)
        while not stopped.wait(1.0):
            dead = [s.name for s in stack.services if s.process.poll() is not None]
            if dead:
                print(f"kvserve up: {', '.join(dead)} exited; stopping", file=sys.stderr)
                return 1
    finally:
        stack.stop()
        print("stopped", flush=True)
    return 0


def _print_result_line(r: Result) -> None:
    u, t = r.usage, r.timings
    print(f"[{r.finish_reason}; prompt {u.prompt_tokens} tokens, cached {u.cached_tokens}, "
          f"generated {u.completion_tokens}; ttft {t.ttft_s * 1000:.0f} ms, total {t.total_s * 1000:.0f} ms]",
          file=sys.stderr)


def _stream_to_stdout(client: Client, **request: Any) -> Result:
    result: Result | None = None
    for item in client.stream(**request):
        if isinstance(item, Result):
            result = item
        else:
            sys.stdout.write(item.text)
            sys.stdout.flush()
    print()
    assert result is not None
    return result


def cmd_generate(args: argparse.Namespace) -> int:
    request: dict[str, Any] = _options(args)
    if args.token_ids is not None:
        try:
            request["token_ids"] = [int(t) for t in args.token_ids.split(",") if t.strip()]
        except ValueError:
            raise SystemExit(f"kvserve generate: --token-ids must be comma-separated integers, got {args.token_ids!r}") from None
    elif args.messages_file is not None:
        request["messages"] = json.loads(args.messages_file.read_text())
    else:
        request["prompt"] = args.prompt
    with Client(args.addr, timeout_s=args.timeout) as client:
        if args.json:
            print(json.dumps(client.generate(**request).to_dict(), indent=2))
        else:
            _print_result_line(_stream_to_stdout(client, **request))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    with Client(args.addr, timeout_s=args.timeout) as client:
        print("kvserve chat: type a message, an empty line or Ctrl-D to quit", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            result = _stream_to_stdout(client, messages=messages, **_options(args))
            _print_result_line(result)
            messages.append({"role": "assistant", "content": result.text})
    return 0


def _scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {sample name with labels: value}, comments dropped."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def cmd_stats(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from protos.kvserve.v1 import kvstore_pb2, kvstore_pb2_grpc

    with grpc.insecure_channel(args.kvstore) as channel:
        reply = kvstore_pb2_grpc.KVStoreStub(channel).Stats(kvstore_pb2.StatsRequest(), timeout=5.0)
    report: dict[str, Any] = {"kvstore": MessageToDict(reply, preserving_proto_field_name=True,
                                                       always_print_fields_with_no_presence=True)}
    report["services"] = {url: _scrape(url) for url in args.metrics}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"KV store {args.kvstore}: leases {reply.leases}, pinned blocks {reply.pinned_blocks}, "
          f"checksum failures {reply.checksum_failures}")
    print(f"{'tier':8s} {'blocks':>8s} {'bytes':>14s} {'capacity':>14s} {'hits':>8s} {'misses':>8s} "
          f"{'evicted':>8s} {'demoted':>8s} {'promoted':>8s}")
    for t in reply.tiers:
        name = kvstore_pb2.Tier.Name(t.tier).removeprefix("TIER_").lower()
        print(f"{name:8s} {t.blocks:8d} {t.bytes:14d} {t.capacity_bytes:14d} {t.hits:8d} {t.misses:8d} "
              f"{t.evictions:8d} {t.demotions:8d} {t.promotions:8d}")
    for url, samples in report["services"].items():
        print(f"\n{url}")
        for name, value in samples.items():
            if name.startswith("kvserve_") and not name.endswith(("_bucket", "_created")):
                print(f"  {name} {value:g}")
    return 0


COMMANDS = {"up": cmd_up, "generate": cmd_generate, "chat": cmd_chat, "stats": cmd_stats}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    forwarded = _forward(argv)
    if forwarded is not None:
        return forwarded
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except KVServeError as exc:
        print(f"kvserve {args.command}: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"kvserve {args.command}: {exc.code().name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 2


if __name__ == "__main__":
    sys.exit(main())
