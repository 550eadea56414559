"""`python -m decode_service --model DIR --kvstore ADDR --prefill ADDR [--listen HOST:PORT] [--metrics-port N]`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from decode_service.metrics import DecodeMetrics
from decode_service.replica import LOAD_METHOD, DecodeReplicaServicer, PoolEvents
from decode_service.replica import SERVICE_NAME as REPLICA_SERVICE_NAME
from decode_service.server import DecodeServicer, add_to_server
from decode_service.service import (
    DEFAULT_LOCAL_PREFILL_TOKENS,
    DEFAULT_MAX_WAITING_SEQS,
    DEFAULT_MAX_WAITING_TOKENS,
    DecodeService,
)
from kvserve.engine.engine import Engine
from kvserve.engine.model import load_model
from kvserve.engine.scheduler import SchedulerConfig
from kvserve.host.cores import service_share
from kvserve.host.memory import memory_cap
from kvserve.host.priority import EnginePriority
from kvserve.host.process import engine_threads, exit_with_parent, prepare_engine_process, trim_heap
from kvserve.rpc.admission import Admission
from kvserve.rpc.auth import AuthConfigError, add_auth_flags, auth_from_args
from kvserve.rpc.cli import (
    add_admission_flags,
    add_engine_flags,
    add_model_flags,
    add_server_flags,
    configure_logging,
    engine_token_budget,
    env_epilog,
    parse_args,
    progress,
    serve,
    tls_from_args,
    warm_up,
)
from kvserve.rpc.server import Server
from kvstore import KVStoreClient
from prefill_service.client import PrefillReplicas
from protos.kvserve.v1 import decode_pb2_grpc


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(epilog=env_epilog("decode"),
        prog="kvserve decode",
        description="The decode service, kvserve's front door: streams generated tokens for a prompt.",
    )
    add_model_flags(ap, model_help="local Hugging Face model folder (the one prefill serves)")
    ap.add_argument("--prefill", default="127.0.0.1:50052",
                    help="prefill service address, or several separated by commas (replicas sharing this "
                         "service's store): each request goes to the one with the fewest requests in flight "
                         "from here, one that is unavailable is skipped for 2 s and the request asked "
                         "elsewhere (default %(default)s)")
    add_server_flags(ap, listen="127.0.0.1:50051", max_workers=256)
    add_admission_flags(ap, seqs=DEFAULT_MAX_WAITING_SEQS, tokens=DEFAULT_MAX_WAITING_TOKENS)
    add_engine_flags(ap, budget_cpu=256, budget_cuda=512,
                     why="smaller keeps the running streams' inter-token latency flat while a prompt is recomputed here, larger recomputes it sooner")
    ap.add_argument("--long-prompt-chunk", type=int, default=None, metavar="N",
                    help="while streams run, a prompt this service computes that needs more than one step "
                         "(--max-num-batched-tokens) gets at most N tokens a step, its last chunk too, so the streams' "
                         "steps stay short; a chat turn that fits one step is not held back. 0: no cap (default 64 on CPU, "
                         "0 on CUDA, whose steps cost about the same up to hundreds of tokens)")
    ap.add_argument("--local-prefill-tokens", type=int, default=DEFAULT_LOCAL_PREFILL_TOKENS, metavar="N",
                    help="compute a prompt here, in this service's batched step, when the part of it that neither "
                         "this service's KV pool nor the store holds is at most N tokens (a chat's next turn), "
                         "instead of handing it to prefill; 0 sends every prompt to prefill (default %(default)s)")
    ap.add_argument("--prefill-timeout-s", type=float, default=None,
                    help="a cap on the Prefill call's deadline, past which decode computes the prompt itself "
                         "(default: none, the call has the caller's deadline)")
    add_auth_flags(ap)
    return ap


# A 2,000-token prompt computed here among 16 streams raised their ITL p99 3-5x in decode's CPU steps of 256,
# 1.6-2.2x capped at 64 a step to its last chunk (BENCHMARKS.md, "Decode throughput and chunked prefill").
DEFAULT_LONG_PROMPT_CHUNK_CPU = 64


def long_prompt_chunk(args: argparse.Namespace) -> int:
    """--long-prompt-chunk, or its default for --device (CPU 64, CUDA 0: no cap)."""
    if args.long_prompt_chunk is not None:
        if args.long_prompt_chunk < 0:
            raise ValueError(f"--long-prompt-chunk must be >= 0, got {args.long_prompt_chunk}")
        return int(args.long_prompt_chunk)
    return 0 if str(args.device).startswith("cuda") else DEFAULT_LONG_PROMPT_CHUNK_CPU


def main(argv: Sequence[str] | None = None) -> int:
    exit_with_parent()
    args = parse_args(parser(), argv, "decode")
    configure_logging("decode", args.log_level)
    tls = tls_from_args(args, "decode")
    prepare_engine_process(args)
    try:
        auth = auth_from_args(args, "decode")
    except AuthConfigError as exc:
        print(f"decode: {exc}", file=sys.stderr)
        return 2
    if auth is not None:
        auth.reload_on_sighup()  # on the main thread, before a SIGHUP could end the process
        if tls is None:
            logging.getLogger("decode").warning(
                "auth is on over plaintext: bearer tokens cross the network readable by anyone on the path; "
                "serve TLS with --tls-cert/--tls-key (`kvserve certs` makes them) unless this port is loopback only")
    priority = EnginePriority(args.engine_nice)
    try:
        if args.local_prefill_tokens < 0:
            raise ValueError(f"--local-prefill-tokens must be >= 0, got {args.local_prefill_tokens}")
        pool_events = PoolEvents()
        with priority.starting():  # before the server, whose threads keep their priority
            progress("loading the model")
            model = load_model(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len)
            cores = service_share(args.share_cores, "decode", engine_threads(args), args.device)
            engine = Engine(model, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                            config=SchedulerConfig(engine_token_budget(args), args.max_num_seqs,
                                                   long_prompt_chunk(args)),
                            on_pool_change=pool_events.changed, cores=cores, keep_cached=0, kv_cache_cap=memory_cap())
            warm_up(engine, "decode")
        trim_heap()
        server = Server(args.listen, max_workers=args.max_workers, metrics_port=args.metrics_port,
                        health_listen=args.health_listen,
                        interceptors=auth.interceptors() if auth else (),
                        tls=tls, require_client_cert=False,  # the front door: tenants show tokens, not certificates
                        exempt=[LOAD_METHOD], name="decode")  # a router's poll answers however busy decode is
        metrics = DecodeMetrics(server.registry)
    except (OSError, ValueError) as exc:  # missing folder, refused model (UnsupportedModelError), bad sizes
        print(f"decode: cannot serve {args.model}: {exc}", file=sys.stderr)
        return 2
    try:
        prefill = PrefillReplicas.connect(args.prefill, timeout_s=args.prefill_timeout_s, tls=tls)
    except ValueError as exc:
        print(f"decode: --prefill: {exc}", file=sys.stderr)
        return 2
    store = KVStoreClient(args.kvstore, timeout_s=args.store_timeout_s, tls=tls)
    service = DecodeService(engine, store, prefill, metrics, args.local_prefill_tokens,
                            Admission("decode", args.max_waiting_seqs, args.max_waiting_tokens))
    front = DecodeServicer(service, tenant_salts=auth.salts if auth else None)
    add_to_server(server, front)
    server.add(decode_pb2_grpc.add_DecodeReplicaServicer_to_server,
               DecodeReplicaServicer(front, engine, store, metrics, pool_events), REPLICA_SERVICE_NAME, internal=True)
    # The engine steps on this thread, the one that loaded the model (engine.engine's docstring says why).
    return serve(server, "decode", before_stop=[service.stop], on_stop=[store.close],
                 main_loop=priority.run(engine.run))


if __name__ == "__main__":
    sys.exit(main())
