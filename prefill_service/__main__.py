"""`python -m prefill_service --model DIR --kvstore ADDR [--listen HOST:PORT] [--metrics-port N]`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvserve.engine.engine import Engine
from kvserve.engine.model import load_model
from kvserve.engine.scheduler import SchedulerConfig
from kvserve.host.cores import service_share
from kvserve.host.memory import memory_cap
from kvserve.host.priority import EnginePriority
from kvserve.host.process import engine_threads, exit_with_parent, prepare_engine_process, trim_heap
from kvserve.rpc.admission import Admission
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
from prefill_service.metrics import PrefillMetrics
from prefill_service.server import add_to_server
from prefill_service.service import (
    DEFAULT_LEASE_TTL_S,
    DEFAULT_MAX_WAITING_SEQS,
    DEFAULT_MAX_WAITING_TOKENS,
    PrefillService,
)

# After a burst, the engine gives back its pool's pages and the heap's free memory once idle this long
# (engine.Engine's release_after_idle_s): the store keeps the prompts' KV, and the next burst takes pages again.
RELEASE_AFTER_IDLE_S = 2.0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(epilog=env_epilog("prefill"),
        prog="kvserve prefill",
        description="The prefill service: computes the prompt KV the store lacks and leaves it there for decode.",
    )
    add_model_flags(ap, model_help="local Hugging Face model folder")
    add_server_flags(ap, listen="127.0.0.1:50052", max_workers=128)
    add_admission_flags(ap, seqs=DEFAULT_MAX_WAITING_SEQS, tokens=DEFAULT_MAX_WAITING_TOKENS)
    add_engine_flags(ap, budget_cpu=2048, budget_cuda=8192,
                     why="prefill runs only prompts, so a large budget computes them fastest")
    ap.add_argument("--lease-ttl-s", type=float, default=DEFAULT_LEASE_TTL_S,
                    help="how long the prompt's blocks stay pinned for decode (default %(default)s)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    exit_with_parent()
    args = parse_args(parser(), argv, "prefill")
    configure_logging("prefill", args.log_level)
    tls = tls_from_args(args, "prefill")
    prepare_engine_process(args)
    priority = EnginePriority(args.engine_nice)
    try:
        with priority.starting():  # before the server, whose threads keep their priority
            progress("loading the model")
            model = load_model(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len)
            cores = service_share(args.share_cores, "prefill", engine_threads(args), args.device)
            engine = Engine(model, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                            config=SchedulerConfig(engine_token_budget(args), args.max_num_seqs), cores=cores,
                            keep_cached=0, kv_cache_cap=memory_cap(),
                            head_copy=False,  # one sampled row per prompt: not worth the table's bytes
                            release_after_idle_s=RELEASE_AFTER_IDLE_S, on_release=trim_heap)
            warm_up(engine, "prefill")
        trim_heap()
        server = Server(args.listen, max_workers=args.max_workers, metrics_port=args.metrics_port,
                        health_listen=args.health_listen, tls=tls,
                        name="prefill")
        metrics = PrefillMetrics(server.registry)
    except (OSError, ValueError) as exc:  # missing folder, refused model (UnsupportedModelError), bad sizes
        print(f"prefill: cannot serve {args.model}: {exc}", file=sys.stderr)
        return 2
    store = KVStoreClient(args.kvstore, timeout_s=args.store_timeout_s, tls=tls)
    service = PrefillService(engine, store, metrics, lease_ttl_s=args.lease_ttl_s,
                             admission=Admission("prefill", args.max_waiting_seqs, args.max_waiting_tokens))
    add_to_server(server, service)
    # The engine steps on this thread, the one that loaded the model (engine.engine's docstring says why).
    return serve(server, "prefill", before_stop=[service.stop], on_stop=[store.close],
                 main_loop=priority.run(engine.run))


if __name__ == "__main__":
    sys.exit(main())
