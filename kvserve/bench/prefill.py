"""``kvserve bench prefill``: a prompt prefilled cold, then again over its cached prefix blocks.

Both run through the serving engine (chunks under its token budget, as the services run them). The
blocks go through the wire codec into a dict keyed by prefix hash, as the KV store would hold them,
and come back from it into the engine's pool. The cold prefill's arithmetic rate is set against the machine's matmul rate measured in the
same run (how close the engine's compute is to what the hardware allows).

``python -m bench.prefill baselines`` measures the serving benchmarks' time-to-first-token
baselines (``kvserve bench multi-turn`` and ``handoff`` run it in a subprocess): see ``ttft_baselines``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections import abc
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.utils import logging as hf_logging

from kvserve.bench.target import MODEL_HELP, ensure_model
from kvserve.engine.engine import Engine
from kvserve.engine.hashing import Namespace, prefix_hashes
from kvserve.engine.kv_cache import KVCache
from kvserve.engine.model import DTYPES, Model, encode_prompt, load_model, synchronize
from kvserve.engine.sampling import Sampler, SamplingParams
from kvserve.engine.scheduler import SchedulerConfig
from kvserve.engine.sequence import Sequence
from kvserve.handoff.transfer import EncodedBlock, encoded_bytes, load_blocks, save_blocks
from protos.block_hash import BlockHash

SYSTEM_PROMPT = (
    "You are the on-call assistant for a fleet of inference servers. Answer briefly, cite the runbook "
    "section you used, and never restart a node without checking its KV-cache hit rate first. "
)


def build_prompt(chars: int) -> list[dict[str, str]]:
    """A chat whose long system prompt (a shared prefix) is ``chars`` characters."""
    system = (SYSTEM_PROMPT * (chars // len(SYSTEM_PROMPT) + 1))[:chars]
    return [{"role": "system", "content": system}, {"role": "user", "content": "Why is node 7 slow?"}]


def chat_prompt(model: Model, target_tokens: int) -> list[int]:
    """`build_prompt`'s chat rendered to at least ``target_tokens`` tokens of the model's tokenizer (a byte-level
    one has a token per character; a BPE one, fewer): its system prompt lengthened until it does."""
    chars = target_tokens
    while len(prompt := encode_prompt(model, messages=build_prompt(chars))) < target_tokens:
        chars += max(1, (target_tokens - len(prompt)) * chars // len(prompt))
    return prompt


def prefill_flops(model: Model, num_tokens: int) -> float:
    """Useful FLOPs of a cold causal prefill: the decoder's matmuls plus attention scores and sums."""
    # by module, not parameter: an engine's packed linear layers hold their weight as a plain tensor
    layer_params = sum(w.numel() for name, m in model.hf_model.named_modules()
                       if isinstance(w := getattr(m, "weight", None), torch.Tensor) and w.dim() == 2
                       and "embed" not in name and "lm_head" not in name and "wte" not in name and "wpe" not in name)
    num_heads = model.hf_model.config.num_attention_heads
    attention = 2 * model.num_layers * num_heads * model.head_dim * num_tokens * (num_tokens + 1)  # QK^T, PV
    return 2.0 * layer_params * num_tokens + attention


class DictStore:
    """Blocks by prefix hash in a dict: the KV store's part, without the process."""

    def __init__(self, namespace: Namespace, hashes: list[BlockHash]) -> None:
        self.namespace = namespace
        self.hashes = hashes
        self.blocks: dict[BlockHash, bytes] = {}

    def get(self, hashes: abc.Sequence[BlockHash]) -> list[bytes | None]:
        return [self.blocks.get(h) for h in hashes]

    def put(self, blocks: abc.Iterable[tuple[BlockHash, EncodedBlock]], ephemeral: bool = False) -> int:
        items = [(key, encoded_bytes(payload)) for key, payload in blocks]
        self.blocks.update(items)
        return len(items)

    def remove(self, hashes: abc.Sequence[BlockHash]) -> int:
        return sum(self.blocks.pop(h, None) is not None for h in hashes)

    def load(self, seq: Sequence, first_block: int, blocks: list[int], cache: KVCache) -> int:
        return load_blocks(self, self.hashes[first_block : seq.num_saved_blocks], self.namespace, cache, blocks).num_tokens

    def save(self, seq: Sequence, first_block: int, kv: abc.Sequence[torch.Tensor], num_tokens: int) -> None:
        save_blocks(self, self.hashes[first_block:], self.namespace, kv, num_tokens)


def prefill(engine: Engine, prompt: list[int], store: DictStore, num_cached_blocks: int) -> tuple[Sequence, float]:
    """One prompt through the engine, its leading ``num_cached_blocks`` from ``store``; (sequence, seconds)."""
    seq = Sequence(prompt, Sampler(SamplingParams()), max_new_tokens=1, source=store,
                   num_saved_blocks=num_cached_blocks, keep_logits=True)
    start = time.perf_counter()
    engine.add(seq)
    engine.run_until_done()
    return seq, time.perf_counter() - start


def matmul_flops_per_s(n: int = 2048, repeat: int = 5) -> float:
    """Best fp32 square-matmul rate of this machine, the roof for the prefill's arithmetic."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


# ---- time-to-first-token baselines of the serving benchmarks ------------------------------------


def first_token(hf_model: PreTrainedModel, input_ids: torch.Tensor, cache: dict[str, Any]) -> tuple[int, float]:
    """One forward of ``input_ids`` [1, tokens] over ``cache`` (keyword -> DynamicCache) and the greedy next
    token: (token, seconds)."""
    synchronize(hf_model.device)  # what was queued before (the cache's copy) is not timed
    start = time.perf_counter()
    logits = hf_model(input_ids, use_cache=True, logits_to_keep=1, **cache).logits
    token = int(logits[0, -1].argmax())  # waits for the forward
    return token, time.perf_counter() - start


class TurnBaseline:
    """One turn's prompt of ``cached`` + ``new`` random byte token ids, its first ``cached`` tokens computed
    once into a DynamicCache; each `once` measures over a copy of it."""

    def __init__(self, hf_model: PreTrainedModel, keyword: str, cached: int, new: int, seed: int = 0) -> None:
        self.hf_model, self.keyword, self.cached = hf_model, keyword, cached
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 256, (1, cached + new), generator=generator).to(hf_model.device)
        self.prefix = DynamicCache(config=hf_model.config)
        if cached:
            with torch.inference_mode():
                hf_model(self.ids[:, :cached], use_cache=True, **{keyword: self.prefix})

    def once(self, full: bool) -> dict[str, float]:
        """Seconds of ``full_s`` (when ``full``), ``reuse_s`` and ``decode_step_s`` (see ttft_baselines)."""
        model, keyword, times = self.hf_model, self.keyword, {}
        with torch.inference_mode():
            if full:
                times["full_s"] = first_token(model, self.ids, {keyword: DynamicCache(config=model.config)})[1]
            cache = {keyword: copy.deepcopy(self.prefix)}
            token, times["reuse_s"] = first_token(model, self.ids[:, self.cached :], cache)
            next_ids = torch.tensor([[token]], device=model.device)
            times["decode_step_s"] = first_token(model, next_ids, cache)[1]
        return times


def ttft_baselines(hf_model: PreTrainedModel, keyword: str, cached: int, new: int, repeats: int, full: bool,
                   untimed: int = 0, seed: int = 0) -> dict[str, Any]:
    """Time to first token of a prompt of ``cached`` + ``new`` random byte token ids, without a serving
    system, ``repeats`` times after ``untimed`` rounds:

    - ``full_s``: Hugging Face over the whole prompt in one forward and a fresh DynamicCache, what
      ``generate`` does before its first token (when ``full``);
    - ``reuse_s``: the same model in this process over a DynamicCache of the first ``cached`` tokens
      computed before (the limit of reuse: only the ``new`` tokens and the first token are computed);
    - ``decode_step_s``: the step after that, one token over the whole prompt's cache.
    """
    turn = TurnBaseline(hf_model, keyword, cached, new, seed)
    times: dict[str, list[float]] = {"full_s": [], "reuse_s": [], "decode_step_s": []}
    for _ in range(untimed + repeats):
        for name, value in turn.once(full).items():
            times[name].append(value)
    timed = {name: values[untimed:] for name, values in times.items()}
    return {"cached_tokens": cached, "new_tokens": new, **timed,
            **{name.removesuffix("_s") + "_median_s": statistics.median(v) if v else None for name, v in timed.items()}}


def parse_baseline_args(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """An in-process baseline's arguments, with --device and --dtype added; quiets transformers' progress bars."""
    ap.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default %(default)s)")
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                    help="the model's dtype; auto: its config's (default %(default)s)")
    args = ap.parse_args(argv)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    return args


def baselines_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefill baselines", description=ttft_baselines.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="local Hugging Face model folder")
    ap.add_argument("--turns", required=True, help="CACHED:NEW token counts, comma-separated, e.g. 0:1088,1120:64")
    ap.add_argument("--repeats", type=int, default=1, help="timed rounds of each turn (default %(default)s)")
    ap.add_argument("--untimed", type=int, default=0, help="untimed rounds before them (default %(default)s)")
    ap.add_argument("--no-full", dest="full", action="store_false", help="skip the whole-prompt forward")
    ap.add_argument("--serve", action="store_true",
                    help="one round of each turn for each line read from stdin, as a JSON line (serve_baselines)")
    args = parse_baseline_args(ap, argv)
    turns = [(int(cached), int(new)) for cached, new in (turn.split(":") for turn in args.turns.split(","))]
    model = load_model(args.model, args.device, args.dtype)
    hf_model, keyword = model.hf_model, model.cache_keyword
    ttft_baselines(hf_model, keyword, 32, 32, 1, full=True)  # warm-up: one-time start-up costs
    if args.serve:
        return serve_baselines([TurnBaseline(hf_model, keyword, cached, new, seed=i)
                                for i, (cached, new) in enumerate(turns)], args.full, args.untimed)
    runs = [ttft_baselines(hf_model, keyword, cached, new, args.repeats, args.full, args.untimed, seed=i)
            for i, (cached, new) in enumerate(turns)]
    print(json.dumps({"torch_threads": torch.get_num_threads(), "turns": runs}))
    return 0


def serve_baselines(turns: list[TurnBaseline], full: bool, untimed: int) -> int:
    """--serve: after ``untimed`` rounds of each turn, one JSON line on stdout for each line read from stdin,
    `{"torch_threads": n, "turns": [times of one round of each turn]}`, until stdin closes. A benchmark
    measures between its own requests this way, so that both see the machine in the same minute."""
    for turn in turns:
        for _ in range(untimed):
            turn.once(full)
    print(json.dumps({"ready": True}), flush=True)
    for _ in sys.stdin:
        print(json.dumps({"torch_threads": torch.get_num_threads(), "turns": [t.once(full) for t in turns]}),
              flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["baselines"]:
        return baselines_main(argv[1:])
    parser = argparse.ArgumentParser(prog="kvserve bench prefill", description=__doc__)
    parser.add_argument("--model", type=Path, default=None, help=MODEL_HELP)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig().max_num_batched_tokens,
                        help="the engine's token budget per forward, as the services' flag (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    args.model = ensure_model(args.model)
    hf_logging.disable_progress_bar()

    engine = Engine(load_model(args.model), block_size=args.block_size,
                    config=SchedulerConfig(args.max_num_batched_tokens, max_num_seqs=1))
    model, namespace = engine.model, engine.namespace()
    prompt = chat_prompt(model, args.prompt_tokens)
    store = DictStore(namespace, prefix_hashes(prompt, engine.block_size, namespace.root()))

    prefill(engine, prompt[:64], DictStore(namespace, []), 0)  # warm-up: one-time start-up costs
    cold, cold_s = prefill(engine, prompt, store, 0)
    warm, warm_s = prefill(engine, prompt, store, (len(prompt) - 1) // engine.block_size)  # never the last token
    assert cold.logits is not None and warm.logits is not None
    num_cached = warm.stats.num_loaded_tokens

    cold_flops_per_s = prefill_flops(model, len(prompt)) / cold_s
    peak_flops_per_s = matmul_flops_per_s()
    report = {
        "prompt_tokens": len(prompt),
        "cold_gflops_per_s": cold_flops_per_s / 1e9,
        "matmul_gflops_per_s": peak_flops_per_s / 1e9,
        "cold_vs_matmul": cold_flops_per_s / peak_flops_per_s,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "cold": {"cached_tokens": cold.stats.num_loaded_tokens, "computed_tokens": len(prompt) - cold.stats.num_loaded_tokens,
                 "s": cold_s},
        "warm": {"cached_tokens": num_cached, "computed_tokens": len(prompt) - num_cached, "s": warm_s},
        "speedup": cold_s / warm_s,
        "max_logit_diff": float(torch.max(torch.abs(cold.logits - warm.logits))),
        "same_next_token": int(cold.logits.argmax()) == int(warm.logits.argmax()),
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"model {args.model} ({model.num_layers} layers, fingerprint {model.fingerprint[:12]}), "
          f"block size {engine.block_size}, prompt {len(prompt)} tokens, "
          f"chunks of at most {args.max_num_batched_tokens} tokens")  # fmt: skip
    for name in ("cold", "warm"):
        r = report[name]
        assert isinstance(r, dict)
        print(f"  {name}: {r['cached_tokens']:5d} cached + {r['computed_tokens']:5d} computed tokens "
              f"in {r['s'] * 1000:8.1f} ms")  # fmt: skip
    print(f"  speed-up x{report['speedup']:.1f}; max |logit diff| {report['max_logit_diff']:.2e}; "
          f"same next token: {report['same_next_token']}")  # fmt: skip
    print(f"  cold prefill {report['cold_gflops_per_s']:.1f} GFLOP/s; fp32 matmul on this machine "
          f"{report['matmul_gflops_per_s']:.1f} GFLOP/s (x{report['cold_vs_matmul']:.2f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
