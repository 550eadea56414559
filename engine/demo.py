"""In-process demo of prefix reuse: a prompt prefilled cold, then again over its cached prefix blocks.

The blocks go through the wire codec and a dict keyed by prefix hash, as the KV store would hold them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from engine.engine import Engine
from engine.hashing import prefix_hashes
from engine.kv_codec import decode_block, encode_block
from engine.model import encode_prompt, load_model

SYSTEM_PROMPT = (
    "You are the on-call assistant for a fleet of inference servers. Answer briefly, cite the runbook "
    "section you used, and never restart a node without checking its KV-cache hit rate first. "
)


def build_prompt(target_tokens: int) -> list[dict[str, str]]:
    """A chat whose long system prompt (a shared prefix) renders to about ``target_tokens`` byte tokens."""
    system = (SYSTEM_PROMPT * (target_tokens // len(SYSTEM_PROMPT) + 1))[:target_tokens]
    return [{"role": "system", "content": system}, {"role": "user", "content": "Why is node 7 slow?"}]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.demo", description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="local Hugging Face model folder")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    hf_logging.disable_progress_bar()

    engine = Engine(load_model(args.model), block_size=args.block_size)
    model, namespace = engine.model, engine.namespace()
    prompt = encode_prompt(model, messages=build_prompt(args.prompt_tokens))
    hashes = prefix_hashes(prompt, engine.block_size, namespace.root())

    engine.prefill(prompt[:64])  # warm-up, so one-time start-up costs are not billed to the cold prefill
    start = time.perf_counter()
    cold = engine.prefill(prompt)
    cold_s = time.perf_counter() - start
    store = {h: encode_block(block, namespace) for h, block in zip(hashes, cold.new_blocks, strict=True)}

    start = time.perf_counter()
    reusable = hashes[: (len(prompt) - 1) // engine.block_size]  # the last token is always computed
    shape = {"num_layers": model.num_layers, "num_kv_heads": model.num_kv_heads, "head_dim": model.head_dim}
    cached = [
        decode_block(store[h], namespace, **shape, dtype=model.dtype, num_tokens=engine.block_size) for h in reusable
    ]
    warm = engine.prefill(prompt, cached)
    warm_s = time.perf_counter() - start

    report = {
        "prompt_tokens": len(prompt),
        "cold": {"cached_tokens": cold.num_cached_tokens, "computed_tokens": cold.num_computed_tokens, "s": cold_s},
        "warm": {"cached_tokens": warm.num_cached_tokens, "computed_tokens": warm.num_computed_tokens, "s": warm_s},
        "speedup": cold_s / warm_s,
        "max_logit_diff": float(torch.max(torch.abs(cold.logits - warm.logits))),
        "same_next_token": int(cold.logits.argmax()) == int(warm.logits.argmax()),
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"model {args.model} ({model.num_layers} layers, fingerprint {model.fingerprint[:12]}), "
          f"block size {engine.block_size}, prompt {len(prompt)} tokens")  # fmt: skip
    for name in ("cold", "warm"):
        r = report[name]
        assert isinstance(r, dict)
        print(f"  {name}: {r['cached_tokens']:5d} cached + {r['computed_tokens']:5d} computed tokens "
              f"in {r['s'] * 1000:8.1f} ms")  # fmt: skip
    print(f"  speed-up x{report['speedup']:.1f}; max |logit diff| {report['max_logit_diff']:.2e}; "
          f"same next token: {report['same_next_token']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
