"""`kvserve bench step`: one engine step against the memory bandwidth that bounds it.

A decode step of a few rows reads every weight once: it cannot be faster than the weights' bytes (and the
rows' keys and values) over the machine's memory bandwidth. Measured here, in one process:

- the bandwidth, as STREAM's copy does it: `--bandwidth-mib` MiB copied from one array to another, bytes read
  plus bytes written over the best of 5 times (and a read alone, a sum, beside it);
- for each row count of `--rows` and context of `--contexts`: the engine's decode steps (the median of
  `--steps`, each row `ctx` tokens in), and what bounds them: (weight bytes + KV bytes the rows read) over
  the copy's bandwidth;
- where the step goes: the products of the weights (every linear layer and the LM head, replayed alone on
  inputs of that many rows), the attention (timed around engine.paged_attention.attend in the step), and
  the rest (norms, rotary, KV writes, sampling, the scheduler's Python).

Printed: a table, one line per (rows, context), with the step over the bound. The goal: a one-row step at
most 1.5x its bound (issue 58).

Then the engine alone on `kvserve bench serve --scenario fan-out`'s load (`--fan-out` requests, 0 skips it): that
many prompts added at once, each a shared prefix of `--fan-out-prefix` token ids that nothing has cached yet and
`--fan-out-own` of its own, `--fan-out-answer` greedy tokens each, in forwards of at most decode's token budget on
a CPU (256): output tokens over the time from adding them to the last token, the median of three, each under a
prefix of its own. Served, the same load also pays for the requests' way in and every token's way out on the same
cores; this is what the engine makes without them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvserve.bench.report import write_json
from kvserve.bench.target import MODEL_HELP, ensure_model
from kvserve.engine import llama, model_runner, paged_attention
from kvserve.engine.engine import Engine
from kvserve.engine.hashing import Namespace
from kvserve.engine.kv_cache import KVCache
from kvserve.engine.model import Model, load_model
from kvserve.engine.packed_linear import FusedPart, PackedLinear
from kvserve.engine.sampling import Sampler, SamplingParams
from kvserve.engine.scheduler import SchedulerConfig
from kvserve.engine.sequence import Sequence
from kvserve.host.process import prepare_engine_process

STEP_GOAL = 1.5  # a one-row step <= 1.5x its bound
DECODE_CPU_BUDGET = 256  # decode's --max-num-batched-tokens on a CPU (decode_service.__main__)
FAN_OUT_REPEATS = 3


def seconds(fn: Callable[[], object], repeats: int) -> list[float]:
    """The times of ``repeats`` calls of ``fn``, after one untimed."""
    fn()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return times


def bandwidth(mib: int) -> dict[str, float]:
    """GB/s of a copy (bytes read + written) and of a read (a sum), the best of 5 each."""
    src = torch.ones(mib << 18)  # float32: mib MiB
    dst = torch.empty_like(src)
    return {"copy_gb_per_s": 2 * src.nbytes / min(seconds(lambda: dst.copy_(src), 5)) / 1e9,
            "read_gb_per_s": src.nbytes / min(seconds(src.sum, 5)) / 1e9}


def weight_bytes(model: Any) -> int:
    """Bytes of the weights a step reads whole: every linear layer's (an LM head tied to the embedding once;
    the embedding's few rows a step reads are left out), packed (engine.packed_linear) or not."""
    seen: set[int] = set()
    total = 0
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, PackedLinear, FusedPart)):
            key = m.weight.data_ptr() if type(m) is torch.nn.Linear else id(m)
            if key not in seen:
                seen.add(key)
                total += m.in_features * m.out_features * m.weight.element_size()
    return total


@contextmanager
def timed_attention(spent: list[float]) -> Iterator[None]:
    """Adds each step's time in paged_attention.attend to spent[0], from either forward."""
    inner = llama.attend

    def attend(*args: Any, **kwargs: Any) -> torch.Tensor:
        began = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - began

    llama.attend = paged_attention.attend = attend  # (Hugging Face's path calls it from paged_attention)
    try:
        yield
    finally:
        llama.attend = paged_attention.attend = inner


def linear_ms(runner: model_runner.ModelRunner, rows: int) -> float | None:
    """The median time of every weight product of a step of ``rows`` rows, alone (the own forward's layers);
    None through Hugging Face's modules."""
    forward = runner.forward
    if forward is None:
        return None
    hidden = forward.embed.shape[1]
    x = torch.randn(rows, hidden, dtype=forward.embed.dtype)
    inner = torch.randn(rows, forward.intermediate, dtype=forward.embed.dtype)
    attn = torch.randn(rows, forward.heads * forward.head_dim, dtype=forward.embed.dtype)

    def once() -> None:
        for layer in forward.layers:
            layer.qkv(x)
            layer.o_proj(attn)
            layer.gate_up(x)
            layer.down(inner)
        forward.lm_head(x)

    with torch.inference_mode():
        return statistics.median(seconds(once, 7)) * 1e3


def decode_steps(engine: Engine, rows: int, context: int, steps: int) -> tuple[float, float]:
    """(median step ms, median attention ms) over ``steps`` decode steps of ``rows`` rows at ``context``."""
    vocab = engine.model.vocab_size
    seqs = [Sequence([(7 * i + 13 * r + 1) % vocab for i in range(context)],
                     Sampler(SamplingParams(), engine.model.device), steps + 2) for r in range(rows)]
    for seq in seqs:
        engine.add(seq)
    while not all(s.num_new_tokens >= 1 for s in seqs):  # the prompts, in whole forwards
        engine.step()
    step_ms, attn_ms = [], []
    spent = [0.0]
    with timed_attention(spent):
        for _ in range(steps):
            spent[0] = 0.0
            began = time.perf_counter()
            engine.step()
            step_ms.append((time.perf_counter() - began) * 1e3)
            attn_ms.append(spent[0] * 1e3)
    engine.run_until_done()
    return statistics.median(step_ms), statistics.median(attn_ms)


def kv_bytes(model: Model) -> int:
    """A token's keys and values, every layer's."""
    return KVCache.bytes_per_block(num_layers=model.num_layers, block_size=1, num_kv_heads=model.num_kv_heads,
                                   head_dim=model.head_dim, dtype=model.dtype)


def fan_out(engine: Engine, requests: int, prefix: int, own: int, answer: int, seed: int) -> float:
    """Seconds from adding ``requests`` prompts at once (``prefix`` token ids shared, none cached yet, then ``own``
    each) until each has ``answer`` tokens."""
    vocab = engine.model.vocab_size
    root = Namespace("bench-step", engine.model.kv_dtype_name, engine.block_size).root()
    shared = [(31 * i + 7 * seed + 1) % vocab for i in range(prefix)]
    seqs = [Sequence(shared + [(13 * i + 97 * r + 1009 * seed + 3) % vocab for i in range(own)],
                     Sampler(SamplingParams(), engine.model.device), answer, hash_root=root) for r in range(requests)]
    began = time.perf_counter()
    for seq in seqs:
        engine.add(seq)
    engine.run_until_done()
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvserve bench step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help=MODEL_HELP)
    ap.add_argument("--rows", default="1,4,16", help="decode rows per step (default %(default)s)")
    ap.add_argument("--contexts", default="40,2000", help="tokens each row has in context (default %(default)s)")
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed at each point (default %(default)s)")
    ap.add_argument("--bandwidth-mib", type=int, default=1024, help="the copy's size (default %(default)s)")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="the weights' and KV cache's (default: what the model's config names)")
    ap.add_argument("--fan-out", type=int, default=16, metavar="N",
                    help="requests at once in the engine-alone fan-out (default %(default)s; 0 skips it)")
    ap.add_argument("--fan-out-prefix", type=int, default=128, help="their shared prefix's tokens (default %(default)s)")
    ap.add_argument("--fan-out-own", type=int, default=52, help="each one's own prompt tokens (default %(default)s)")
    ap.add_argument("--fan-out-answer", type=int, default=32, help="tokens each generates (default %(default)s)")
    ap.add_argument("--json", metavar="PATH", default=None, help="write every figure as JSON to PATH (- prints it)")
    args = ap.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    prepare_engine_process(0)  # glibc's malloc as the services set it (else a step's larger buffers fault in anew)
    model = load_model(ensure_model(args.model), dtype=args.dtype)
    engine = Engine(model, kv_cache_memory=max(rows_list) * (max(contexts) + args.steps + 32) * kv_bytes(model) * 2,
                    config=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=max(rows_list)))
    engine.warm_up()
    bw = bandwidth(args.bandwidth_mib)
    weights = weight_bytes(model.hf_model)
    kv_per_token = kv_bytes(model)
    code = "own (engine.llama)" if engine.runner.forward is not None else "Hugging Face's modules"
    print(f"model {model.path.name} in {model.kv_dtype_name}: {weights / 1e6:.0f} MB of weights, "
          f"{kv_per_token} bytes of KV a token; "
          f"forward: {code}; {torch.get_num_threads()} threads", flush=True)
    print(f"memory bandwidth: copy {bw['copy_gb_per_s']:.1f} GB/s, read {bw['read_gb_per_s']:.1f} GB/s "
          f"(the bound below uses the copy's)", flush=True)
    print(f"{'rows':>4} {'context':>7} {'step ms':>8} {'bound ms':>8} {'x bound':>7} {'weights ms':>10} "
          f"{'attention ms':>12} {'rest ms':>7}")
    points = []
    for rows in rows_list:
        products = linear_ms(engine.runner, rows)
        for context in contexts:
            step, attention = decode_steps(engine, rows, context, args.steps)
            bound = (weights + rows * context * kv_per_token) / (bw["copy_gb_per_s"] * 1e9) * 1e3
            rest = step - attention - (products or 0.0)
            points.append({"rows": rows, "context": context, "step_ms": step, "bound_ms": bound,
                           "step_over_bound": step / bound, "weights_ms": products, "attention_ms": attention,
                           "rest_ms": rest})
            print(f"{rows:>4} {context:>7} {step:>8.1f} {bound:>8.1f} {step / bound:>7.2f} "
                  f"{'' if products is None else f'{products:.1f}':>10} {attention:>12.1f} {rest:>7.1f}", flush=True)
    one_row = [float(p["step_over_bound"] or 0.0) for p in points if p["rows"] == 1]
    if one_row:
        met = max(one_row) <= STEP_GOAL
        print(f"goal: one-row step <= {STEP_GOAL}x its bound: {'met' if met else 'NOT met'} "
              f"(x{', x'.join(f'{r:.2f}' for r in one_row)})")
    fan: dict[str, Any] | None = None
    if args.fan_out > 0:
        del engine  # its pool and packed weights go first
        kv_tokens = args.fan_out * (args.fan_out_prefix + args.fan_out_own + args.fan_out_answer + 32)
        engine = Engine(model, kv_cache_memory=kv_tokens * kv_bytes(model) * 2,
                        config=SchedulerConfig(max_num_batched_tokens=DECODE_CPU_BUDGET, max_num_seqs=args.fan_out))
        engine.warm_up()
        runs = [fan_out(engine, args.fan_out, args.fan_out_prefix, args.fan_out_own, args.fan_out_answer, seed)
                for seed in range(FAN_OUT_REPEATS)]
        tokens = args.fan_out * args.fan_out_answer
        fan = {"requests": args.fan_out, "prefix_tokens": args.fan_out_prefix, "own_tokens": args.fan_out_own,
               "answer_tokens": args.fan_out_answer, "budget": DECODE_CPU_BUDGET, "runs_s": runs,
               "tok_s": tokens / statistics.median(runs)}
        print(f"fan-out, the engine alone: {args.fan_out} prompts of {args.fan_out_prefix} shared + "
              f"{args.fan_out_own} own tokens, {args.fan_out_answer} tokens each: {fan['tok_s']:.1f} tok/s "
              f"(median of {', '.join(f'{r:.2f}' for r in runs)} s)")
    if args.json:
        write_json(args.json, {"model": str(model.path), "dtype": model.kv_dtype_name, "forward": code,
                               "threads": torch.get_num_threads(),
                               "weight_bytes": weights, "kv_bytes_per_token": kv_per_token, **bw, "points": points,
                               "fan_out": fan})
    return 0


if __name__ == "__main__":
    sys.exit(main())
